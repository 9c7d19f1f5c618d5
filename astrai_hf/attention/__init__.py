"""Paged attention behind transformers' ``AttentionInterface``.

The registered name has no "flash" in it: transformers treats any name containing that word as a FlashAttention
variant and changes how it prepares inputs.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .reference import packed_paged_attention, paged_attention

ATTENTION_NAME = "astrai_paged"
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias")


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

    ``key``/``value`` and ``attention_mask`` are ignored: K/V come from the pool, masking from the metadata.

    Returns:
        ``(out [B, q_len, H, D], None)``; for a packed step ``(out [1, N, H, D], None)``.

    Raises:
        RuntimeError: called outside a patched forward with a PagedCache.
        NotImplementedError: the model passes an attention feature paged attention does not implement.
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
    if state.windows:  # the module's window is stale: its config was edited since the model was built
        sliding_window = state.windows.get(id(module), sliding_window)
    storage = (state.step_pool or state.pool).storage
    kw = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    if getattr(meta, "graph", False):
        from ..graphs import graph_decode_attention

        return graph_decode_attention(query, storage.k[layer], storage.v[layer], meta, **kw), None
    if meta.is_packed:
        return packed_paged_attention(query, storage.k[layer], storage.v[layer], meta, **kw), None
    return paged_attention(query, storage.k[layer], storage.v[layer], meta, **kw), None


def register() -> None:
    """Register the paged attention function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
