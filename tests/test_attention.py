"""Reference paged attention against a naive per-row gather + softmax, on random inputs."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai_hf.attention.reference import packed_paged_attention, paged_attention
from astrai_hf import metadata
from astrai_hf.metadata import StepMetadata

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _naive(query, keys, values, q_index, scaling, window, softcap):
    """Row by row, query by query: softmax over the visible tokens of the row."""
    B, H, q, D = query.shape
    out = torch.zeros(B, q, H, D, dtype=torch.float32)
    for b in range(B):
        K, V = keys[b].float(), values[b].float()  # [T_b, H_kv, D]
        groups = H // K.shape[1]
        for c in range(q):
            i = int(q_index[b][c])
            if i < 0:
                continue
            lo = 0 if window is None else max(0, i - window + 1)
            for h in range(H):
                s = (K[lo : i + 1, h // groups] @ query[b, h, c].float()) * scaling
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[b, c, h] = torch.softmax(s, 0) @ V[lo : i + 1, h // groups]
    return out


def _build(prev_lens, new_lens, q, H_kv, D, page_size, dtype, seed, contiguous=None, memory="head-major"):
    """Random K/V scattered over shuffled pages, and the matching metadata.

    ``contiguous[b]``: row b gets consecutive pages instead (after a one-page gap), and the metadata's
    ``row_starts`` names its first slot, so attention may read it in place. ``memory``: "head-major" as the pool
    lays it out (a transposed view of [H_kv, num_slots, D]), or "slot-major" (contiguous [num_slots, H_kv, D]).
    """
    g = torch.Generator().manual_seed(seed)
    B = len(prev_lens)
    contiguous = contiguous or [False] * B
    seq = [p + n for p, n in zip(prev_lens, new_lens)]
    pages_per_row = [-(-s // page_size) for s in seq]
    runs, next_page = {}, 1
    for b in range(B):
        if contiguous[b] and seq[b] > 0:
            runs[b] = list(range(next_page + 1, next_page + 1 + pages_per_row[b]))
            next_page += 1 + pages_per_row[b]
    num_pages = next_page + sum(n for b, n in enumerate(pages_per_row) if b not in runs)
    order = (torch.randperm(num_pages - next_page, generator=g) + next_page).tolist()
    if memory == "head-major":
        k_cache = torch.zeros(H_kv, num_pages * page_size, D, dtype=dtype).transpose(0, 1)
        v_cache = torch.zeros(H_kv, num_pages * page_size, D, dtype=dtype).transpose(0, 1)
    else:
        k_cache = torch.zeros(num_pages * page_size, H_kv, D, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
    max_len = max(max(seq), 1)
    table = torch.zeros(B, max_len + 3, dtype=torch.int32)
    keys, values = [], []
    for b in range(B):
        if b in runs:
            pages = runs[b]
        else:
            pages, order = order[: pages_per_row[b]], order[pages_per_row[b] :]
        K = torch.randn(seq[b], H_kv, D, generator=g).to(dtype)
        V = torch.randn(seq[b], H_kv, D, generator=g).to(dtype)
        slots = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(seq[b])], dtype=torch.long)
        k_cache[slots], v_cache[slots] = K, V
        table[b, : seq[b]] = slots.to(torch.int32)
        keys.append(K)
        values.append(V)
    meta = StepMetadata(
        q_len=q, prev_lens=list(prev_lens), seq_lens=seq, logical_len=0, paged=True, table=table,
        req_rows=torch.arange(B), slot_mapping=torch.zeros(0, dtype=torch.long), write_src=None,
        row_starts=[runs[b][0] * page_size if b in runs else None for b in range(B)] if runs else None,
    )
    q_index = meta.on(torch.device("cpu")).q_index
    return k_cache, v_cache, keys, values, meta, q_index


CASES = st.fixed_dictionaries({
    "split_rows": st.booleans(),  # force rows into length buckets (each with its own narrower gather)
    "rows": st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=4),
    "groups": st.sampled_from([1, 3, 7]),
    "page_size": st.sampled_from([1, 3, 4, 16]),
    "window": st.sampled_from([None, 1, 3, 8]),
    "softcap": st.sampled_from([None, 2.0]),
    "seed": st.integers(0, 2**16),
    # rows whose pages are consecutive (read in place as views of the pool); cycled over the rows
    "contiguous": st.lists(st.booleans(), min_size=1, max_size=4),
})


def _layout(case, B):
    return [case["contiguous"][b % len(case["contiguous"])] for b in range(B)]


@settings(max_examples=120, deadline=None)
@given(CASES)
def test_reference_matches_naive(case):
    rows = case["rows"]
    q = max(n for _, n in rows)
    if q == 0:
        return
    H_kv, D = 2, 8
    H = H_kv * case["groups"]
    k_cache, v_cache, keys, values, meta, q_index = _build(
        [p for p, _ in rows], [n for _, n in rows], q, H_kv, D, case["page_size"], torch.float32, case["seed"],
        _layout(case, len(rows)),
    )
    query = torch.randn(len(rows), H, q, D, generator=torch.Generator().manual_seed(case["seed"] + 1))
    saved = metadata.BUCKET_CALL_COST
    metadata.BUCKET_CALL_COST = 0 if case["split_rows"] else saved
    try:
        if case["split_rows"] and len({max(n, 1) for n in meta.seq_lens}) > 1:  # an empty row reads one slot
            assert len(meta.buckets()) > 1
        got = paged_attention(query, k_cache, v_cache, meta, scaling=0.3, sliding_window=case["window"],
                              softcap=case["softcap"])
    finally:
        metadata.BUCKET_CALL_COST = saved
    want = _naive(query, keys, values, q_index, 0.3, case["window"], case["softcap"])
    real = (q_index >= 0)[:, :, None, None]
    torch.testing.assert_close(torch.where(real, got, 0.0), torch.where(real, want, 0.0), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prev, new", [([0, 0], [5, 5]), ([7, 7], [1, 1]), ([1, 15, 16, 17], [1, 1, 1, 1]),
                                       ([0, 3], [4, 2]), ([0], [1])])
def test_fixed_cases_all_dtypes(dtype, prev, new):
    q = max(new)
    k_cache, v_cache, keys, values, meta, q_index = _build(prev, new, q, 1, 16, 16, dtype, 0)
    query = torch.randn(len(prev), 7, q, 16).to(dtype)
    got = paged_attention(query, k_cache, v_cache, meta)
    want = _naive(query, keys, values, q_index, 16**-0.5, None, None)
    real = (q_index >= 0)[:, :, None, None]
    torch.testing.assert_close(torch.where(real, got.float(), 0.0), torch.where(real, want, 0.0), **TOL[dtype])


@settings(max_examples=80, deadline=None)
@given(CASES, st.integers(1, 9))
def test_packed_matches_rectangular(case, chunk):
    """The packed (varlen) path equals the rectangular reference on the same rows, whole and cut into chunks."""
    rows = [(p, max(n, 1)) for p, n in case["rows"]]
    q = max(n for _, n in rows)
    H_kv, D = 2, 8
    H = H_kv * case["groups"]
    prev, new = [p for p, _ in rows], [n for _, n in rows]
    k_cache, v_cache, _, _, meta, q_index = _build(prev, new, q, H_kv, D, case["page_size"], torch.float32, case["seed"],
                                                   _layout(case, len(rows)))
    query = torch.randn(len(rows), H, q, D, generator=torch.Generator().manual_seed(case["seed"] + 1))
    kw = dict(scaling=0.3, sliding_window=case["window"], softcap=case["softcap"])
    want = paged_attention(query, k_cache, v_cache, meta, **kw)  # [B, q, H, D]
    real = q_index >= 0
    want_packed = want[real]  # [N, H, D], rows back to back
    packed_query = query.transpose(1, 2)[real].transpose(0, 1)[None]  # [1, H, N, D]
    packed = meta.pack()
    got = packed_paged_attention(packed_query, k_cache, v_cache, packed, **kw)[0]
    torch.testing.assert_close(got, want_packed, **TOL[torch.float32])
    N = packed_query.shape[2]
    parts = [
        packed_paged_attention(packed_query[:, :, a : a + chunk], k_cache, v_cache, packed.chunk(a, min(a + chunk, N)), **kw)[0]
        for a in range(0, N, chunk)
    ]
    torch.testing.assert_close(torch.cat(parts), want_packed, **TOL[torch.float32])


@settings(max_examples=120, deadline=None)
@given(CASES)
def test_decode_in_place_matches_gather(case):
    """A decode step (one new token per row) over rows in consecutive slots, read as views of the pool, equals the
    gather through ``req_to_token`` on the same rows, mixed with rows that are gathered."""
    rows = [(p, 1) for p, _ in case["rows"]]
    H_kv, D = 2, 8
    H = H_kv * case["groups"]
    layout = _layout(case, len(rows))
    k_cache, v_cache, keys, values, meta, q_index = _build(
        [p for p, _ in rows], [1] * len(rows), 1, H_kv, D, case["page_size"], torch.float32, case["seed"], layout
    )
    query = torch.randn(len(rows), H, 1, D, generator=torch.Generator().manual_seed(case["seed"] + 1))
    kw = dict(scaling=0.3, sliding_window=case["window"], softcap=case["softcap"])
    got = paged_attention(query, k_cache, v_cache, meta, **kw)
    gathered = dataclasses.replace(meta, row_starts=None, _views={})
    torch.testing.assert_close(got, paged_attention(query, k_cache, v_cache, gathered, **kw), **TOL[torch.float32])
    want = _naive(query, keys, values, q_index, 0.3, case["window"], case["softcap"])
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_decode_in_place_reads_views():
    """Rows in consecutive slots are not gathered: no index_select runs for them."""
    k_cache, v_cache, keys, values, meta, q_index = _build([15, 16, 40], [1, 1, 1], 1, 2, 8, 16, torch.float32, 0,
                                                           [True, True, True])
    query = torch.randn(3, 6, 1, 8)
    calls = []
    original = torch.Tensor.index_select

    def spy(self, *args, **kwargs):
        calls.append(self.shape)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "index_select", spy)
        got = paged_attention(query, k_cache, v_cache, meta)
    assert not calls
    want = _naive(query, keys, values, q_index, 8**-0.5, None, None)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
