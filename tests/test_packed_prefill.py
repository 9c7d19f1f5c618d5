"""Packed prefill: a left-padded prefill runs on its real tokens only, chunked on request, with unchanged output."""

import contextlib

import pytest
import torch

import astrai_hf
import astrai_hf.patches
from astrai_hf import PagedCache, PagePool, cache_kwarg, packing
from tiny_models import ARCHS, left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence

PAGE = 16


@pytest.fixture
def spy(monkeypatch):
    """Counts packed forwards and the chunk sizes fed."""
    calls = {"packed": 0, "chunks": []}
    real = packing.packed_forward

    def counting(forward, kwargs, cache, state, step, input_ids, chunk_tokens):
        calls["packed"] += 1

        def counted_forward(**kw):
            calls["chunks"].append(kw["input_ids"].shape[1])
            return forward(**kw)

        return real(counted_forward, kwargs, cache, state, step, input_ids, chunk_tokens)

    monkeypatch.setattr(packing, "packed_forward", counting)
    return calls


def _generate(model, ids, mask, *, prefix_cache=False, pool=None, **kwargs):
    patch_kw = {k: kwargs.pop(k) for k in ("pack_prefill", "prefill_chunk_tokens") if k in kwargs}
    pool = pool or PagePool.from_model(model, max_tokens=4096, page_size=PAGE, prefix_cache=prefix_cache)
    astrai_hf.patch(model, pool=pool, **patch_kw)
    try:
        return model.generate(ids, attention_mask=mask, **{"do_sample": False, **kwargs})
    finally:
        astrai_hf.unpatch(model)
        assert pool.stats()["num_used_pages"] == 0


LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE + 3, 5]  # a row of one token, rows at page boundaries


@pytest.mark.parametrize("arch", ARCHS)
def test_matrix_packed_equals_stock(arch, spy):
    model = tiny_model(arch)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=7)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=7), ref)
    assert spy["packed"] == 1 and spy["chunks"] == [sum(LENGTHS)], "the prefill must run on real tokens only"
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=7, pack_prefill=False), ref)
    assert spy["packed"] == 1


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2", "gpt2"])
@pytest.mark.parametrize("chunk", [1, 7, PAGE, 1000])
def test_chunked_prefill(arch, chunk, spy):
    model = tiny_model(arch)
    ids, mask = left_padded_batch([23, 9, 40], seed=2)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=6, prefill_chunk_tokens=chunk), ref)
    n = 23 + 9 + 40
    assert spy["chunks"] == [min(chunk, n - a) for a in range(0, n, chunk)]


def test_no_padding_runs_the_rectangle_unless_chunked(spy):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 12, 12], seed=3)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=5), ref)
    assert spy["packed"] == 0  # nothing to drop
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=5, prefill_chunk_tokens=36), ref)
    assert spy["packed"] == 0  # a chunk holds the whole prompt
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=5, prefill_chunk_tokens=10), ref)
    assert spy["chunks"] == [10, 10, 10, 6]


@pytest.mark.parametrize("output", ["hidden_states", "attentions"])
def test_fallback_when_every_prompt_positions_outputs_are_asked_for(spy, output):
    model = tiny_model("llama")
    model.set_attn_implementation("eager")  # (sdpa returns no attention weights)
    ids, mask = left_padded_batch([3, 11], seed=4)
    kwargs = dict(max_new_tokens=4, return_dict_in_generate=True, output_scores=True, **{f"output_{output}": True})
    ref = model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    out = _generate(model, ids, mask, **kwargs)
    assert spy["packed"] == 0
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    got, want = getattr(out, output)[0][-1], getattr(ref, output)[0][-1]
    assert got.shape == want.shape  # every prompt position
    real = mask.bool()[:, :, None] if got.dim() == 3 else mask.bool()[:, None, :, None]
    torch.testing.assert_close(got * real, want * real, rtol=1e-5, atol=1e-5)  # at real positions, as stock's


@pytest.mark.parametrize("asks", ["logits_to_keep=2", "config.output_hidden_states"])
def test_a_forward_of_ones_own_asking_for_more_than_the_last_logits_runs_as_stock(spy, asks):
    # a direct forward of a patched model on a padded batch: two kept positions, or hidden states the config asks
    # for (no keyword), need every row's own columns; a packed forward would hand back one row of the real tokens
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 11, 6], seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
              logits_to_keep=2 if asks == "logits_to_keep=2" else 1)
    model.config.output_hidden_states = asks == "config.output_hidden_states"
    pool = PagePool.from_model(model, max_tokens=1024, page_size=PAGE)
    with torch.no_grad():
        want = model(**kw, **{cache_kwarg(model): DynamicCache()})
        with astrai_hf.patched(model, pool=pool), PagedCache(pool, prefix_cache=False) as cache:
            got = model(**kw, **{cache_kwarg(model): cache})
    assert spy["packed"] == 0
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    if asks == "config.output_hidden_states":
        real = mask.bool()[:, :, None]
        assert got.hidden_states[-1].shape == want.hidden_states[-1].shape
        torch.testing.assert_close(got.hidden_states[-1] * real, want.hidden_states[-1] * real, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_loop_of_ones_own_chunked_without_positions_equals_stock(arch, spy):
    # no position_ids and no mask: the packed, chunked prefill computes each row's positions from its stored
    # length (RoPE shows a shift only in the later steps, learned absolute positions at once)
    from transformers import DynamicCache

    model = tiny_model(arch)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))

    def loop(cache, steps=4):
        kw = {cache_kwarg(model): cache, "use_cache": True}
        logits = [model(input_ids=ids, logits_to_keep=1, **kw).logits[:, -1]]
        for _ in range(steps):
            logits.append(model(input_ids=logits[-1].argmax(-1, keepdim=True), **kw).logits[:, -1])
        return torch.stack(logits, 1)

    pool = PagePool.from_model(model, max_tokens=1024, page_size=PAGE)
    with torch.no_grad():
        want = loop(DynamicCache())
        with astrai_hf.patched(model, pool=pool, prefill_chunk_tokens=8), PagedCache(pool, prefix_cache=False) as c:
            got = loop(c)
    assert spy["packed"] == 1 and spy["chunks"] == [8, 8, 8]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("pad", [-100, 96, 96 + 5], ids=["negative", "the-vocabulary-size", "past-the-vocabulary"])
def test_a_masked_pad_id_outside_the_vocabulary_fails_as_stock_does(spy, pad):
    # a pad token added to the tokenizer without resizing the embeddings: stock embeds the padding and raises;
    # packed, the padding was never read and the call ran
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 11], seed=4)
    ids = ids.masked_fill(mask == 0, pad)
    with pytest.raises(IndexError):
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    with pytest.raises(IndexError):
        _generate(model, ids, mask, max_new_tokens=2)
    assert spy["packed"] == 0
    # the same prompts with a pad id in the vocabulary cached first: a prefix hit had skipped the padding and run
    pool = PagePool.from_model(model, max_tokens=4096, page_size=PAGE, prefix_cache=True)
    _generate(model, ids.masked_fill(mask == 0, 0), mask, pool=pool, max_new_tokens=2)
    assert pool.stats()["prefix_cache_pages"] > 0
    for kwargs in (dict(), dict(do_sample=True, num_return_sequences=2)):
        with pytest.raises(IndexError):
            _generate(model, ids, mask, pool=pool, max_new_tokens=2, **kwargs)
    for patched in (False, True):  # a PagedCache of the caller's, built with the prompt, starts empty
        with contextlib.ExitStack() as stack:
            if patched:
                stack.enter_context(astrai_hf.patched(model, pool=pool))
            with PagedCache(pool, ids, mask, model=model) as cache:
                assert cache.get_seq_length() == 0
                with pytest.raises(IndexError):
                    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2,
                                   **{cache_kwarg(model): cache})
        assert pool.stats()["num_used_pages"] == 0
    if pad < 0:  # a pool bound to no model, and a cache told of none: a negative id is outside any vocabulary
        unbound = PagePool(model.config, max_tokens=4096, page_size=PAGE)
        with PagedCache(unbound, ids.masked_fill(mask == 0, 0), mask) as cache:
            model.generate(ids.masked_fill(mask == 0, 0), attention_mask=mask, do_sample=False, max_new_tokens=2,
                           **{cache_kwarg(model): cache})
        assert unbound.stats()["prefix_cache_pages"] > 0
        with PagedCache(unbound, ids, mask) as cache:
            assert cache.get_seq_length() == 0
            with pytest.raises(IndexError):
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2,
                               **{cache_kwarg(model): cache})
        assert unbound.stats()["num_used_pages"] == 0


def test_fallback_for_a_family_not_known_to_be_position_wise(spy, monkeypatch):
    monkeypatch.setattr(astrai_hf.patches, "PACKED_PREFILL", astrai_hf.patches.PACKED_PREFILL - {"llama"})
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 11], seed=5)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=4, prefill_chunk_tokens=4), ref)
    assert spy["packed"] == 0


def test_unpatched_model_is_untouched(spy):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 11], seed=6)
    pool = PagePool.from_model(model, max_tokens=1024, page_size=PAGE)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    with astrai_hf.PagedCache(pool) as cache:
        kw = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, **{kw: cache})
    assert torch.equal(out, ref) and spy["packed"] == 0


@pytest.mark.parametrize("mode", ["sample", "beams"])
def test_identical_rows_are_computed_once(mode, spy):
    model = tiny_model("llama")
    ids, mask = left_padded_batch([9, 30], seed=7)
    if mode == "sample":
        kwargs = dict(do_sample=True, num_return_sequences=4, max_new_tokens=6)
    else:
        kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    torch.manual_seed(0)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(_generate(model, ids, mask, **kwargs), ref)
    assert spy["chunks"] == [9 + 30]  # one copy of each prompt went through the model


def test_packed_after_a_prefix_hit(spy):
    model = tiny_model("llama", max_position_embeddings=512)
    ids, mask = left_padded_batch([40, 45, 20], seed=8)
    pool = PagePool.from_model(model, max_tokens=4096, page_size=PAGE)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert torch.equal(_generate(model, ids, mask, pool=pool, max_new_tokens=6), ref)
    hits = pool.stats()["prefix_hit_tokens"]
    assert torch.equal(_generate(model, ids, mask, pool=pool, max_new_tokens=6, prefill_chunk_tokens=5), ref)
    assert pool.stats()["prefix_hit_tokens"] - hits == 3 * 45 - 5 - 25 - 3  # one column recomputed per row
    assert spy["chunks"] == [40 + 45 + 20]  # the second call's one-column prefill has no padding to drop


@pytest.mark.parametrize("mode", ["sample", "beams"])
def test_identical_rows_computed_once_after_a_prefix_hit(mode, spy):
    # the prompts' cached pages make their rows' slots not consecutive: each copy computed reads its K/V through
    # its own prompt's req_to_token row (not the first rows', which are two copies of the first prompt)
    model = tiny_model("llama")
    base, base_mask = left_padded_batch([9, 13], seed=7)
    more, more_mask = left_padded_batch([6, 6], seed=8)
    ids, mask = torch.cat([base, more], 1), torch.cat([base_mask, more_mask], 1)  # the same prompts, 6 tokens on
    kwargs = (dict(do_sample=True, num_return_sequences=2, max_new_tokens=6) if mode == "sample" else
              dict(num_beams=2, num_return_sequences=2, max_new_tokens=6))
    torch.manual_seed(0)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    pool = PagePool.from_model(model, max_tokens=4096, page_size=4)  # (pages smaller than the prompts)
    _generate(model, base, base_mask, pool=pool, max_new_tokens=1)  # caches the prompts' pages
    torch.manual_seed(0)
    assert torch.equal(_generate(model, ids, mask, pool=pool, **kwargs), ref)
    assert pool.stats()["prefix_hit_tokens"] > 0 and spy["packed"] == 2


def test_bad_chunk_size_is_refused():
    model = tiny_model("llama")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk_tokens"):
            astrai_hf.patch(model, prefill_chunk_tokens=bad)
    assert not astrai_hf.is_patched(model)


@pytest.mark.slow
def test_embedded_model_packed_and_chunked(spy):
    from astrai_hf.models import embedded_gguf, load_model

    try:
        embedded_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tokenizer = load_model()
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "Explain in two sentences why the sky is blue, as if to a child who asks many questions.", "Hi"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=24), ref)
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=24, prefill_chunk_tokens=PAGE), ref)
    assert spy["packed"] == 2 and spy["chunks"][0] == int(mask.sum())


def test_a_packed_prefill_says_nothing_of_padding_where_stock_does_not(spy, monkeypatch):
    # GPT-2's forward warns of padding where an input id is the pad token and no mask is given; a packed prefill
    # gives none (paged attention reads each row's padding from the cache), so a real token equal to the pad
    # token (a pad token id that is also eos's) had it warn, reading the ids back to the host, where stock did not
    import transformers.modeling_utils as modeling_utils

    said = []
    monkeypatch.setattr(modeling_utils.logger, "warning_once", lambda *a, **k: said.append(a))
    model = tiny_model("gpt2")
    ids, mask = left_padded_batch([5, 9], seed=3)
    ids[1, -1] = model.config.pad_token_id  # a real token, the packed row's last
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert said == []
    assert torch.equal(_generate(model, ids, mask, max_new_tokens=3), ref) and spy["packed"] == 1
    assert said == []
