"""Save and load a pool's prefix cache with safetensors, guarded by a fingerprint of the model.

File layout (one ``.safetensors`` file)::

    tensors   k.{layer}, v.{layer}: [num_saved_pages, page_size, num_kv_heads, head_dim] in the pool's dtype
    metadata  format   "astrai-hf-prefix-cache"
              version  "1"
              fingerprint  JSON: architecture, model_type, num_layers, num_kv_heads, head_dim, dtype, page_size,
                           weights_digest (the scheme of the weights digest), weights (a blake2b digest over every
                           parameter's and buffer's name, shape, dtype and mixed sums of its bytes, see
                           weights_fingerprint), config (a blake2b digest of the config fields that change what the
                           layers compute), behaviour (a blake2b digest of the modules' classes and forwards, float
                           settings, hooks and peft adapter state, see behaviour_fingerprint)
              index    JSON list, parents before children: [parent_position or -1, [token ids, page_size or fewer]];
                       only an entry of page_size tokens has children
              kv_digest  blake2b digest of the index text, then of the bytes of k.0, v.0, k.1, ... in that order
                       (checked on load: a file whose index or K/V were damaged is refused instead of serving
                       wrong prefixes)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import attention_drops_softcap
from .storage import gather_kv

logger = logging.getLogger(__name__)

FORMAT = "astrai-hf-prefix-cache"
VERSION = "1"


# config fields that name, label or steer a model's use and leave what its layers compute alone
_CONFIG_IGNORED = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states", "id2label", "label2id", "problem_type", "finetuning_task",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "task_specific_params", "prefix", "chunk_size_feed_forward",
})


def _config_fields(value, ignored=_CONFIG_IGNORED):
    """``value`` (a config's dict) without the fields in ``ignored`` or private ones, at every depth (composite
    models nest their text and vision configs)."""
    if isinstance(value, dict):
        return {k: _config_fields(v, ignored) for k, v in value.items() if k not in ignored and not k.startswith("_")}
    if isinstance(value, (list, tuple)):
        return [_config_fields(v, ignored) for v in value]
    return value


def config_fingerprint(model: torch.nn.Module, ignore: frozenset = frozenset()) -> str:
    """A hex digest of the model's config, the fields that change what its layers compute (RoPE theta and scaling,
    sliding windows, norms' epsilon, activation, soft-capping, ...): everything but names, token ids, labels and
    output switches, and the fields in ``ignore``. Empty string for a module without a ``config``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return ""
    fields = _config_fields(config.to_dict(), _CONFIG_IGNORED | ignore)
    if any(attention_drops_softcap(c) for c in _attention_configs(config)):
        fields["(attention drops the softcap)"] = True  # (its attention is sdpa: see attention_drops_softcap)
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _attention_configs(config) -> list:
    """``config`` and its text config (composite models keep the decoder's attention settings there)."""
    text = getattr(config, "text_config", None)
    return [config] + ([text] if text is not None and text is not config else [])


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hex digest of the model's parameters and buffers: names, shapes, dtypes and their every bit.

    Each tensor's bytes are read as 32-bit words, and runs of :data:`_WORDS_PER_SUM` words are reduced to one
    32-bit sum each (see :func:`_run_sums`: every word is first mixed with its place in the run, so the sum sees
    where a value sits, not only which values there are); the digest hashes those sums. A change to any single
    word changes its run's sum; several changes in one run (values moved, swapped or negated in pairs) leave it
    alike only by a 1-in-2**32 chance. It costs a few elementwise passes over the weights on their own device
    (0.3-1.5 s for the 135M embedded model in float32 on a busy 2-core CPU), and no copy to the host beyond the sums. It is computed when
    a pool binds a model and after the weights changed, not per call.

    Buffers count because some set what the layers compute as weights do (RoPE's ``inv_freq``, from the config's
    theta and scaling). A tensor-parallel rank digests its own shards (no communication), so each rank's digest
    is its own. Tensors offloaded by a ``device_map`` (on ``meta`` between forwards) are read where accelerate
    loads them from (its hooks' weights maps); a ``meta`` tensor nothing loads counts by name, shape and dtype.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(_WEIGHTS_DIGEST.encode())
    named = [("param", *item) for item in model.named_parameters()] + [("buffer", *item) for item in model.named_buffers()]
    for kind, name, p in sorted(named, key=lambda item: (item[0], item[1])):
        h.update(f"{kind}|{name}|{tuple(p.shape)}|{p.dtype}".encode())
        local = p.to_local() if hasattr(p, "to_local") else p  # DTensor under tensor parallelism
        if local.is_meta:  # offloaded by a device_map: its values are where accelerate loads them from
            local = _offloaded_value(model, name)
        if local is None or local.is_meta or not local.numel():
            continue
        for part in _plain_parts(local.detach()):
            h.update(_run_sums(part))
    from .pool import packed_params

    for name in sorted(packed_params(model)):  # quantize_dynamic's packed weights
        holder = model.get_submodule(name)
        unpack = getattr(holder, "_weight_bias", None)
        parts = unpack() if callable(unpack) else ()
        h.update(f"packed|{name}|{type(holder).__name__}".encode())
        for t in parts if isinstance(parts, (tuple, list)) else (parts,):
            if isinstance(t, torch.Tensor) and t.numel():
                h.update(f"{tuple(t.shape)}|{t.dtype}".encode())
                for part in _plain_parts(t.detach()):
                    h.update(_run_sums(part))
    return h.hexdigest()


def _offloaded_value(model: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The values of the tensor ``name`` that an accelerate hook loads for each forward (a layer a ``device_map``
    offloaded to the CPU or disk keeps it on ``meta``), read from the hook's weights map; None if none holds it."""
    from .pool import accelerate_hooks

    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        try:
            module = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        for h in accelerate_hooks(module):
            weights = getattr(h, "weights_map", None)
            if getattr(h, "offload", False) and weights is not None:
                try:
                    return torch.as_tensor(weights[".".join(parts[cut:])])
                except (KeyError, TypeError):
                    continue
    return None


def _plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """Strided tensors holding every bit of ``t``: ``t`` itself; a quantized tensor's integer values with its scales
    and zero points; a sparse tensor's values as a dense one; the inner tensors of a tensor subclass that names
    them (``__tensor_flatten__``: torchao's quantized weights, say, whose values have no byte view)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and callable(flatten):
        names, context = flatten()
        parts = [part for name in names for part in _plain_parts(getattr(t, name))]
        text = repr(context)  # (block sizes, dtypes: part of the values; not where it names an object's address)
        if " at 0x" not in text:
            parts.append(torch.frombuffer(bytearray(f"{type(t).__name__}|{text}".encode()), dtype=torch.uint8))
        return parts
    if t.is_quantized:
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            params = [torch.tensor([t.q_scale()], dtype=torch.float64), torch.tensor([t.q_zero_point()])]
        else:
            params = [t.q_per_channel_scales(), t.q_per_channel_zero_points(), torch.tensor([t.q_per_channel_axis()])]
        return [t.int_repr(), *params]
    if t.layout != torch.strided:
        return [t.to_dense()]
    return [t]


_WORDS_PER_SUM = 256
_WEIGHTS_DIGEST = "fmix-word-sums-256"  # the scheme, part of every digest: a file of another scheme is refused as such
_CHUNK_RUNS = 1 << 14  # runs reduced per pass: bounds the temporaries to 16 MiB whatever the tensor's size


def _int32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


# one odd multiplier per place in a run (odd: multiplying by it is a bijection of the 32-bit words)
_PLACE = [_int32((2 * i + 1) * 0x9E3779B1) for i in range(_WORDS_PER_SUM)]
_FINAL, _FINAL2 = _int32(0x85EBCA6B), _int32(0xC2B2AE35)  # odd: MurmurHash3's finalising multipliers


def _run_sums(t: torch.Tensor) -> bytes:
    """The tensor's bytes as int32 words; each run of ``_WORDS_PER_SUM`` words (the last one shorter) reduced to
    ``sum_i fmix(word_i * place_i)`` modulo 2**32, where ``place_i`` is an odd constant per place in the run and
    ``fmix`` is MurmurHash3's 32-bit finaliser (xor-shifts and multiplications by odd constants: a bijection that
    spreads each input bit over the output). Each word's term is a bijection of that word, so a change of one word
    always changes the sum;
    integer arithmetic wraps the same way on every device, so the sums do not depend on where the tensor lives.
    A tail of fewer than 4 bytes is taken as is."""
    try:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass without a byte view: its values
        raw = t.to(torch.float64).contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a view at an odd place in its storage (vector_to_parameters): words need a copy
        raw = raw.clone()
    whole = raw.numel() // 4 * 4
    words = raw[:whole].view(torch.int32)
    place = torch.tensor(_PLACE, dtype=torch.int32, device=words.device)
    n = words.numel()
    runs = n // _WORDS_PER_SUM
    sums = []
    for lo in range(0, runs, _CHUNK_RUNS):
        hi = min(runs, lo + _CHUNK_RUNS)
        block = words[lo * _WORDS_PER_SUM : hi * _WORDS_PER_SUM].view(hi - lo, _WORDS_PER_SUM)
        sums.append(_mixed(block, place).sum(1, dtype=torch.int32))
    if n > runs * _WORDS_PER_SUM:
        tail = words[runs * _WORDS_PER_SUM :]
        sums.append(_mixed(tail, place[: tail.numel()]).sum(0, dtype=torch.int32)[None])
    out = torch.cat(sums).cpu().numpy().tobytes() if sums else b""
    return out + raw[whole:].cpu().numpy().tobytes()


def _mixed(words: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
    # MurmurHash3's 32-bit finaliser over word * place: every step a bijection, and a flipped input bit flips
    # about half the output bits, so the changes of two words cancel in a run's sum by chance alone. Shifts are
    # logical: the masks drop the copies of the sign bit an int32 shift brings in
    x = words * place
    x ^= (x >> 16) & 0xFFFF
    x *= _FINAL
    x ^= (x >> 13) & 0x7FFFF
    x *= _FINAL2
    x ^= (x >> 16) & 0xFFFF
    return x


def model_fingerprint(model: torch.nn.Module) -> str:
    """Weights and config together: two models whose K/V for the same tokens could differ digest differently."""
    return f"{weights_fingerprint(model)}.{config_fingerprint(model)}"


def fingerprint(pool, model: torch.nn.Module, weights: str | None = None) -> dict[str, str | int]:
    """What a saved prefix cache must match to be loaded: the pool's KV geometry, dtype, page size and the model's
    architecture, weights and config. ``weights``: the model's :func:`weights_fingerprint`, where the caller has
    taken it already (one pass over the weights)."""
    spec = pool.config.spec
    return {
        "architecture": type(model).__name__,
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "weights_digest": _WEIGHTS_DIGEST,
        "weights": weights_fingerprint(model) if weights is None else weights,
        "config": config_fingerprint(model),
        "behaviour": behaviour_fingerprint(model),
    }


def behaviour_fingerprint(model: torch.nn.Module) -> str:
    """A hex digest of what changes the model's outputs besides its weights and config: each module's class and a
    ``forward`` set on it (and its code, where it is not a class's own), its float settings (``scaling``; torch's
    own modules' int and str settings too, a swapped activation's ``beta``), the hooks of the caller's, and each
    peft tuner layer's adapter state (the adapter active, adapters disabled, merged, scaled); see
    :func:`~astrai_hf.pool.portable_behaviour`."""
    from .pool import portable_behaviour

    text = json.dumps(portable_behaviour(model))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _model_for(pool, model):
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the model whose K/V the pool holds) or None, got "
                        f"{type(model).__name__}")
    model = model if model is not None else pool.model
    if model is None and pool._model_ref is not None:
        raise ValueError(
            "the model this PagePool was bound to no longer exists (a pool holds its model weakly), so pass "
            "model=... to check the prefix cache against"
        )
    if model is None:
        raise ValueError(
            "this PagePool is not bound to a model (build it with PagePool.from_model or patch a model with it), "
            "so pass model=... to check the prefix cache against"
        )
    return model


def _check_holds_model(pool, model) -> None:
    """Raise ``ValueError`` when ``pool``'s cached prefixes were computed by another model than ``model`` (other
    weights, config or behaviour): saving them under ``model``'s fingerprint would have bound the pool to it, which
    drops them, and written an empty file."""
    held = pool.held_model_key()
    if held is None or model is pool.model:
        return
    digest = pool._fingerprint(model)
    if (digest, pool._fingerprints[model][0].behaviour) != held:
        bound = pool.model
        owner = f"the {type(bound).__name__} the pool is bound to" if bound is not None else "a model no longer alive"
        raise ValueError(
            f"this PagePool's cached prefixes were computed by {owner}, not by the {type(model).__name__} passed as "
            "model= (other weights, config or behaviour); pass the model they belong to (model=None: the bound "
            "model)")


def _as_path(path) -> Path:
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes):
        return Path(path)
    raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}: {path!r}")


def save_prefix_cache(pool, path: str | Path, model: torch.nn.Module | None = None) -> int:
    """Write the pool's cached prefix pages to ``path`` (a safetensors file).

    Args:
        pool: a PagePool with a prefix cache.
        path: destination file; overwritten.
        model: the model whose K/V the pool holds; defaults to the pool's bound model.

    Returns:
        pages written.

    Raises:
        ValueError: the pool has no prefix cache, no model is known, or ``model`` is not the model that computed
            the cached prefixes (the pool and the file are left as they were); or the weights' contents changed
            since the pool's last check through writes into ``param.data`` (then the cached prefixes are dropped
            and the file is left as it was).
        TypeError: ``path`` is not a str or ``os.PathLike``; ``model`` is not a ``torch.nn.Module``.
        FileNotFoundError: the folder of ``path`` does not exist.
        IsADirectoryError: ``path`` is a folder.
    """
    path = _as_path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save the prefix cache to {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"cannot save the prefix cache to {path}: it is a folder; give a file's path")
    if pool.prefix_cache is None:
        raise ValueError("this PagePool was built with prefix_cache=False; there is nothing to save")
    model = _model_for(pool, model)
    _check_holds_model(pool, model)
    pool.check_weights(model)  # pages computed by weights changed since must not be saved under the new ones
    weights = weights_fingerprint(model)  # (one pass over the weights, for the check and the file's fingerprint)
    if pool.drop_if_rewritten(model, weights):
        raise ValueError(
            f"the {type(model).__name__}'s weights changed since the pool's cached prefixes were computed, through "
            "writes no check sees (into param.data: peft's merge_and_unload() and hotswap_adapter write so); the "
            "prefixes of the old weights were dropped and nothing was saved: generate again, then save")
    nodes = list(pool.prefix_cache.nodes())
    position = {id(n): i for i, n in enumerate(nodes)}
    index = [[position.get(id(n.parent), -1), list(n.tokens)] for n in nodes]
    ps = pool.page_size
    tensors = {}
    slots_on = _slots_by_device([n.page for n in nodes], ps)
    for layer in range(pool.num_layers):
        k, v = pool.storage.k[layer], pool.storage.v[layer]
        slots = slots_on(k.device)
        # [pages, page_size, H_kv, D] in the file, gathered head by head from the head-major pool
        tensors[f"k.{layer}"] = gather_kv(k, slots, len(nodes), ps).transpose(1, 2).cpu().contiguous()
        tensors[f"v.{layer}"] = gather_kv(v, slots, len(nodes), ps).transpose(1, 2).cpu().contiguous()
    index_text = json.dumps(index)
    names = [f"{name}.{layer}" for layer in range(pool.num_layers) for name in "kv"]
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": json.dumps(fingerprint(pool, model, weights), sort_keys=True),
        "index": index_text,
        "kv_digest": _kv_digest(index_text, (tensors[name] for name in names)),
    }
    save_file(tensors, str(path), metadata=metadata)
    return len(nodes)


def load_prefix_cache(pool, path: str | Path, model: torch.nn.Module | None = None) -> int:
    """Load pages written by :func:`save_prefix_cache` into ``pool``'s prefix cache.

    Pages go into free pages only (nothing cached or in use is evicted for them), parents before children; what does
    not fit is skipped, with a warning on the ``astrai_hf`` logger. Prefixes already cached are kept as they are.

    Args:
        pool: a PagePool with a prefix cache.
        path: a file written by :func:`save_prefix_cache`.
        model: the model the pool serves; defaults to the pool's bound model.

    Returns:
        pages loaded.

    Raises:
        ValueError: the file is not a saved prefix cache, or it was saved for another model, dtype or page size
            (the message names every field that differs); no model is known; the pool has no prefix cache.
        TypeError: ``path`` is not a str or ``os.PathLike``; ``model`` is not a ``torch.nn.Module``.
        FileNotFoundError: ``path`` does not exist.
    """
    if pool.prefix_cache is None:
        raise ValueError("this PagePool was built with prefix_cache=False; it cannot load a prefix cache")
    model = _model_for(pool, model)
    path = _as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prefix cache file at {path}")
    try:
        opened = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors' own error type: not a safetensors file, or a damaged one
        raise ValueError(f"{path} is not an astrai-hf prefix cache: not a readable safetensors file ({e})") from e
    with opened as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an astrai-hf prefix cache (format={meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise ValueError(f"{path} has prefix cache version {meta.get('version')!r}; this release reads {VERSION}")
        saved = _saved_fingerprint(path, meta)
        if "config" not in saved or "behaviour" not in saved or saved.get("weights_digest") != _WEIGHTS_DIGEST:
            lacks = (f"weights digest {saved.get('weights_digest', 'of sampled values')!r}, this release computes "
                     f"{_WEIGHTS_DIGEST!r}" if "config" not in saved or saved.get("weights_digest") != _WEIGHTS_DIGEST
                     else "it holds no digest of the model's adapters, hooks and modules")
            raise ValueError(
                f"{path} was saved by an earlier release of astrai-hf, whose fingerprint of the model this release "
                f"cannot check ({lacks}); compute the prefixes again and save a new file"
            )
        mine = fingerprint(pool, model)
        diff = [f"{k}: file {saved.get(k)!r} vs this pool/model {mine[k]!r}" for k in mine if saved.get(k) != mine[k]]
        if diff:
            hint = ("; behaviour is what the model runs besides its weights and config: the peft adapter active, "
                    "disabled, merged or scaled, a module or forward swapped, a float attribute such as scaling, "
                    "hooks of yours; set the model up as it was when the file was saved"
                    if saved.get("behaviour") != mine["behaviour"] else "")
            raise ValueError(f"{path} was saved for a different model or pool; refusing to load it "
                             f"({'; '.join(diff)}){hint}")
        index = _read_index(path, meta, pool.page_size)
        _check_tensors(path, f, pool, len(index))
        # read once, into memory of their own (safetensors maps the file): the pages copied are the bytes the
        # digest checked, even where the file is rewritten in place meanwhile (a copy or rsync onto it; a save of
        # astrai-hf's own writes a new file instead)
        names = [f"{name}.{layer}" for layer in range(pool.num_layers) for name in "kv"]
        tensors = {name: f.get_tensor(name).clone() for name in names}
        if "kv_digest" not in meta:  # (every file whose fingerprint holds the behaviour digest has one)
            raise ValueError(f"{path} holds no digest of its index and K/V data (the file is damaged); refusing to "
                             "load it")
        if _kv_digest(meta["index"], (tensors[name] for name in names)) != meta["kv_digest"]:
            raise ValueError(f"{path}: the index and K/V data do not match the digest saved with them (the "
                             "file is damaged); refusing to load it")
        pool.check_weights(model)  # cached pages of weights changed since must not shadow the file's
        cache, alloc, ps = pool.prefix_cache, pool.allocator, pool.page_size
        nodes: list = [None] * len(index)
        placed: list[tuple[int, int]] = []  # (position in file, page)
        try:
            for i, (parent_pos, tokens) in enumerate(index):
                parent = cache.root if parent_pos < 0 else nodes[parent_pos]
                if parent is None:
                    continue
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
                slots_on = _slots_by_device([p for _, p in placed], ps)
                for layer in range(pool.num_layers):
                    for name, store in (("k", pool.storage.k[layer]), ("v", pool.storage.v[layer])):
                        pages = tensors[f"{name}.{layer}"].index_select(0, src)
                        store.index_copy_(0, slots_on(store.device),
                                          pages.reshape(-1, *store.shape[1:]).to(store.device, store.dtype))
        except BaseException:
            # nothing half-loaded stays indexed: a page whose K/V were not all written would serve wrong prefixes
            for i, _ in reversed(placed):  # children before parents
                cache.remove(nodes[i])
            raise
    skipped = sum(node is None for node in nodes)
    if skipped:
        logger.warning("loaded %d of the %d pages in %s: the pool had no free page for the other %d (loading "
                       "evicts nothing)", len(placed), len(index), path, skipped)
    return len(placed)


def _saved_fingerprint(path: Path, meta: dict) -> dict:
    """The fingerprint a file's header holds, a JSON object.

    Raises:
        ValueError: the header has none, or one that is not a JSON object (a damaged file).
    """
    text = meta.get("fingerprint")
    try:
        saved = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: its header's fingerprint field is {'missing' if text is None else 'damaged'} "
                         f"({text!r:.80}); the file is damaged, refusing to load it")
    return saved


def _kv_digest(index: str, tensors) -> str:
    """blake2b hex digest of the index (its JSON text) and of the bytes of ``tensors`` (CPU), in order."""
    h = hashlib.blake2b(index.encode(), digest_size=16)
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _slots_by_device(pages: list[int], page_size: int):
    """A function of a device giving the slots of ``pages`` (every slot of each, page after page) as an int64
    tensor there, built once per device (a pool under a ``device_map`` spans several)."""
    slots = [p * page_size + j for p in pages for j in range(page_size)]
    made: dict[torch.device, torch.Tensor] = {}

    def on(device: torch.device) -> torch.Tensor:
        if device not in made:
            made[device] = torch.tensor(slots, dtype=torch.long, device=device)
        return made[device]

    return on


def _read_index(path: Path, meta: dict, page_size: int) -> list[tuple[int, tuple[int, ...]]]:
    """The file's index as ``(parent position or -1, token ids)`` pairs, every entry checked before any is used.

    Raises:
        ValueError: the index is not JSON, or an entry is malformed, names a parent that does not come before it,
            or holds no tokens or more than ``page_size``.
    """
    try:
        raw = json.loads(meta["index"])
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the prefix cache index is missing or not JSON ({e})") from None
    if not isinstance(raw, list):
        raise ValueError(f"{path}: the prefix cache index must be a list, got {type(raw).__name__}")
    index = []
    for i, entry in enumerate(raw):
        ok = isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and isinstance(entry[1], list)
        if not ok or not all(type(t) is int and 0 <= t < 2**63 for t in entry[1]):  # (token ids are int64)
            raise ValueError(f"{path}: entry {i} of the index is not [parent, [token ids]] (ids 0 to 2**63 - 1): "
                             f"{entry!r:.80}")
        parent_pos, tokens = entry
        if not -1 <= parent_pos < i:
            raise ValueError(f"{path}: entry {i} names parent {parent_pos}; a parent must come before its children")
        if not 0 < len(tokens) <= page_size:
            raise ValueError(f"{path}: entry {i} holds {len(tokens)} tokens; page_size is {page_size}")
        if parent_pos >= 0 and len(index[parent_pos][1]) < page_size:
            raise ValueError(f"{path}: entry {i} continues entry {parent_pos}, which holds "
                             f"{len(index[parent_pos][1])} of {page_size} tokens (only a full page has children)")
        index.append((parent_pos, tuple(tokens)))
    return index


def _check_tensors(path: Path, f, pool, num_pages: int) -> None:
    """Raises ValueError unless the file holds ``k.{layer}`` and ``v.{layer}`` of shape
    [num_pages, page_size, H_kv, D] for every layer of the pool."""
    keys = set(f.keys())
    for layer in range(pool.num_layers):
        want = [num_pages, pool.page_size, *pool.storage.k[layer].shape[1:]]
        for name in (f"k.{layer}", f"v.{layer}"):
            if name not in keys:
                raise ValueError(f"{path}: tensor {name!r} is missing ({pool.num_layers} layers expected)")
            shape = list(f.get_slice(name).get_shape())
            if shape != want:
                raise ValueError(f"{path}: tensor {name!r} has shape {shape}, expected {want}")
