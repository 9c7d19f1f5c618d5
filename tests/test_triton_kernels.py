"""Triton kernels against the torch reference, run by Triton's interpreter on CPU (``TRITON_INTERPRET=1``)."""

import os

import pytest
import torch

# conftest.py turns the interpreter on for the whole session on a machine without CUDA; it must be on before
# Triton is first imported, so it cannot be turned on here.
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests on CPU tensors; the compiled kernels are tested in tests/gpu", allow_module_level=True)
pytest.importorskip("triton")

from astrai_hf.attention import triton_kernels as tk  # noqa: E402
from astrai_hf.attention.reference import packed_paged_attention, paged_attention  # noqa: E402
from test_attention import _build  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)
PAGE = 4

DECODE_CASES = {
    "one token": ([1], 1),
    "page boundaries": ([PAGE - 1, PAGE, PAGE + 1, 2 * PAGE], 3),
    "mixed lengths, MQA x7": ([1, 9, 30, 5], 7),
    "GQA x3, long": ([45, 2], 3),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("memory", ["head-major", "slot-major"])
def test_decode_matches_reference(case, variant, num_splits, memory):
    seq, groups = DECODE_CASES[case]
    H_kv, D = 2, 8
    H = H_kv * groups
    k_cache, v_cache, _, _, meta, _ = _build([s - 1 for s in seq], [1] * len(seq), 1, H_kv, D, PAGE, torch.float32, 7,
                                             memory=memory)
    query = torch.randn(len(seq), H, 1, D, generator=torch.Generator().manual_seed(1))
    kw = dict(scaling=0.35, sliding_window=5 if variant == "window" else None,
              softcap=3.0 if variant == "softcap" else None)
    want = paged_attention(query, k_cache, v_cache, meta, **kw)[:, 0]  # [B, H, D]
    got = tk.decode_attention(query[:, :, 0].contiguous(), k_cache, v_cache, meta.table, meta.req_rows,
                              torch.tensor(seq, dtype=torch.int32), num_splits=num_splits, **kw)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("given", ["out_dtype", "out buffer"])
def test_decode_rounds_to_a_16_bit_output_as_torch_does(dtype, given):
    """The merge writes a bf16/fp16 output itself (no cast launched after the kernel): the float32 result rounded to
    nearest even, as ``Tensor.to`` rounds it, to the bit."""
    seq = [1, 9, 30, 5]
    k_cache, v_cache, _, _, meta, _ = _build([s - 1 for s in seq], [1] * len(seq), 1, 2, 8, PAGE, dtype, 7)
    query = (torch.randn(len(seq), 6, 8, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    args = (query, k_cache, v_cache, meta.table, meta.req_rows, torch.tensor(seq, dtype=torch.int32))
    kw = dict(scaling=0.35, num_splits=4)
    want = tk.decode_attention(*args, **kw)
    assert want.dtype == torch.float32
    got = tk.decode_attention(*args, **kw, **({"out_dtype": dtype} if given == "out_dtype" else
                                              {"out": torch.empty(len(seq), 6, 8, dtype=dtype)}))
    assert got.dtype == dtype
    assert torch.equal(got, want.to(dtype))
    assert (want.to(dtype).float() != want).any()  # (the rounding is exercised)


def test_decode_rounds_ties_to_even_and_keeps_infinities_and_nan_in_bfloat16():
    """One key per row: the output is that key's V, so chosen float32 values reach the rounding as they are."""
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, float("inf"), float("-inf"), float("nan"),
                           1e-40])  # ties both ways, a finite value past bfloat16's largest, a subnormal
    k_cache, v_cache = torch.zeros(8, 1, 8), torch.zeros(8, 1, 8)
    v_cache[4, 0] = values
    table = torch.full((1, 4), 4, dtype=torch.int32)
    got = tk.decode_attention(torch.ones(1, 1, 8), k_cache, v_cache, table, torch.zeros(1, dtype=torch.long),
                              torch.ones(1, dtype=torch.int32), scaling=1.0, out_dtype=torch.bfloat16)
    want = values.to(torch.bfloat16)
    assert torch.equal(got[0, 0].view(torch.int16)[:6], want.view(torch.int16)[:6])
    assert got[0, 0, 6].isnan() and torch.equal(got[0, 0, 7:].float(), want[7:].float())


EXTEND_CASES = {
    "prefill from empty": ([0, 0], [5, PAGE + 1]),
    "extend over a cached prefix": ([PAGE - 1, 7, 0], [2, PAGE, 9]),
    "one token rows": ([3, 0], [1, 1]),
    "long query": ([2], [33]),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
@pytest.mark.parametrize("groups", [1, 3, 7])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("memory", ["head-major", "slot-major"])
def test_extend_matches_reference(case, groups, variant, memory):
    prev, new = EXTEND_CASES[case]
    H_kv, D = 2, 8
    H = H_kv * groups
    q = max(new)
    k_cache, v_cache, _, _, meta, _ = _build(prev, new, q, H_kv, D, PAGE, torch.float32, 3, memory=memory)
    packed = meta.pack()
    N = sum(new)
    query = torch.randn(1, H, N, D, generator=torch.Generator().manual_seed(2))
    kw = dict(scaling=0.3, sliding_window=4 if variant == "window" else None,
              softcap=2.0 if variant == "softcap" else None)
    want = packed_paged_attention(query, k_cache, v_cache, packed, **kw)[0]  # [N, H, D]
    indptr = torch.tensor(packed.qo_indptr, dtype=torch.int32)
    got = tk.extend_attention(query[0].transpose(0, 1).contiguous(), k_cache, v_cache, meta.table, meta.req_rows,
                              torch.tensor(packed.seq_lens, dtype=torch.int32), indptr, max(new), **kw)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("softcap", [50.0, 1e4, 1e6])
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_a_large_softcap_keeps_the_scores_exact(softcap, kernel):
    # tanh as 2 / (1 + exp(-2x)) - 1 cancels near 0: softcap 1e4 had erred by 1e-3, 1e6 by 0.1
    _kernel_against_reference(kernel, dict(scaling=0.35, softcap=softcap))


@pytest.mark.parametrize("window", [2.5, 3.0, 0.5])
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_a_window_not_a_whole_number_selects_the_references_keys(window, kernel):
    # keys t > q - 2.5 are the reference's (transformers' mask's); the kernels had truncated the window to 2
    _kernel_against_reference(kernel, dict(scaling=0.35, sliding_window=window))


def _kernel_against_reference(kernel: str, kw: dict) -> None:
    H_kv, D, groups = 2, 8, 3
    if kernel == "decode":
        seq = [1, 5, 12, 9]
        k_cache, v_cache, _, _, meta, _ = _build([s - 1 for s in seq], [1] * len(seq), 1, H_kv, D, PAGE,
                                                 torch.float32, 7)
        query = torch.randn(len(seq), H_kv * groups, 1, D, generator=torch.Generator().manual_seed(1))
        want = paged_attention(query, k_cache, v_cache, meta, **kw)[:, 0]
        got = tk.decode_attention(query[:, :, 0].contiguous(), k_cache, v_cache, meta.table, meta.req_rows,
                                  torch.tensor(seq, dtype=torch.int32), **kw)
    else:
        prev, new = [0, 3, 9], [5, 2, 4]
        k_cache, v_cache, _, _, meta, _ = _build(prev, new, max(new), H_kv, D, PAGE, torch.float32, 3)
        packed = meta.pack()
        query = torch.randn(1, H_kv * groups, sum(new), D, generator=torch.Generator().manual_seed(2))
        want = packed_paged_attention(query, k_cache, v_cache, packed, **kw)[0]
        got = tk.extend_attention(query[0].transpose(0, 1).contiguous(), k_cache, v_cache, meta.table,
                                  meta.req_rows, torch.tensor(packed.seq_lens, dtype=torch.int32),
                                  torch.tensor(packed.qo_indptr, dtype=torch.int32), max(new), **kw)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("D", [12, 20])
def test_head_dims_that_are_not_a_power_of_two(D):
    # (Phi-2's 80, 96, 72: the kernels pad the head to a power of two and mask the rest)
    seq, H_kv, groups = [3, 4, 5, 9], 2, 3
    H = H_kv * groups
    k_cache, v_cache, _, _, meta, _ = _build([s - 1 for s in seq], [1] * len(seq), 1, H_kv, D, PAGE, torch.float32, 7)
    query = torch.randn(len(seq), H, 1, D, generator=torch.Generator().manual_seed(1))
    kw = dict(scaling=0.3, sliding_window=3, softcap=2.0)
    want = paged_attention(query, k_cache, v_cache, meta, **kw)[:, 0]
    got = tk.decode_attention(query[:, :, 0].contiguous(), k_cache, v_cache, meta.table, meta.req_rows,
                              torch.tensor(seq, dtype=torch.int32), num_splits=2, **kw)
    torch.testing.assert_close(got, want, **TOL)

    prev, new = [5, 0, 2], [3, 4, 1]
    k_cache, v_cache, _, _, meta, _ = _build(prev, new, max(new), H_kv, D, PAGE, torch.float32, 3)
    packed = meta.pack()
    query = torch.randn(1, H, sum(new), D, generator=torch.Generator().manual_seed(2))
    want = packed_paged_attention(query, k_cache, v_cache, packed, **kw)[0]
    got = tk.extend_attention(query[0].transpose(0, 1).contiguous(), k_cache, v_cache, meta.table, meta.req_rows,
                              torch.tensor(packed.seq_lens, dtype=torch.int32),
                              torch.tensor(packed.qo_indptr, dtype=torch.int32), max(new), **kw)
    torch.testing.assert_close(got, want, **TOL)

    k_cache, v_cache = torch.zeros(12 * PAGE, H_kv, D), torch.zeros(12 * PAGE, H_kv, D)
    slots = torch.tensor([5, 17, 3, 40], dtype=torch.long)
    k, v = torch.randn(4, H_kv, D), torch.randn(4, H_kv, D)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[slots], want_v[slots] = k, v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_counts_of_any_integer_kind_and_a_max_q_len_above_the_longest_row_are_taken():
    # (the checks added for bad input had refused numpy integers and a max_q_len above the queries)
    import numpy as np

    prev, new = [5, 0], [3, 4]
    k_cache, v_cache, _, _, meta, _ = _build(prev, new, max(new), 2, 8, PAGE, torch.float32, 3)
    packed = meta.pack()
    query = torch.randn(1, 4, sum(new), 8, generator=torch.Generator().manual_seed(2))
    want = packed_paged_attention(query, k_cache, v_cache, packed, scaling=0.3)[0]
    args = (query[0].transpose(0, 1).contiguous(), k_cache, v_cache, meta.table, meta.req_rows,
            torch.tensor(packed.seq_lens, dtype=torch.int32), torch.tensor(packed.qo_indptr, dtype=torch.int32))
    for max_q_len in (np.int64(4), torch.tensor(4), 16):
        torch.testing.assert_close(tk.extend_attention(*args, max_q_len, scaling=0.3), want, **TOL)
    with pytest.raises(ValueError, match=r"qo_indptr must be 1-D \[batch \+ 1\], got shape \(1, 3\)"):
        tk.extend_attention(*args[:-1], args[-1][None], 4, scaling=0.3)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    decode_want = tk.decode_attention(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3)), k_cache,
                                      v_cache, meta.table, meta.req_rows, lens, scaling=0.5, num_splits=4)
    got = tk.decode_attention(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3)), k_cache, v_cache,
                              meta.table, meta.req_rows, lens, scaling=0.5, num_splits=np.int64(4))
    torch.testing.assert_close(got, decode_want, rtol=0, atol=0)


@pytest.mark.parametrize("memory", ["head-major", "slot-major"])
def test_store_kv_writes_slots(memory):
    if memory == "head-major":
        k_cache, v_cache = (torch.zeros(2, 12 * PAGE, 8).transpose(0, 1) for _ in range(2))
    else:
        k_cache, v_cache = torch.zeros(12 * PAGE, 2, 8), torch.zeros(12 * PAGE, 2, 8)
    slots = torch.tensor([5, 17, 3, 40], dtype=torch.long)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[slots], want_v[slots] = k, v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_with_a_strided_slot_mapping():
    # the kernel reads slot_mapping as a raw pointer: a strided view had written the trash slot instead
    k_cache, v_cache = torch.zeros(12 * PAGE, 2, 8), torch.zeros(12 * PAGE, 2, 8)
    slots = torch.tensor([5, 0, 17, 0, 3, 0], dtype=torch.long)[::2]
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v) and not k_cache[0].any()


_BAD_INPUTS = {  # edits of (query, req_rows, seq_lens, window, req_to_token)
    "heads not a multiple of the KV heads": (lambda q, rows, lens, w, t: (q[:, :3], rows, lens, w, t), "multiple of"),
    "a strided query": (lambda q, rows, lens, w, t: (q.transpose(1, 2).contiguous().transpose(1, 2), rows, lens, w,
                                                      t), "query of shape"),
    "strided seq_lens": (lambda q, rows, lens, w, t: (q, rows, torch.stack([lens, lens], 1)[:, 0], w, t), "seq_lens"),
    "strided req_rows": (lambda q, rows, lens, w, t: (q, torch.stack([rows, rows], 1)[:, 0], lens, w, t), "req_rows"),
    "a window of 0": (lambda q, rows, lens, w, t: (q, rows, lens, 0, t), "sliding_window must be a positive"),
    "req_to_token with strided columns": (
        lambda q, rows, lens, w, t: (q, rows, lens, w, t.repeat_interleave(2, 1)[:, ::2]), "req_to_token"),
    "a column-major req_to_token": (lambda q, rows, lens, w, t: (q, rows, lens, w, t.t().contiguous().t()),
                                    "req_to_token"),
    "a 3-D req_to_token": (lambda q, rows, lens, w, t: (q, rows, lens, w, t[None]), "req_to_token must be 2-D"),
    # (rows and lengths short of the batch had been read past their end: a segmentation fault)
    "req_rows short of the batch": (lambda q, rows, lens, w, t: (q, rows[:1].clone(), lens, w, t),
                                    r"req_rows must be 1-D with 2 entries"),
    "seq_lens short of the batch": (lambda q, rows, lens, w, t: (q, rows, lens[:1].clone(), w, t),
                                    r"seq_lens must be 1-D with 2 entries"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_kernels_refuse_inputs_their_pointers_would_misread(case, kernel):
    # they had computed silently wrong outputs (or NaN) for each of these
    k_cache, v_cache, _, _, meta, _ = _build([9, 2], [1, 1], 1, 2, 8, PAGE, torch.float32, 5)
    edit, message = _BAD_INPUTS[case]
    n = 1 if kernel == "decode" else 2
    query = torch.randn(2 * n, 4, 8) if kernel == "extend" else torch.randn(2, 4, 8)
    query, rows, lens, window, table = edit(query, meta.req_rows, torch.tensor([10, 3], dtype=torch.int32), None,
                                            meta.table)
    assert torch.equal(table.reshape(meta.table.shape), meta.table)  # the same values, read otherwise
    with pytest.raises(ValueError, match=message):
        if kernel == "decode":
            tk.decode_attention(query, k_cache, v_cache, table, rows, lens, scaling=0.5, sliding_window=window)
        else:
            tk.extend_attention(query, k_cache, v_cache, table, rows, lens,
                                torch.tensor([0, 2, 4], dtype=torch.int32), 2, scaling=0.5, sliding_window=window)


@pytest.mark.parametrize("case", ["softcap 0", "num_splits 0", "workspace of fewer splits", "out of another shape",
                                  "out of an integer dtype", "max_q_len below the mean"])
def test_kernels_refuse_settings_and_buffers_they_would_misuse(case):
    # each had run: a softcap of 0 as 1.0 (the reference divides by it), no splits to NaN, a workspace of 2 splits
    # written as 8 (heap corruption), queries past max_q_len left at 0
    k_cache, v_cache, _, _, meta, _ = _build([9, 2], [1, 1], 1, 2, 8, PAGE, torch.float32, 5)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    decode = dict(scaling=0.5)
    message = {"softcap 0": "softcap must be a positive", "num_splits 0": "num_splits must be a positive int",
               "out of an integer dtype": r"out must be a contiguous float32 or float16 or bfloat16 tensor",
               "workspace of fewer splits": r"workspace\[0\] \(mid_o\) must be .* shape \(2, 4, 8, 8\)",
               "out of another shape": r"out must be .* shape \(2, 4, 8\)",
               "max_q_len below the mean": "max_q_len must be an int of at least the 6 queries' mean over 2 rows"}[case]
    with pytest.raises(ValueError, match=message):
        if case == "max_q_len below the mean":
            tk.extend_attention(torch.randn(6, 4, 8), k_cache, v_cache, meta.table, meta.req_rows, lens,
                                torch.tensor([0, 5, 6], dtype=torch.int32), 2, scaling=0.5)
        elif case == "softcap 0":
            tk.decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, meta.table, meta.req_rows, lens, softcap=0.0,
                                **decode)
        elif case == "num_splits 0":
            tk.decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, meta.table, meta.req_rows, lens, num_splits=0,
                                **decode)
        elif case == "workspace of fewer splits":
            tk.decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, meta.table, meta.req_rows, lens, num_splits=8,
                                workspace=(torch.empty(2, 4, 2, 8), torch.empty(2, 4, 2)), **decode)
        elif case == "out of an integer dtype":
            tk.decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, meta.table, meta.req_rows, lens,
                                out=torch.empty(2, 4, 8, dtype=torch.int32), **decode)
        else:
            tk.decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, meta.table, meta.req_rows, lens,
                                out=torch.empty(2, 8, 4), **decode)


def test_decode_grid_does_not_depend_on_lengths():
    """The same launch serves growing lengths (what CUDA-graph replay needs): only the device buffers change."""
    k_cache, v_cache, _, _, meta, _ = _build([9, 2], [1, 1], 1, 2, 8, PAGE, torch.float32, 5)
    query = torch.randn(2, 4, 8)
    out = torch.empty(2, 4, 8)
    ws = (torch.empty(2, 4, 4, 8), torch.empty(2, 4, 4))
    for lens in ([10, 3], [7, 1], [10, 1]):
        seq = torch.tensor(lens, dtype=torch.int32)
        tk.decode_attention(query, k_cache, v_cache, meta.table, meta.req_rows, seq, scaling=0.5, num_splits=4,
                            out=out, workspace=ws)
        sub = meta.select([0, 1])
        sub.seq_lens, sub.prev_lens = list(lens), [n - 1 for n in lens]
        want = paged_attention(query[:, :, None], k_cache, v_cache, sub, scaling=0.5)[:, 0]
        torch.testing.assert_close(out, want, **TOL)
