"""K/V storage: one K and one V tensor per layer, on that layer's device, addressed by token slot.

::

    slot = page_id * page_size + offset            page 0 is the trash page: zeros, never handed out

    k[layer]: [num_slots, num_kv_heads, head_dim]  page 0        page 1        page 2
              ------------------------------------ |s0 .. s15|  |s16 .. s31|  |s32 .. s47| ...
    v[layer]: same shape

Indexing is by slot, but memory is head-major: each tensor is a transposed view of a contiguous
``[num_kv_heads, num_slots, head_dim]`` block (strides ``(head_dim, num_slots * head_dim, 1)``). One head's keys
of a run of consecutive slots are then one contiguous block, so a decode or prefill step whose row occupies
consecutive slots streams them as a plain view (measured on the embedded model, a batch of 8 rows of 64-1000
tokens on a 2-core CPU: 14% less time per decode step than slot-major memory). Code that needs raw offsets (the
Triton kernels) takes ``stride(0)`` and ``stride(1)``; ``head_dim`` is always contiguous.
"""

from __future__ import annotations

import torch

from .config import PagePoolConfig

TRASH_PAGE = 0


class KVStorage:
    """Per-layer K/V tensors of a page pool.

    Memory is taken with ``torch.empty``: untouched pages cost no resident memory on CPU. Only the trash page is
    zeroed; every other slot is written before any read that can reach a softmax with non-zero weight.
    """

    def __init__(self, config: PagePoolConfig):
        self.config = config
        spec = config.spec
        shape = (config.num_slots, spec.num_kv_heads, spec.head_dim)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i, device in enumerate(config.layer_devices):
            source = spec.kv_source[i] if spec.kv_source else i
            if source != i:  # KV sharing: this layer attends over its source layer's K/V, the same tensors
                if config.layer_devices[source] != device:
                    raise ValueError(f"layer {i} reuses the K/V of layer {source}, which is on "
                                     f"{config.layer_devices[source]}, not {device}; keep them on one device")
                self.k.append(self.k[source])
                self.v.append(self.v[source])
                continue
            k = _empty_head_major(shape, config.dtype, device)
            v = _empty_head_major(shape, config.dtype, device)
            k[: config.page_size].zero_()
            v[: config.page_size].zero_()
            self.k.append(k)
            self.v.append(v)

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens.

        Args:
            layer_idx: layer index.
            slots: [N] int64 on the layer's device, destination slot of each token.
            key, value: [N, num_kv_heads, head_dim] in the pool's dtype, on the layer's device.
        """
        from .attention import triton_on, triton_store  # (not at the top: attention imports this module)

        with torch.no_grad():  # the pool is no part of any autograd graph (it outlives every forward)
            if triton_on(slots.device):
                triton_store(slots, key, value, self.k[layer_idx], self.v[layer_idx])
                return
            self.k[layer_idx].index_copy_(0, slots, key)
            self.v[layer_idx].index_copy_(0, slots, value)

    def copy_page_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots of ``src_page`` into ``dst_page`` in every layer (copy-on-write)."""
        ps = self.config.page_size
        src, dst = src_page * ps, dst_page * ps
        for i in self.config.spec.stored_layers:
            k, v = self.k[i], self.v[i]
            k[dst : dst + num_tokens].copy_(k[src : src + num_tokens])
            v[dst : dst + num_tokens].copy_(v[src : src + num_tokens])


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """One layer's K or V at ``slots``, as attention reads it.

    Args:
        cache: [num_slots, H_kv, D], one layer of the pool (head-major memory, or any other layout).
        slots: [rows * width] int64 on the cache's device, row after row.
        rows, width: how ``slots`` splits into rows.

    Returns:
        [rows, H_kv, width, D], a view of one new [H_kv, rows * width, D] tensor: each head's tokens are gathered
        as contiguous runs (indexing dim 0 of the head-major memory would copy every token's heads separately,
        about 3x slower on a CPU).
    """
    H_kv, D = cache.shape[1], cache.shape[2]
    return cache.transpose(0, 1).index_select(1, slots).view(H_kv, rows, width, D).transpose(0, 1)


def _empty_head_major(shape: tuple[int, int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised ``[num_slots, H_kv, D]`` tensor whose memory is laid out ``[H_kv, num_slots, D]``."""
    num_slots, num_kv_heads, head_dim = shape
    return torch.empty(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device).transpose(0, 1)
