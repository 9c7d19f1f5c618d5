"""The compiled Triton kernels on a CUDA device against the torch reference, in bf16 and fp16.

The reference runs in float32 on the same (rounded) inputs, so the difference is the kernels' own arithmetic.
Skipped without CUDA; the interpreter runs the same cases on CPU in tests/test_triton_kernels.py.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# one tolerance per dtype, for every kernel and case
TOLERANCE = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
PAGE = 16
DECODE_CASES = {
    "one token": ([1], 1),
    "page boundaries": ([PAGE - 1, PAGE, PAGE + 1, 2 * PAGE], 3),
    "mixed lengths, GQA x7": ([1, 90, 300, 5], 7),
    "long context": ([4000, 37], 3),
}
EXTEND_CASES = {
    "prefill from empty": ([0, 0], [5, PAGE + 1]),
    "extend over a cached prefix": ([PAGE - 1, 70, 0], [2, PAGE, 90]),
    "long query": ([20], [300]),
}


def _inputs(prev, new, H_kv, D, dtype, seed):
    from test_attention import _build

    k_cache, v_cache, _, _, meta, _ = _build(prev, new, max(new), H_kv, D, PAGE, torch.float32, seed)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)  # rounded once; the reference upcasts these
    return k_cache, v_cache, meta


def _check_decode(seq, groups, D, dtype, **kw):
    """The decode kernel over rows of ``seq`` tokens against the reference; returns its output and the inputs."""
    from astrai_hf.attention import triton_kernels as tk
    from astrai_hf.attention.reference import paged_attention

    H_kv = 2
    k_cache, v_cache, meta = _inputs([s - 1 for s in seq], [1] * len(seq), H_kv, D, dtype, 7)
    query = torch.randn(len(seq), H_kv * groups, 1, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, **kw)[:, 0]
    args = (query[:, :, 0].contiguous().cuda(), k_cache.cuda(), v_cache.cuda(), meta.table.cuda(),
            meta.req_rows.cuda(), torch.tensor(seq, dtype=torch.int32, device="cuda"))
    got = tk.decode_attention(*args, **kw)
    torch.testing.assert_close(got.float().cpu(), want, **TOLERANCE[dtype])
    return got, args


def _check_extend(prev, new, groups, D, dtype, **kw):
    """The extend kernel (rows of ``prev`` cached tokens and ``new`` queries) against the reference."""
    from astrai_hf.attention import triton_kernels as tk
    from astrai_hf.attention.reference import packed_paged_attention

    H_kv = 2
    k_cache, v_cache, meta = _inputs(prev, new, H_kv, D, dtype, 3)
    packed = meta.pack()
    query = torch.randn(1, H_kv * groups, sum(new), D, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = packed_paged_attention(query.float(), k_cache.float(), v_cache.float(), packed, **kw)[0]
    got = tk.extend_attention(query[0].transpose(0, 1).contiguous().cuda(), k_cache.cuda(), v_cache.cuda(),
                              meta.table.cuda(), meta.req_rows.cuda(),
                              torch.tensor(packed.seq_lens, dtype=torch.int32, device="cuda"),
                              torch.tensor(packed.qo_indptr, dtype=torch.int32, device="cuda"), max(new), **kw)
    torch.testing.assert_close(got.float().cpu(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernel(case, variant, dtype):
    from astrai_hf.attention import triton_kernels as tk

    seq, groups = DECODE_CASES[case]
    D = 64
    kw = dict(scaling=D**-0.5, sliding_window=50 if variant == "window" else None,
              softcap=20.0 if variant == "softcap" else None)
    got, args = _check_decode(seq, groups, D, dtype, **kw)
    # the output in the query's dtype, as eager decode and a replayed graph ask for it: rounded by the kernel as
    # torch rounds the float32 output, to the bit
    rounded = tk.decode_attention(*args, out_dtype=dtype, **kw)
    assert rounded.dtype == dtype and torch.equal(rounded, got.to(dtype))


@pytest.mark.parametrize("D", [80, 96, 256])  # Phi-2, GPT-NeoX variants, Gemma
def test_kernels_at_head_dims_of_real_models(D):
    kw = dict(scaling=D**-0.5, sliding_window=50, softcap=20.0)
    _check_decode([1, PAGE + 1, 300], 3, D, torch.bfloat16, **kw)
    _check_extend([PAGE - 1, 0], [2, 40], 3, D, torch.bfloat16, **kw)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("groups", [1, 3, 7])
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend_kernel(case, groups, variant, dtype):
    D = 64
    prev, new = EXTEND_CASES[case]
    _check_extend(prev, new, groups, D, dtype, scaling=D**-0.5, sliding_window=40 if variant == "window" else None,
                  softcap=20.0 if variant == "softcap" else None)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_store_kv(dtype):
    from astrai_hf.attention import triton_kernels as tk

    k_cache = torch.zeros(64 * PAGE, 2, 64, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 170, 3, 400], device="cuda")
    k = torch.randn(4, 2, 64, device="cuda").to(dtype)
    v = torch.randn(4, 2, 64, device="cuda").to(dtype)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    assert int((k_cache != 0).any(dim=(1, 2)).sum()) == 4
