"""Reference paged attention in plain torch: runs on any device, reads K/V straight from the pool.

Every faster backend is tested against this function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..metadata import StepMetadata
from ..storage import gather_kv


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a step's queries over each row's cached tokens.

    Query column ``c`` of row ``b`` is token ``q_index[b, c]`` of its row; it attends to tokens
    ``t <= q_index`` (and ``t > q_index - sliding_window`` with a window). Padding columns attend to one key
    and their output is meaningless.

    Args:
        query: [B, H, q_len, D], after RoPE.
        k_cache, v_cache: [num_slots, H_kv, D], one layer of the pool; H must be a multiple of H_kv (GQA/MQA).
        meta: the step's metadata (slots, lengths).
        scaling: multiplier of ``q @ k``; default ``D ** -0.5``.
        sliding_window: window in tokens, as transformers passes it (a key is visible while
            ``q_index - t < sliding_window``), or None.
        softcap: Gemma2 logit soft-capping ``softcap * tanh(s / softcap)``, or None.

    Returns:
        [B, q_len, H, D], contiguous, in the query's dtype.
    """
    # One call per row beats a gather on a CPU (measured: the gather was 15 ms of a 95-135 ms step at batch 8).
    # On an accelerator each call is a kernel launch, and a batch of 64 would launch 64 per layer where the
    # bucketed gather launches a handful, so there rows keep the gather.
    if meta.q_len == 1 and meta.row_starts is not None and query.device.type == "cpu":
        spans = meta.in_place_spans(sliding_window)
        if spans:
            return _decode_in_place(query, k_cache, v_cache, meta, spans, scaling, sliding_window, softcap)
    buckets = meta.buckets()
    if len(buckets) > 1:
        # rows of very different lengths: attend per group of similar rows, each over its own narrower rectangle
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        for rows, sub in buckets:
            kw = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap)
            if rows[-1] - rows[0] + 1 == len(rows):  # a run of neighbouring rows: slices, no copies
                out[rows[0] : rows[-1] + 1] = paged_attention(query[rows[0] : rows[-1] + 1], k_cache, v_cache, sub, **kw)
            else:
                index = sub.on(query.device).rows_index(rows)
                # (under torch.autocast attention comes out in autocast's dtype; an index_put does not cast)
                out[index] = paged_attention(query.index_select(0, index), k_cache, v_cache, sub, **kw).to(out.dtype)
        return out
    B, H, q, D = query.shape
    view = meta.on(query.device)
    T = meta.max_len
    keys = gather_kv(k_cache, view.kv_slots, B, T)  # [B, H_kv, T, D]
    values = gather_kv(v_cache, view.kv_slots, B, T)
    mask, is_causal = view.mask(sliding_window, need_explicit=softcap is not None)
    return attend(query, keys, values, mask, is_causal, scaling, softcap).transpose(1, 2).contiguous()


def _decode_in_place(query, k_cache, v_cache, meta, spans, scaling, sliding_window, softcap) -> torch.Tensor:
    """Decode step: the rows of ``spans`` (``(row, lo, hi)``: one new token, keys in slots ``[lo, hi)``) attend
    over a view of the pool, one call per row, with no gather and no mask; the other rows go through
    :func:`paged_attention`."""
    B, H, _, D = query.shape
    H_kv = k_cache.shape[1]
    out = query.new_empty(B, 1, H, D)
    # [1, H_kv, num_slots, D]; sliced to a row's span, a [1, H_kv, T, D] view whose heads are contiguous runs
    k_heads, v_heads = k_cache.transpose(0, 1)[None], v_cache.transpose(0, 1)[None]
    if softcap is None:
        # one query per row sees every key of its span: the query heads of a KV group become that group's rows
        scale = D**-0.5 if scaling is None else scaling
        grouped = query.reshape(B, H_kv, H // H_kv, D)
        flat = out.view(B, H_kv, H // H_kv, D)
        rows = grouped[:, None].unbind(0)  # B views [1, H_kv, G, D]
        parts = [F.scaled_dot_product_attention(rows[r], k_heads[:, :, lo:hi], v_heads[:, :, lo:hi], scale=scale)
                 for r, lo, hi in spans]
        if len(spans) == B and not (torch.is_grad_enabled() and query.requires_grad):
            torch.cat(parts, out=flat)  # every row, in order: one copy into the output (out= has no autograd)
        else:
            for (r, _, _), part in zip(spans, parts):
                flat[r] = part[0]
    else:
        for r, lo, hi in spans:
            k, v = k_heads[:, :, lo:hi], v_heads[:, :, lo:hi]
            out[r] = attend(query[r : r + 1], k, v, None, False, scaling, softcap)[0].transpose(0, 1)
    if len(spans) < B:
        chosen = {r for r, _, _ in spans}
        rest = [r for r in range(B) if r not in chosen]
        index = torch.tensor(rest, dtype=torch.long, device=query.device)
        out[index] = paged_attention(
            query.index_select(0, index), k_cache, v_cache, meta.select(rest),
            scaling=scaling, sliding_window=sliding_window, softcap=softcap,
        ).to(out.dtype)
    return out


def _row_view(k_cache, v_cache, start: int, seq_len: int, sliding_window: int | None):
    """K/V of a row whose tokens occupy slots ``[start, start + seq_len)``, as views [1, H_kv, T, D] of the pool;
    with a window, only the keys the row's last token sees (``t > seq_len - 1 - sliding_window``)."""
    lo = max(0, seq_len - sliding_window) if sliding_window is not None else 0
    k = k_cache[start + lo : start + seq_len].transpose(0, 1)[None]
    v = v_cache[start + lo : start + seq_len].transpose(0, 1)[None]
    return k, v


def packed_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a packed step (no padding anywhere): row ``r``'s ``qo_lens[r]`` queries, which continue
    its ``prev_lens[r]`` cached tokens, attend to that row's own keys only (varlen attention with ``qo_indptr``).

    Args:
        query: [1, H, N, D] with ``N = sum(meta.qo_lens)``, rows back to back, after RoPE.
        k_cache, v_cache: [num_slots, H_kv, D], one layer of the pool.
        meta: a packed step (``meta.qo_lens`` set).
        scaling, sliding_window, softcap: as for :func:`paged_attention`.

    Returns:
        [1, N, H, D], contiguous, in the query's dtype.
    """
    _, H, N, D = query.shape
    view = meta.on(query.device)
    slots = view.kv_slots.view(len(meta.seq_lens), meta.max_len)
    masks = view.row_masks(sliding_window, need_explicit=softcap is not None)
    out = query.new_empty(1, N, H, D)
    start = 0
    starts = meta.row_starts or [None] * len(meta.seq_lens)
    for r, (n, T) in enumerate(zip(meta.qo_lens, meta.seq_lens)):
        if starts[r] is not None:  # consecutive slots: a view of the pool
            keys, values = _row_view(k_cache, v_cache, starts[r], T, None)
        else:
            row = slots[r, :T]
            keys, values = gather_kv(k_cache, row, 1, T), gather_kv(v_cache, row, 1, T)
        mask, is_causal = masks[r]
        part = attend(query[:, :, start : start + n], keys, values, mask, is_causal, scaling, softcap)
        out[:, start : start + n] = part.transpose(1, 2)
        start += n
    return out


def attend(query, keys, values, mask, is_causal, scaling, softcap) -> torch.Tensor:
    """Dense attention of ``query`` [B, H, q, D] over ``keys``/``values`` [B, H_kv, T, D] (H a multiple of H_kv:
    grouped-query attention without copying K/V per group) through ``F.scaled_dot_product_attention``.

    ``mask`` is bool [B, 1, q, T] (True: the key is attended) or None; ``is_causal`` applies only without a mask.
    ``scaling`` None means D ** -0.5. ``softcap`` (Gemma 2) caps the scores as ``tanh(s / softcap) * softcap``
    before a float32 softmax. Returns [B, H, q, D] in the query's dtype.
    """
    B, H, q, D = query.shape
    H_kv, T = keys.shape[1], keys.shape[2]
    groups = H // H_kv
    if scaling is None:
        scaling = D**-0.5
    if softcap is not None:
        return _softcapped(query, keys, values, mask, scaling, softcap, groups)
    if groups > 1 and mask is None and q == 1 and not is_causal:
        # one query per row sees every key: the query heads of a KV group become that group's query rows
        out = F.scaled_dot_product_attention(query.reshape(B, H_kv, groups, D), keys, values, scale=scaling)
        return out.reshape(B, H, 1, D)
    if groups > 1 and mask is None:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=is_causal, scale=scaling, enable_gqa=True)
    if groups > 1:
        # Fold the query heads of a KV group into the query axis (the mask repeats per head), so K/V are read once
        # per group instead of being copied `groups` times.
        packed = query.reshape(B, H_kv, groups * q, D)
        if q > 1:
            mask = mask.expand(B, groups, q, T).reshape(B, 1, groups * q, T)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(B, H, q, D)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scaling)


def _softcapped(query, keys, values, mask, scaling, softcap, groups):
    keys, values = _repeat_kv(keys, groups), _repeat_kv(values, groups)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    B, H_kv, T, D = x.shape
    return x[:, :, None].expand(B, H_kv, groups, T, D).reshape(B, H_kv * groups, T, D)
