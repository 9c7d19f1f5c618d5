"""Save and load a pool's prefix cache with safetensors, guarded by a fingerprint of the model.

File layout (one ``.safetensors`` file)::

    tensors   k.{layer}, v.{layer}: [num_saved_pages, page_size, num_kv_heads, head_dim] in the pool's dtype
    metadata  format   "astrai-hf-prefix-cache"
              version  "1"
              fingerprint  JSON: architecture, model_type, num_layers, num_kv_heads, head_dim, dtype, page_size,
                           weights (a blake2b digest over every parameter's name, shape, dtype and a strided sample
                           of its values)
              index    JSON list, parents before children: [parent_position or -1, [token ids, page_size or fewer]]
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .storage import gather_kv

FORMAT = "astrai-hf-prefix-cache"
VERSION = "1"
_SAMPLES_PER_TENSOR = 4096


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hex digest of the model's parameters: names, shapes, dtypes and up to 4096 evenly strided values each.

    Cheap (no full pass over the weights) and different for any two checkpoints that differ in more than a few
    isolated values. A tensor-parallel rank digests its own shards (no communication), so each rank's digest is
    its own. Parameters offloaded by a ``device_map`` (on ``meta``, no data here) count by name, shape and dtype.
    """
    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}".encode())
        local = p.to_local() if hasattr(p, "to_local") else p  # DTensor under tensor parallelism
        if local.is_meta:
            continue
        flat = local.detach().reshape(-1)
        if flat.numel():
            stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::stride][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def fingerprint(pool, model: torch.nn.Module) -> dict[str, str | int]:
    """What a saved prefix cache must match to be loaded: the pool's KV geometry, dtype, page size and the model's
    architecture and weights."""
    spec = pool.config.spec
    return {
        "architecture": type(model).__name__,
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "weights": weights_fingerprint(model),
    }


def _model_for(pool, model):
    model = model if model is not None else pool.model
    if model is None:
        raise ValueError(
            "this PagePool is not bound to a model (build it with PagePool.from_model or patch a model with it), "
            "so pass model=... to check the prefix cache against"
        )
    return model


def save_prefix_cache(pool, path: str | Path, model: torch.nn.Module | None = None) -> int:
    """Write the pool's cached prefix pages to ``path`` (a safetensors file).

    Args:
        pool: a PagePool with a prefix cache.
        path: destination file; overwritten.
        model: the model whose K/V the pool holds; defaults to the pool's bound model.

    Returns:
        pages written.

    Raises:
        ValueError: the pool has no prefix cache, or no model is known.
    """
    if pool.prefix_cache is None:
        raise ValueError("this PagePool was built with prefix_cache=False; there is nothing to save")
    model = _model_for(pool, model)
    pool.check_weights(model)  # pages computed by weights changed since must not be saved under the new ones
    nodes = list(pool.prefix_cache.nodes())
    position = {id(n): i for i, n in enumerate(nodes)}
    index = [[position.get(id(n.parent), -1), list(n.tokens)] for n in nodes]
    ps = pool.page_size
    tensors = {}
    for layer in range(pool.num_layers):
        k, v = pool.storage.k[layer], pool.storage.v[layer]
        slots = torch.tensor([n.page * ps + i for n in nodes for i in range(ps)], dtype=torch.long, device=k.device)
        # [pages, page_size, H_kv, D] in the file, gathered head by head from the head-major pool
        tensors[f"k.{layer}"] = gather_kv(k, slots, len(nodes), ps).transpose(1, 2).cpu().contiguous()
        tensors[f"v.{layer}"] = gather_kv(v, slots, len(nodes), ps).transpose(1, 2).cpu().contiguous()
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": json.dumps(fingerprint(pool, model), sort_keys=True),
        "index": json.dumps(index),
    }
    save_file(tensors, str(path), metadata=metadata)
    return len(nodes)


def load_prefix_cache(pool, path: str | Path, model: torch.nn.Module | None = None) -> int:
    """Load pages written by :func:`save_prefix_cache` into ``pool``'s prefix cache.

    Pages go into free pages only (nothing cached or in use is evicted for them), parents before children; what does
    not fit is skipped. Prefixes already cached are kept as they are.

    Args:
        pool: a PagePool with a prefix cache.
        path: a file written by :func:`save_prefix_cache`.
        model: the model the pool serves; defaults to the pool's bound model.

    Returns:
        pages loaded.

    Raises:
        ValueError: the file is not a saved prefix cache, or it was saved for another model, dtype or page size
            (the message names every field that differs); no model is known; the pool has no prefix cache.
        FileNotFoundError: ``path`` does not exist.
    """
    if pool.prefix_cache is None:
        raise ValueError("this PagePool was built with prefix_cache=False; it cannot load a prefix cache")
    model = _model_for(pool, model)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prefix cache file at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an astrai-hf prefix cache (format={meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise ValueError(f"{path} has prefix cache version {meta.get('version')!r}; this release reads {VERSION}")
        saved = json.loads(meta["fingerprint"])
        mine = fingerprint(pool, model)
        diff = [f"{k}: file {saved.get(k)!r} vs this pool/model {mine[k]!r}" for k in mine if saved.get(k) != mine[k]]
        if diff:
            raise ValueError(f"{path} was saved for a different model or pool; refusing to load it ({'; '.join(diff)})")
        index = json.loads(meta["index"])
        cache, alloc, ps = pool.prefix_cache, pool.allocator, pool.page_size
        nodes: list = [None] * len(index)
        placed: list[tuple[int, int]] = []  # (position in file, page)
        for i, (parent_pos, tokens) in enumerate(index):
            parent = cache.root if parent_pos < 0 else nodes[parent_pos]
            if parent is None:
                continue
            tokens = tuple(tokens)
            if not 0 < len(tokens) <= ps:
                raise ValueError(f"{path}: entry {i} holds {len(tokens)} tokens; page_size is {ps}")
            existing = cache.find(parent, tokens)
            if existing is not None:
                nodes[i] = existing
                continue
            if alloc.num_free == 0:
                continue
            (page,) = alloc.alloc(1)
            try:
                nodes[i] = cache.attach(parent, tokens, page)
            except BaseException:
                alloc.decref([page])
                raise
            placed.append((i, page))
        if placed:
            src = torch.tensor([i for i, _ in placed], dtype=torch.long)
            for layer in range(pool.num_layers):
                for name, store in (("k", pool.storage.k[layer]), ("v", pool.storage.v[layer])):
                    pages = f.get_tensor(f"{name}.{layer}").index_select(0, src)
                    slots = torch.tensor(
                        [p * ps + j for _, p in placed for j in range(ps)], dtype=torch.long, device=store.device
                    )
                    store.index_copy_(0, slots, pages.reshape(-1, *store.shape[1:]).to(store.device, store.dtype))
    return len(placed)
