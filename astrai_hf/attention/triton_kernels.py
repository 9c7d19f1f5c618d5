"""Triton kernels for paged attention: K/V store, split-KV decode, and varlen prefill / extend.

Each kernel has a plain torch twin in :mod:`astrai_hf.attention.reference` and is tested against it (on CPU under
``TRITON_INTERPRET=1``, on GPU in ``tests/gpu``). Layout, as everywhere in astrai-hf::

    k_cache, v_cache   [num_slots, H_kv, D]          one layer of the pool; slot = page * page_size + offset;
                                                     any strides with D contiguous (the pool's memory is
                                                     head-major), passed to the kernels as stride_slot/stride_head
    req_to_token       [max_reqs, max_seq_len] int32  slot of token t of request row r

Decode follows the split-KV ("flash-decoding") scheme of FlashDecoding (Dao et al., 2023) and SGLang's
``decode_attention``: phase 1 gives every (row, KV head, split) a slice of the row's tokens and keeps an online
softmax (running max, sum and weighted V) for the whole GQA group of query heads, so each K/V page is read once per
group; phase 2 merges the splits. The launch grid depends only on the batch size, the head counts and a fixed
number of splits, never on sequence lengths, which are read from device buffers: a captured CUDA graph can replay it
as lengths grow.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

DEFAULT_NUM_SPLITS = 8


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """``(stride_slot, stride_head)`` in elements of a layer's K and V (which share one layout).

    Raises:
        ValueError: K and V strides differ, or ``head_dim`` is not contiguous.
    """
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError(f"k_cache/v_cache need one layout with head_dim contiguous; strides are "
                         f"{tuple(k_cache.stride())} and {tuple(v_cache.stride())}")
    return k_cache.stride(0), k_cache.stride(1)


def _check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            sliding_window: int | None, softcap: float | None, req_to_token: torch.Tensor,
                            batch: int, **index: torch.Tensor) -> None:
    """The kernels index raw pointers: refuse inputs their offsets would misread. Only shapes and host values are
    checked; the values inside the device tensors (rows within ``req_to_token``, lengths within its width) are not,
    as reading them would synchronise with the device.

    Raises:
        ValueError: ``query`` is not contiguous, its heads are not a multiple of ``k_cache``'s, its head size or
            ``v_cache``'s shape is not ``k_cache``'s, the window is not positive, the softcap is not positive,
            ``req_to_token``'s columns are not adjacent (its rows may be strided), or an index tensor (``index``,
            by name) is not contiguous or not 1-D of ``batch`` entries (``qo_indptr``: ``batch + 1``).
    """
    if query.dim() != 3 or k_cache.dim() != 3 or query.shape[2] != k_cache.shape[2]:
        raise ValueError(f"query [tokens, H, D] and k_cache [num_slots, H_kv, D] must share D, got shapes "
                         f"{tuple(query.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache of shape {tuple(v_cache.shape)} must have k_cache's {tuple(k_cache.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D [rows, max_seq_len], got shape {tuple(req_to_token.shape)}")
    if req_to_token.shape[1] > 1 and req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token [rows, max_seq_len] must have adjacent columns (stride 1), got shape "
                         f"{tuple(req_to_token.shape)} and strides {req_to_token.stride()}")
    H, H_kv = query.shape[1], k_cache.shape[1]
    if H % H_kv:
        raise ValueError(f"query has {H} heads, not a multiple of the cache's {H_kv} KV heads")
    if not query.is_contiguous():
        raise ValueError(f"query of shape {tuple(query.shape)} must be contiguous, got strides {query.stride()}")
    if sliding_window is not None and not sliding_window > 0:  # (NaN too)
        raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
    for name, t in index.items():
        entries = batch + 1 if name == "qo_indptr" else batch
        if tuple(t.shape) != (entries,):
            raise ValueError(f"{name} must be 1-D with {entries} entries (batch {batch}), got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _is_int(value) -> bool:
    """An integer (numpy's and 0-d integer tensors too), not a bool."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and (
            value.dtype != torch.bool)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _window(sliding_window) -> int:
    """The window as the kernels take it (0: none). Keys ``t > q - sliding_window`` are the reference's (and
    transformers' mask's); for integer ``t`` and ``q`` those are ``t > q - ceil(sliding_window)``, so a window
    that is not a whole number (a config's 2.5) selects the same keys on both paths."""
    return math.ceil(sliding_window) if sliding_window is not None else 0


def _check_buffer(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes=(torch.float32,)) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous():
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a contiguous {names} tensor of shape {shape}, got {t.dtype} "
                         f"{tuple(t.shape)} with strides {t.stride()}")


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_slot, stride_head,
                     H_KV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    src = (i.to(tl.int64) * H_KV + h) * D + d  # int64: a long prefill's K can pass 2**31 elements
    dst = slot * stride_slot + h.to(tl.int64) * stride_head + d  # int64: a head's plane can pass 2**31 elements
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k_cache[slot_mapping[i]] = key[i]`` (and V): key/value [N, H_kv, D], slot_mapping [N] int; the caches
    [num_slots, H_kv, D] in any layout with D contiguous."""
    n, H_kv, D = key.shape
    if n == 0:
        return
    stride_slot, stride_head = _cache_strides(k_cache, v_cache)
    _store_kv_kernel[(n, H_kv)](key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping.contiguous(),
                                stride_slot, stride_head, H_KV=H_kv, D=D, BLOCK_D=triton.next_power_of_2(D))


@triton.jit
def _soft_capped(s, softcap):
    """``softcap * tanh(s / softcap)`` (Gemma 2's logit soft-capping). Near 0, where ``2 / (1 + exp(-2x)) - 1`` loses
    digits to cancellation (an absolute error of about ``softcap * 1e-7`` in float32), a Taylor polynomial of tanh
    gives it, its error below 1e-9 relative for ``|x| < 0.125``."""
    x = s / softcap
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    return softcap * tl.where(tl.abs(x) < 0.125, series, 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_rows_ptr, seq_lens_ptr,
    mid_o_ptr, mid_lse_ptr,
    scaling, softcap, window,
    stride_table, stride_slot, stride_head, H: tl.constexpr, D: tl.constexpr,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)  # (int32 or int64 lengths)
    row = tl.load(req_rows_ptr + b).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < D
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)  # the query is token seq_len - 1; keys t > q - window
    span = seq_len - first
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    kv_base = kv_head.to(tl.int64) * stride_head  # int64: a head's plane can pass 2**31 elements
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        t = start + n
        t_mask = t < hi
        slots = tl.load(req_to_token_ptr + row * stride_table + t, mask=t_mask, other=0).to(tl.int64)
        kv_off = (slots * stride_slot + kv_base)[:, None] + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [BLOCK_G, BLOCK_N]
        if USE_SOFTCAP:
            s = _soft_capped(s, softcap)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out_off = ((b * H + heads) * NUM_SPLITS + split)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(mid_o_ptr + out_off[:, None] * D + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(mid_lse_ptr + out_off, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    lse = tl.load(mid_lse_ptr + bh * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    o = tl.load(mid_o_ptr + (bh * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=s_mask[:, None] & (d < D)[None, :],
                other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    if OUT_BF16:
        # float32 -> bfloat16 rounded to nearest, ties to even, on the bits (as torch rounds it; Triton's interpreter
        # would truncate), then stored through an int16 view of the output
        bits = out.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(out != out, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
        tl.store(out_ptr + bh * D + d, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=d < D)
    else:
        tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int = DEFAULT_NUM_SPLITS,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One query token per row over that row's paged keys ``0 .. seq_lens[b] - 1`` (the query is the last one).

    Args:
        query: [B, H, D], contiguous.
        k_cache, v_cache: [num_slots, H_kv, D], one layout with D contiguous; H a multiple of H_kv.
        req_to_token: [max_reqs, max_seq_len] int32.
        req_rows: [B] int, the table row of each batch row.
        seq_lens: [B] int32 or int64 on the device, tokens per row including this step's (at least 1).
        scaling: multiplier of ``q @ k``.
        sliding_window: keys ``t > seq_len - 1 - sliding_window`` only, or None.
        softcap: Gemma2 logit soft-capping, or None.
        num_splits: KV splits per (row, KV head); fixed, so the grid never depends on lengths.
        out: optional [B, H, D] output buffer (fixed address for graph capture), float32, float16 or bfloat16.
        workspace: optional ``(mid_o [B, H, num_splits, D], mid_lse [B, H, num_splits])`` float32 scratch.
        out_dtype: the dtype of the output made when ``out`` is not given. Attention is accumulated in float32
            either way; the merge rounds it to a 16-bit ``out`` (to nearest, ties to even, as ``Tensor.to`` does),
            which spares a cast launched after the kernel.

    Returns:
        [B, H, D] in ``out``'s dtype (``out_dtype``).

    Raises:
        ValueError: a non-contiguous ``query``, ``req_rows`` or ``seq_lens``; ``req_rows`` or ``seq_lens`` not of
            B entries; H not a multiple of H_kv; a window or softcap not positive; ``num_splits`` not a positive
            int; ``out`` or ``workspace`` not contiguous, of the shapes above, in the dtypes above (``out_dtype``
            too). The values of ``req_rows`` and
            ``seq_lens`` are not checked (that would synchronise with the device).
    """
    B = query.shape[0] if query.dim() == 3 else -1
    _check_attention_inputs(query, k_cache, v_cache, sliding_window, softcap, req_to_token, B,
                            req_rows=req_rows, seq_lens=seq_lens)
    if not _is_int(num_splits) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    num_splits = int(num_splits)
    B, H, D = query.shape
    H_kv = k_cache.shape[1]
    group = H // H_kv
    if out is None:
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
        out = torch.empty(B, H, D, dtype=out_dtype, device=query.device)
    _check_buffer("out", out, (B, H, D), _OUT_DTYPES)
    if workspace is None:
        workspace = (torch.empty(B, H, num_splits, D, dtype=torch.float32, device=query.device),
                     torch.empty(B, H, num_splits, dtype=torch.float32, device=query.device))
    mid_o, mid_lse = workspace
    _check_buffer("workspace[0] (mid_o)", mid_o, (B, H, num_splits, D))
    _check_buffer("workspace[1] (mid_lse)", mid_lse, (B, H, num_splits))
    _decode_split_kernel[(B, H_kv, num_splits)](
        query, k_cache, v_cache, req_to_token, req_rows, seq_lens, mid_o, mid_lse,
        float(scaling), float(softcap or 1.0), _window(sliding_window),
        req_to_token.stride(0), *_cache_strides(k_cache, v_cache), H=H, D=D, GROUP=group,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(triton.next_power_of_2(group), 2), BLOCK_D=triton.next_power_of_2(D), BLOCK_N=16,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
    )
    bf16 = out.dtype == torch.bfloat16
    _decode_merge_kernel[(B * H,)](mid_o, mid_lse, out.view(torch.int16) if bf16 else out, D=D, NUM_SPLITS=num_splits,
                                   BLOCK_S=max(triton.next_power_of_2(num_splits), 2),
                                   BLOCK_D=triton.next_power_of_2(D), OUT_BF16=bf16)
    return out


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_rows_ptr, seq_lens_ptr, qo_indptr_ptr, out_ptr,
    scaling, softcap, window,
    stride_table, stride_slot, stride_head, H: tl.constexpr, D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + b).to(tl.int64)  # int64: a long extend's Q/O can pass 2**31 elements
    n_q = tl.load(qo_indptr_ptr + b + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prev = seq_len - n_q
    row = tl.load(req_rows_ptr + b).to(tl.int64)
    kv_head = head // GROUP
    kv_base = kv_head.to(tl.int64) * stride_head  # int64: a head's plane can pass 2**31 elements
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < n_q
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q = tl.load(q_ptr + ((q_start + i) * H + head)[:, None] * D + d[None, :], mask=i_mask[:, None] & d_mask[None, :],
                other=0.0).to(tl.float32)
    pos = prev + i  # token index of each query
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    last = tl.minimum(prev + (block + 1) * BLOCK_M, seq_len)  # causal: no key past the block's last query
    first = 0
    if USE_WINDOW:
        first = tl.maximum(prev + block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(first, last, BLOCK_N):
        t = start + n
        t_mask = t < last
        slots = tl.load(req_to_token_ptr + row * stride_table + t, mask=t_mask, other=0).to(tl.int64)
        kv_off = (slots * stride_slot + kv_base)[:, None] + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            s = _soft_capped(s, softcap)
        visible = t_mask[None, :] & (t[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (t[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + ((q_start + i) * H + head)[:, None] * D + d[None, :], o, mask=i_mask[:, None] & d_mask[None, :])


def extend_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_q_len: int,
    *,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill / extend: row ``b``'s packed queries ``qo_indptr[b] .. qo_indptr[b+1] - 1`` are its last tokens and
    attend causally to its paged keys ``0 .. seq_lens[b] - 1`` (the cached prefix plus themselves, already stored).

    Args:
        query: [N, H, D] contiguous, rows back to back.
        k_cache, v_cache, req_to_token, req_rows, seq_lens, scaling, sliding_window, softcap: as for
            :func:`decode_attention`.
        qo_indptr: [B + 1] int32 on the device.
        max_q_len: the longest row's query count, at least it (sizes the grid; prefill is not graph-captured).

    Returns:
        [N, H, D] float32.

    Raises:
        ValueError: as :func:`decode_attention`, for a ``qo_indptr`` not contiguous or not of B + 1 entries, and
            for a ``max_q_len`` that is not an int of at least N / B (with queries). Whether it covers every row's
            query count is not checked (that would synchronise with the device).
    """
    if qo_indptr.dim() != 1:
        raise ValueError(f"qo_indptr must be 1-D [batch + 1], got shape {tuple(qo_indptr.shape)}")
    B = qo_indptr.shape[0] - 1
    _check_attention_inputs(query, k_cache, v_cache, sliding_window, softcap, req_to_token, B,
                            req_rows=req_rows, seq_lens=seq_lens, qo_indptr=qo_indptr)
    N, H, D = query.shape
    H_kv = k_cache.shape[1]
    if N and (not _is_int(max_q_len) or max_q_len < 1 or max_q_len * B < N):
        raise ValueError(f"max_q_len must be an int of at least the {N} queries' mean over {B} rows, got "
                         f"{max_q_len!r}")
    max_q_len = int(max_q_len)
    out = torch.zeros(N, H, D, dtype=torch.float32, device=query.device)
    if N == 0:
        return out
    BLOCK_M = 16
    grid = (B, H, triton.cdiv(max_q_len, BLOCK_M))
    _extend_kernel[grid](
        query, k_cache, v_cache, req_to_token, req_rows, seq_lens, qo_indptr, out,
        float(scaling), float(softcap or 1.0), _window(sliding_window),
        req_to_token.stride(0), *_cache_strides(k_cache, v_cache), H=H, D=D, GROUP=H // H_kv,
        BLOCK_M=BLOCK_M, BLOCK_D=triton.next_power_of_2(D), BLOCK_N=16,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
    )
    return out
