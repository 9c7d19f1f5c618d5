"""Paged attention behind transformers' ``AttentionInterface``.

The registered name has no "flash" in it: transformers treats any name containing that word as a FlashAttention
variant and changes how it prepares inputs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers import AttentionInterface

from ..config import attention_drops_softcap, sdpa_refuses_softcap
from .reference import packed_paged_attention, paged_attention

ATTENTION_NAME = "astrai_paged"
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias")


def triton_on(device: torch.device) -> bool:
    """Whether steps on ``device`` run the Triton kernels: decode attention (the split-KV kernel) and the K/V store
    (one launch for K and V); on CUDA where Triton imports. Eager decode and a replayed decode graph then do the same
    arithmetic, so ``cuda_graphs`` on or off gives the same tokens. (Elsewhere both run the torch reference; tests
    switch this on under ``TRITON_INTERPRET=1``.)"""
    return device.type == "cuda" and _triton_kernels() is not None


def on_device(device: torch.device):
    """A context making ``device`` the current CUDA device where it is not (Triton launches a kernel, and a CUDA
    graph is captured and replayed, on the current device, whatever device the tensors are on: a model on
    ``cuda:1`` while ``cuda:0`` is current would have its kernels launched on the wrong device); else a no-op."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@functools.cache  # (asked once per layer and step)
def _triton_kernels():
    try:
        from . import triton_kernels
    except ImportError:  # no Triton (a CPU machine without it, or a platform it does not ship for)
        return None
    return triton_kernels


def triton_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                  req_rows: torch.Tensor, seq_lens: torch.Tensor, *, scaling: float | None, sliding_window,
                  softcap) -> torch.Tensor:
    """One new token per row through :func:`~astrai_hf.attention.triton_kernels.decode_attention`.

    Args:
        query: [B, H, 1, D] after RoPE.
        k_cache, v_cache: [num_slots, H_kv, D], one layer of the pool.
        table: ``req_to_token`` [rows, max_seq_len] int32; req_rows: [B] int64; seq_lens: [B] int64, tokens per row
            including this step's; all three on the query's device.

    Returns:
        [B, 1, H, D] in the query's dtype.
    """
    D = query.shape[-1]
    # the output in the query's dtype, rounded by the kernel (no cast launched after it); float64 and other dtypes
    # the kernel does not write come out in float32 and are cast
    writes = query.dtype in (torch.float32, torch.float16, torch.bfloat16)
    with on_device(query.device):
        out = _triton_kernels().decode_attention(
            query[:, :, 0].contiguous(), k_cache, v_cache, table, req_rows, seq_lens,
            scaling=D**-0.5 if scaling is None else scaling, sliding_window=sliding_window, softcap=softcap,
            out_dtype=query.dtype if writes else torch.float32,
        )
    return (out if writes else out.to(query.dtype))[:, None]


def triton_store(slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
    """``k_cache[slot_mapping[i]] = key[i]`` and the same for V, in one launch of
    :func:`~astrai_hf.attention.triton_kernels.store_kv` (two ``index_copy_`` otherwise).

    Args:
        slot_mapping: [N] int64; key, value: [N, H_kv, D] in the cache's dtype; k_cache, v_cache: [num_slots, H_kv,
            D], one layer of the pool; all on one CUDA device.
    """
    with on_device(key.device):
        _triton_kernels().store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """The ``AttentionInterface`` entry: finds the step's metadata on the patched module and runs paged attention.

    ``key``/``value`` and ``attention_mask`` are ignored: K/V come from the pool, masking from the metadata. A
    decode step (one token per row) on CUDA runs the Triton split-KV kernel, as a replayed decode graph does; other
    steps, and every step elsewhere, the torch reference.

    Returns:
        ``(out [B, q_len, H, D], None)``; for a packed step ``(out [1, N, H, D], None)``.

    Raises:
        RuntimeError: called outside a patched forward with a PagedCache.
        NotImplementedError: the model passes an attention feature paged attention does not implement.
        ValueError: the model passes a softcap and its config selects sdpa, which refuses it in this transformers.
    """
    ref = getattr(module, "_astrai_patch_state", None)  # a weak reference to the patch state (see patch.py)
    state = ref() if ref is not None else None
    meta = None if state is None else state.step
    if meta is None:
        raise RuntimeError(
            f"{type(module).__name__} ran astrai-hf paged attention outside a paged forward; "
            "use astrai_hf.patch(model) rather than selecting the attention implementation by hand"
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} passes `{name}`, which paged attention does not implement")
    layer = module.layer_idx
    if softcap is not None and attention_drops_softcap(getattr(module, "config", None)):
        if sdpa_refuses_softcap():  # (a config set to sdpa by hand: set_attn_implementation refuses it)
            raise ValueError(f"{type(module).__name__} passes an attention logit softcap, which transformers' sdpa "
                             "attention, selected by its config, does not support (stock raises too); select 'eager' "
                             "with model.set_attn_implementation('eager')")
        softcap = None  # (stock's sdpa ignores it)
    if state.windows:  # the module's window is stale: its config was edited since the model was built
        sliding_window = state.windows.get(id(module), sliding_window)
    storage = (state.step_pool or state.pool).storage
    kw = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    if getattr(meta, "graph", False):
        from ..graphs import graph_decode_attention

        return graph_decode_attention(query, storage.k[layer], storage.v[layer], meta, **kw), None
    if meta.is_packed:
        return packed_paged_attention(query, storage.k[layer], storage.v[layer], meta, **kw), None
    if (meta.q_len == 1 and meta.group == 1 and meta.write_src is None and triton_on(query.device)
            and meta.table.device == query.device):
        # the kernel a replayed decode graph runs (graphs.py): eager and replayed steps agree to the bit
        view = meta.on(query.device)
        return triton_decode(query, storage.k[layer], storage.v[layer], meta.table, view.req_rows, view.seq_lens_t,
                             **kw), None
    return paged_attention(query, storage.k[layer], storage.v[layer], meta, **kw), None


def register() -> None:
    """Register the paged attention function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
