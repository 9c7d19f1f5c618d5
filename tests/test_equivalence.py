"""generate() through astrai-hf is token-for-token equal to stock transformers, on every supported architecture."""

import pytest
import torch

import astrai_hf
from astrai_hf import PagedCache, PagePool
from tiny_models import ARCHS, left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence

MODES = {
    "greedy": dict(do_sample=False, max_new_tokens=10),
    "sample": dict(do_sample=True, top_k=20, temperature=1.3, max_new_tokens=10),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2, max_new_tokens=8),
    "beam_search": dict(do_sample=False, num_beams=3, max_new_tokens=8),
}


def _generate(model, ids, mask, seed=0, **kwargs):
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **kwargs)


_cache_kwarg = astrai_hf.cache_kwarg


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("mode", list(MODES))
def test_unpatched_paged_cache_equals_dynamic_cache(model, mode):
    ids, mask = left_padded_batch([7, 3, 10], seed=1)
    ref = _generate(model, ids, mask, **MODES[mode])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    with PagedCache(pool) as cache:
        out = _generate(model, ids, mask, **MODES[mode], **{_cache_kwarg(model): cache})
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_patched_generate_equals_stock(model, mode, monkeypatch):
    ids, mask = left_padded_batch([7, 3, 10], seed=1)
    ref = _generate(model, ids, mask, **MODES[mode])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    (out,) = _patched_calls(model, pool, monkeypatch, lambda: _generate(model, ids, mask, **MODES[mode]))
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0


def test_prompt_lookup_decoding(model):
    # assisted decoding is batch-size 1; a repetitive prompt makes the lookup propose (and reject) candidates
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 5, 6, 7]])
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, max_new_tokens=12, prompt_lookup_num_tokens=3)
    ref = _generate(model, ids, mask, **kwargs)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    with PagedCache(pool) as cache:
        out = _generate(model, ids, mask, **kwargs, **{_cache_kwarg(model): cache})
    assert torch.equal(out, ref)
    astrai_hf.patch(model, pool=pool)
    try:
        out = _generate(model, ids, mask, **kwargs)
    finally:
        astrai_hf.unpatch(model)
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0


def _patched_calls(model, pool, monkeypatch, call, calls: int = 1) -> list:
    """The outputs of ``call()`` run ``calls`` times with ``model`` patched onto ``pool``, each through paged
    attention."""
    astrai_hf.patch(model, pool=pool)
    try:
        counted = _count_paged_attention_calls(monkeypatch)
        outs = [call() for _ in range(calls)]
        assert counted["n"] > 0, "the patched model did not run paged attention"
    finally:
        astrai_hf.unpatch(model)
    return outs


def _count_paged_attention_calls(monkeypatch):
    """Count reference paged-attention calls for the rest of the test."""
    from astrai_hf import attention

    calls = {"n": 0}
    original = attention.paged_attention

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", counting)
    return calls


@pytest.mark.parametrize("layout", ["new decoder architecture", "multi-query (Falcon-7B)"])
@pytest.mark.parametrize("mode", ["greedy", "beam_search"])
def test_falcon_unpatched_paged_cache_equals_dynamic_cache(mode, layout):
    """Falcon cannot be patched before transformers 5.25 (its attention bypasses AttentionInterface), but a
    PagedCache still serves it. The
    Falcon-7B layout's config has no num_key_value_heads: its one K/V head is read from multi_query (the pool had
    been sized for one head per query head and refused the model's K/V)."""
    old = dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=None)
    model = tiny_model("falcon", **(old if layout.startswith("multi") else {}))
    ids, mask = left_padded_batch([7, 3, 10], seed=1)
    ref = _generate(model, ids, mask, **MODES[mode])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    with PagedCache(pool, ids, mask) as cache:
        out = _generate(model, ids, mask, **MODES[mode], **{_cache_kwarg(model): cache})
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0


FALCON_LAYOUTS = {
    "new decoder architecture": {},
    "multi-query (Falcon-7B)": dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=None),
    "multi-head, sequential": dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=4,
                                   parallel_attn=False, bias=True),
}


@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_patched_falcon_equals_stock_where_its_attention_goes_through_the_interface(mode, layout, monkeypatch):
    # transformers 5.25 routed Falcon's attention through AttentionInterface, so patch() takes it there
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from astrai_hf.patch import _uses_attention_interface

    if not _uses_attention_interface(FalconAttention):
        pytest.skip("Falcon's attention bypasses AttentionInterface in this transformers release")
    model = tiny_model("falcon", **FALCON_LAYOUTS[layout])
    ids, mask = left_padded_batch([7, 3, 10], seed=1)
    ref = _generate(model, ids, mask, **MODES[mode])
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    # the second call from the prefix cache
    outs = _patched_calls(model, pool, monkeypatch, lambda: _generate(model, ids, mask, **MODES[mode]), calls=2)
    assert all(torch.equal(out, ref) for out in outs)
    assert pool.stats()["prefix_hit_tokens"] > 0 and pool.stats()["num_used_pages"] == 0


def _gemma2_past_its_softcap(implementation="default"):
    model = tiny_model("gemma2")
    if implementation == "eager":
        model.set_attn_implementation("eager")
    with torch.no_grad():  # logits well past the softcap of 5
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


@pytest.mark.parametrize("implementation", ["default", "eager"])
def test_gemma2_with_large_attention_logits_equals_stock_under_its_attention(implementation):
    # stock sdpa drops the attention logit softcap (Gemma 2's default before transformers 5.24, which refuses sdpa
    # for it since): paged attention applied it, and tokens differed from stock once the logits reach the cap
    def build():
        return _gemma2_past_its_softcap(implementation)

    stock, model = build(), build()
    ids, mask = left_padded_batch([20, 13], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    want = stock.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    with astrai_hf.patched(model, pool):
        got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences), model.config._attn_implementation
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-4, atol=1e-4)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("when", ["before patch()", "after patch()"])
def test_gemma2_set_to_sdpa_by_hand_does_as_stock_with_its_softcap(when):
    # set_attn_implementation("sdpa") refuses Gemma 2 from transformers 5.24, whose sdpa raises for a softcap; a
    # config set by hand reached it: stock raised, paged attention dropped the softcap and ran
    from astrai_hf.config import sdpa_refuses_softcap

    stock, model = _gemma2_past_its_softcap("eager"), _gemma2_past_its_softcap("eager")
    ids, mask = left_padded_batch([20, 13], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    scored = dict(kw, output_scores=True, return_dict_in_generate=True)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4)
    if when == "before patch()":
        model.config._attn_implementation = "sdpa"
    with astrai_hf.patched(model, pool):
        model.config._attn_implementation = stock.config._attn_implementation = "sdpa"
        if sdpa_refuses_softcap():
            with pytest.raises(ValueError, match="softcap"):
                stock.generate(ids, **kw)
            with pytest.raises(ValueError, match="softcap.*set_attn_implementation"):
                model.generate(ids, **kw)
        else:  # (older releases drop it, stock and paged alike: every score, before any token differs)
            got, want = model.generate(ids, **scored), stock.generate(ids, **scored)
            assert torch.equal(got.sequences, want.sequences)
            torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-4, atol=1e-4)
        assert pool.stats()["num_used_pages"] == 0
        model.config._attn_implementation = stock.config._attn_implementation = "eager"
        assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("kept", ["prefix cache", "decode graphs"])
def test_gemma2_switched_from_sdpa_to_eager_computes_nothing_from_before_the_switch(kept, monkeypatch):
    # under sdpa the softcap is dropped, so K/V and captured graphs of before a set_attn_implementation("eager") are
    # not those of after it: the prefix cache had served them, and a graph captured under sdpa had been replayed
    model = _gemma2_past_its_softcap()
    if model.config._attn_implementation != "sdpa":
        pytest.skip("this transformers release runs Gemma 2 on eager attention only")
    if kept == "decode graphs":
        import graph_tape

        graph_tape.install_capturing(monkeypatch)
    stock = _gemma2_past_its_softcap("eager")
    ids, mask = left_padded_batch([20, 13], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want = stock.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=4, prefix_cache=kept == "prefix cache")
    with astrai_hf.patched(model, pool, cuda_graphs=kept == "decode graphs"):
        under_sdpa = model.generate(ids, **kw)
        model.set_attn_implementation("eager")
        hits = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(model.generate(ids, **kw), want) and not torch.equal(under_sdpa, want)
        assert pool.stats()["prefix_hit_tokens"] == hits
    assert pool.stats()["num_used_pages"] == 0
