"""PagedCache bookkeeping: page boundaries, no padding stored, no leaks, pool exhaustion, bad input."""

import contextlib
import inspect
import re

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

import astrai_hf
from astrai_hf import CacheFullError, PagedCache, PagePool
from tiny_models import left_padded_batch, tiny_model

PAGE = 4


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _kw(model):
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.compat
@pytest.mark.parametrize("prompt_len", [1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE])
@pytest.mark.parametrize("new_tokens", [1, PAGE - 1, PAGE + 1])
def test_page_boundaries(llama, prompt_len, new_tokens):
    ids, mask = left_padded_batch([prompt_len, max(1, prompt_len - 1), prompt_len + 1], seed=prompt_len)
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens)
    ref = llama.generate(ids, attention_mask=mask, **kwargs)
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    cache = PagedCache(pool)
    out = llama.generate(ids, attention_mask=mask, **kwargs, **{_kw(llama): cache})
    assert torch.equal(out, ref)
    # The cache reads the padding from the positions the layers pass update(). A row of one real token has
    # positions of zeros only, as a right-padded row of one token has: there every column is stored, which is
    # right for both. Before transformers 5.24 the layers pass no positions, and an unpatched cache given neither
    # the prompt nor its mask stores every column (as the README says). The last generated token is never fed back.
    if Version(transformers.__version__) >= Version("5.24"):
        stored = [ids.shape[1] if n == 1 else n for n in mask.sum(-1).tolist()]
    else:
        stored = [ids.shape[1]] * ids.shape[0]
    expected = [n + new_tokens - 1 for n in stored]
    assert cache.seq_lens == expected, "padding must not be stored"
    assert cache.num_pages == sum(-(-n // PAGE) for n in expected)
    cache.release()
    astrai_hf.patch(llama, pool=pool)
    try:
        out = llama.generate(ids, attention_mask=mask, **kwargs)
    finally:
        astrai_hf.unpatch(llama)
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("patched", [False, True])
def test_a_pool_whose_memory_starts_as_nan_gives_stocks_tokens(llama, monkeypatch, patched):
    # a new pool's memory is uninitialised, save the trash page: padding reads it (masked out, but a masked
    # column's V still enters the weighted sum as 0 * V), so it must hold zeros, not whatever was there
    from astrai_hf import storage

    empty = storage._empty_head_major
    monkeypatch.setattr(storage, "_empty_head_major", lambda *args: empty(*args).fill_(float("nan")))
    ids, mask = left_padded_batch([PAGE + 1, 1, 2 * PAGE], seed=5)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=PAGE + 1)
    ref = llama.generate(ids, **kwargs)
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    assert pool.storage.v[0].isnan().any() and not pool.storage.v[0][:PAGE].isnan().any()
    if patched:
        with astrai_hf.patched(llama, pool=pool):
            out = llama.generate(ids, **kwargs)
    else:
        with PagedCache(pool) as cache:
            out = llama.generate(ids, **kwargs, **{_kw(llama): cache})
    assert torch.equal(out, ref)
    assert pool.stats()["num_used_pages"] == 0


def test_no_leak_over_many_calls(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    astrai_hf.patch(llama, pool=pool)
    try:
        for i in range(50):
            ids, mask = left_padded_batch([1 + i % 9, 1 + (i * 7) % 11], seed=i)
            llama.generate(ids, attention_mask=mask, do_sample=bool(i % 2), max_new_tokens=1 + i % 5,
                           num_beams=1 + (i % 3 == 0))
            stats = pool.stats()
            assert stats["num_used_pages"] == 0 and stats["num_reqs_used"] == 0
    finally:
        astrai_hf.unpatch(llama)


def test_forgotten_cache_is_released_by_its_finaliser(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    ids, mask = left_padded_batch([5, 9])
    cache = PagedCache(pool)
    llama.generate(ids, attention_mask=mask, max_new_tokens=3, **{_kw(llama): cache})
    assert pool.stats()["num_used_pages"] > 0
    del cache
    import gc

    gc.collect()
    assert pool.stats()["num_used_pages"] == 0


def test_pool_running_out_mid_generate_raises_and_releases(llama):
    pool = PagePool.from_model(llama, max_tokens=6 * PAGE, page_size=PAGE)  # 6 pages
    ids, mask = left_padded_batch([7, 7], seed=3)  # 2 pages per row to prefill, then growth
    astrai_hf.patch(llama, pool=pool)
    try:
        with pytest.raises(CacheFullError) as err:
            llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
        assert isinstance(err.value, RuntimeError)
        assert err.value.needed > err.value.free and "free" in str(err.value) and "evictable" in str(err.value)
        assert pool.stats()["num_used_pages"] == 0
        ref = _stock(llama, ids, mask, max_new_tokens=4)
        out = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)  # the next call works
        assert torch.equal(out, ref)
    finally:
        astrai_hf.unpatch(llama)
    cache = PagedCache(pool)
    with pytest.raises(CacheFullError):
        llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, **{_kw(llama): cache})
    assert pool.stats()["num_used_pages"] == 0


def _stock(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def test_too_many_rows_is_cache_full(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, max_reqs=2)
    ids, mask = left_padded_batch([3, 4, 5])
    astrai_hf.patch(llama, pool=pool)
    try:
        hint = (r"; give the pool more request rows \(PagePool.from_model\(model, max_reqs=...\), "
                r"patch\(model, max_reqs=...\), or astrai-hf run --max-reqs\)")
        with pytest.raises(CacheFullError, match="request rows.*" + hint):
            llama.generate(ids, attention_mask=mask, max_new_tokens=2)
    finally:
        astrai_hf.unpatch(llama)
    assert pool.stats()["num_reqs_used"] == 0


def test_beams_beyond_max_reqs_say_how_many_rows_the_batch_grew_to(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, max_reqs=4)
    ids, mask = left_padded_batch([3, 4, 5])
    astrai_hf.patch(llama, pool=pool)
    try:
        with pytest.raises(CacheFullError, match=r"growing 3 rows to 9 \(beams or num_return_sequences\), max_reqs=4"):
            llama.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=3, do_sample=False)
    finally:
        astrai_hf.unpatch(llama)
    assert pool.stats()["num_reqs_used"] == 0 and pool.stats()["num_used_pages"] == 0


def test_prompt_longer_than_max_seq_len_fails_before_any_forward(llama, monkeypatch):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, max_seq_len=12)
    ids, mask = left_padded_batch([6, 9])
    astrai_hf.patch(llama, pool=pool)
    calls = []
    monkeypatch.setattr(type(llama), "forward", lambda *a, **k: calls.append(1))
    try:
        with pytest.raises(ValueError, match="max_seq_len=12"):
            llama.generate(ids, attention_mask=mask, max_new_tokens=4)
    finally:
        astrai_hf.unpatch(llama)
    assert calls == []
    with pytest.raises(ValueError, match="max_seq_len=12"):
        PagedCache(pool, torch.ones(1, 13, dtype=torch.long))


ROOM_CASES = {  # patch() settings, rows and generate() arguments -> the call the error names
    "one row": (dict(max_tokens=64, page_size=4), [10], {},
                "patch(model, max_tokens=80, page_size=4, max_seq_len=80)"),
    "slots enough": (dict(max_tokens=256, page_size=4), [10], {},
                     "patch(model, max_tokens=256, page_size=4, max_seq_len=80)"),
    "two rows": (dict(max_tokens=64, page_size=4), [10, 8], {},
                 "patch(model, max_tokens=160, page_size=4, max_seq_len=80)"),
    "two beams": (dict(max_tokens=100, page_size=4), [10], dict(num_beams=2),
                  "patch(model, max_tokens=160, page_size=4, max_seq_len=80)"),
    "other settings": (dict(max_tokens=64, page_size=4, device=torch.device("cpu"), pack_prefill=False,
                            prefill_chunk_tokens=4), [10], {},
                       "patch(model, max_tokens=80, page_size=4, device='cpu', max_seq_len=80, pack_prefill=False, "
                       "prefill_chunk_tokens=4)"),
    "memory fraction": (dict(memory_fraction=1e-6, page_size=4), [10], {}, None),
}


@pytest.mark.parametrize("case", list(ROOM_CASES))
def test_the_advice_for_a_call_past_max_seq_len_is_a_patch_that_runs_it(case):
    # it had named patch(model, max_seq_len=N), which drops the settings patch() was given, and too few slots for
    # the call's rows of N tokens left the call to fail with CacheFullError mid-generation
    settings, lengths, extra, advised = ROOM_CASES[case]
    model, stock = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch(lengths, seed=1)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=70, min_new_tokens=70, **extra)
    want = stock.generate(ids, **kw)
    astrai_hf.patch(model, **settings, max_seq_len=64)
    try:
        with pytest.raises(ValueError, match=r"reaches 80 tokens, more than the pool's max_seq_len=64; give the "
                           r"pool patch\(\) builds room for them: patch\(model, .*\), or lower "
                           r"max_new_tokens=70") as raised:
            model.generate(ids, **kw)
        call = re.search(r"(patch\(model, [^)]*\))", str(raised.value)).group(1)
        if advised is None:  # (a fraction of the memory free: the message names it, not a value)
            assert "and a larger memory_fraction (the pool holds" in str(raised.value)
            return
        assert call == advised
        exec(call, {"patch": astrai_hf.patch, "model": model})
        assert torch.equal(model.generate(ids, **kw), want)
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0
    finally:
        astrai_hf.unpatch(model)


def test_the_default_length_is_checked_before_any_forward(llama, monkeypatch):
    # neither max_new_tokens nor max_length: generate() makes 20 new tokens after the padded prompt
    config = llama.generation_config
    saved = config.max_length, config.max_new_tokens
    config.max_length = config.max_new_tokens = None
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, max_seq_len=32)
    ids, mask = left_padded_batch([16])
    astrai_hf.patch(llama, pool=pool)
    calls = []
    try:
        with monkeypatch.context() as m:
            m.setattr(type(llama), "forward", lambda *a, **k: calls.append(1))
            with pytest.raises(ValueError, match=r"reaches 36 tokens, more than the pool's max_seq_len=32; build "
                               r"the pool again with room for them: PagePool.from_model\(model, max_seq_len=36\), "
                               r"with its other settings as they were, or lower max_new_tokens \(default 20\)"):
                llama.generate(ids, attention_mask=mask, do_sample=False)
            # the error names the setting that set the length, as the caller gave it
            with pytest.raises(ValueError, match=r"reaches 40 tokens, .* lower max_length=40$"):
                llama.generate(ids, attention_mask=mask, max_length=40, do_sample=False)
            config.max_length = 40  # a generation config's max_length counts as the caller's
            with pytest.raises(ValueError, match=r"reaches 40 tokens, .* lower max_length=40$"):
                llama.generate(ids, attention_mask=mask, do_sample=False)
            config.max_length = None
            with pytest.raises(ValueError, match=r"reaches 40 tokens, .* lower max_new_tokens=24$"):
                llama.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        assert calls == []
        assert llama.generate(ids[:, 4:], attention_mask=mask[:, 4:], do_sample=False).shape[1] == 32  # 12 + 20 fits
    finally:
        astrai_hf.unpatch(llama)
        config.max_length, config.max_new_tokens = saved
    assert pool.stats()["num_used_pages"] == 0


def test_a_prompt_longer_than_the_whole_pool_fails_before_any_forward(llama, monkeypatch):
    pool = PagePool.from_model(llama, max_tokens=64, page_size=PAGE, max_seq_len=512)
    ids, mask = left_padded_batch([80, 20])
    astrai_hf.patch(llama, pool=pool)
    calls = []
    try:
        with monkeypatch.context() as m:
            m.setattr(type(llama), "forward", lambda *a, **k: calls.append(1))
            with pytest.raises(CacheFullError, match=rf"needed {-(-80 // PAGE)} pages, {64 // PAGE} free.*80 tokens "
                                                     r"is longer than the whole pool \(64 tokens\)"):
                llama.generate(ids, attention_mask=mask, max_new_tokens=2)
    finally:
        astrai_hf.unpatch(llama)
    assert calls == []
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


def test_unpatched_cache_refuses_a_row_past_max_seq_len(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, max_seq_len=10)
    ids, mask = left_padded_batch([6, 8])
    cache = PagedCache(pool)
    # (before transformers 5.24 an unpatched cache sees no positions, so it counts the padding as tokens: row 0)
    row = 1 if Version(transformers.__version__) >= Version("5.24") else 0
    with pytest.raises(ValueError, match=f"row {row} would hold 11 tokens, more than the pool's max_seq_len=10"):
        llama.generate(ids, attention_mask=mask, max_new_tokens=8, **{_kw(llama): cache})
    # the step was refused before anything changed: the cache keeps the 10 columns it held, as a stock cache keeps
    # its own after a forward that raised, until it is released
    assert cache.get_seq_length() == 10 and pool.stats()["num_used_pages"] > 0
    cache.release()
    assert pool.stats()["num_used_pages"] == 0


def test_a_refused_draft_past_max_seq_len_leaves_a_hand_loop_cache_as_it_was(llama):
    # a speculative loop falling back to a shorter draft: the cache had been emptied by the refusal, and the next
    # forward ran as if its token were fed alone
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, max_seq_len=16)
    ids = torch.arange(3, 15)[None]
    want = llama(torch.cat([ids, torch.tensor([[20]])], 1)).logits[:, -1]
    for patched in (False, True):
        with astrai_hf.patched(llama, pool=pool) if patched else contextlib.nullcontext():
            cache = PagedCache(pool, prefix_cache=False)
            llama(ids, past_key_values=cache)
            with pytest.raises(ValueError, match="row 0 would hold 18 tokens, more than the pool's max_seq_len=16"):
                llama(torch.arange(20, 26)[None], past_key_values=cache)
            assert cache.get_seq_length() == 12
            got = llama(torch.tensor([[20]]), past_key_values=cache).logits[:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            cache.release()
        assert pool.stats()["num_used_pages"] == 0


def test_right_padding_is_refused_with_a_clear_error(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="left-padded"):
        PagedCache(pool, torch.ones(2, 3, dtype=torch.long), mask)


@pytest.mark.equivalence
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_a_right_padded_row_of_one_token_unpatched_gives_the_tokens_of_stock(arch):
    # against generate()'s contract, and stock warns, but a cache told nothing reads padding from the positions
    # alone, and a row of one token has positions of zeros whichever side its padding is on: every column is kept
    model = tiny_model(arch)
    ids, mask = left_padded_batch([1, 6, 4], seed=5)
    for r in range(ids.shape[0]):  # padding moved to the right
        n = int(mask[r].sum())
        ids[r] = torch.cat([ids[r, -n:], ids[r, :-n]]) if n < ids.shape[1] else ids[r]
        mask[r] = torch.cat([mask[r, -n:], mask[r, :-n]]) if n < ids.shape[1] else mask[r]
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=5)
    ref = model.generate(ids, **kw)
    pool = PagePool.from_model(model, max_tokens=256, page_size=PAGE)
    with PagedCache(pool) as cache:
        assert torch.equal(model.generate(ids, **kw, **{_kw(model): cache}), ref)
    assert pool.stats()["num_used_pages"] == 0


def test_row_operations_share_pages(llama):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    ids, mask = left_padded_batch([6, 3])
    cache = PagedCache(pool, ids, mask)  # a bare forward gets no position_ids: the cache needs the mask
    llama(input_ids=ids, attention_mask=mask, **{_kw(llama): cache})
    used = pool.stats()["num_used_pages"]
    cache.batch_repeat_interleave(3)
    assert cache.seq_lens == [6, 6, 6, 3, 3, 3]
    assert pool.stats()["num_used_pages"] == used, "repeated rows share pages"
    cache.batch_select_indices(torch.tensor([0, 4]))
    assert cache.seq_lens == [6, 3]
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.seq_lens == [3, 3]
    cache.crop(-2)
    assert cache.seq_lens == [1, 1] and cache.get_seq_length() == 4
    cache.release()
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


@pytest.mark.parametrize("repeats", [np.int64(2), torch.tensor(2)], ids=["numpy", "torch"])
def test_batch_repeat_interleave_takes_integer_scalars_as_dynamic_cache_does(llama, repeats):
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    ids, mask = left_padded_batch([6, 3])
    with PagedCache(pool, ids, mask) as cache:
        llama(input_ids=ids, attention_mask=mask, **{_kw(llama): cache})
        cache.batch_repeat_interleave(repeats)
        assert cache.seq_lens == [6, 6, 3, 3]
        with pytest.raises(ValueError, match=r"repeats must be a non-negative int, got -1"):
            cache.batch_repeat_interleave(-1)
    assert pool.stats()["num_used_pages"] == 0


def test_crop_with_a_positive_length_does_what_dynamic_cache_does(llama):
    # PagedCache had kept that many columns where transformers 5.24's DynamicCache.crop raises
    from transformers import DynamicCache

    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    ids, mask = left_padded_batch([6, 3])
    caches = [DynamicCache(), PagedCache(pool, ids, mask)]
    for cache in caches:
        llama(input_ids=ids, attention_mask=mask, **{_kw(llama): cache})
    try:
        caches[0].crop(4)
    except ValueError:  # transformers 5.18 and later
        with pytest.raises(ValueError, match="crop\\(4\\): a positive value"):
            caches[1].crop(4)
    else:
        caches[1].crop(4)
    assert caches[1].get_seq_length() == caches[0].get_seq_length()
    caches[1].release()
    assert pool.stats()["num_used_pages"] == 0


def test_cache_continues_across_forward_calls(llama):
    """A pre-filled cache, then generate() on the full prompt: only the rest is prefilled."""
    ids, mask = left_padded_batch([9, 5], seed=5)
    ref = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    for patched in (False, True):
        if patched:
            astrai_hf.patch(llama, pool=pool)
        try:
            cache = PagedCache(pool, ids, mask, prefix_cache=False)  # filled by hand below
            assert cache.get_seq_length() == 0
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            llama(input_ids=ids[:, :6], attention_mask=mask[:, :6], position_ids=pos[:, :6], **{_kw(llama): cache})
            out = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, **{_kw(llama): cache})
            assert torch.equal(out, ref)
            cache.release()
        finally:
            astrai_hf.unpatch(llama)
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("chunk", [1, 3, PAGE, 64])
def test_chunked_prefill(llama, chunk):
    ids, mask = left_padded_batch([9, 2, 6], seed=7)
    kwargs = dict(do_sample=False, max_new_tokens=5, prefill_chunk_size=chunk)
    ref = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE)
    with PagedCache(pool) as cache:
        assert torch.equal(llama.generate(ids, attention_mask=mask, **kwargs, **{_kw(llama): cache}), ref)
    astrai_hf.patch(llama, pool=pool)
    try:
        assert torch.equal(llama.generate(ids, attention_mask=mask, **kwargs), ref)
    finally:
        astrai_hf.unpatch(llama)
    assert pool.stats()["num_used_pages"] == 0


def _decode_row_starts(monkeypatch) -> list:
    """Record ``row_starts`` of every decode step's paged attention call."""
    import astrai_hf.attention as attention

    seen, original = [], attention.paged_attention

    def spy(query, k_cache, v_cache, meta, **kw):
        if meta.q_len == 1:
            seen.append(meta.row_starts)
        return original(query, k_cache, v_cache, meta, **kw)

    monkeypatch.setattr(attention, "paged_attention", spy)
    return seen


def test_generate_keeps_each_row_in_consecutive_slots(llama, monkeypatch):
    """A patched generate() takes each row's pages as one run with room for its new tokens: every decode step reads
    every row in place (no gather), tokens equal stock, and the reserved pages go back to the pool, also when the
    free list was left out of order by earlier calls."""
    pool = PagePool.from_model(llama, max_tokens=256, page_size=PAGE, prefix_cache=False)
    seen = _decode_row_starts(monkeypatch)
    astrai_hf.patch(llama, pool=pool)
    try:
        for i, lengths in enumerate([[3, 9, 1, 13], [5, 2], [16, 4, 7]]):
            ids, mask = left_padded_batch(lengths, seed=10 + i)
            out = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=11)
            assert pool.stats()["num_used_pages"] == 0
            astrai_hf.unpatch(llama)
            assert torch.equal(out, _stock(llama, ids, mask, max_new_tokens=11))
            astrai_hf.patch(llama, pool=pool)
    finally:
        astrai_hf.unpatch(llama)
    assert len(seen) == 3 * 10 * llama.config.num_hidden_layers
    assert all(starts is not None and None not in starts for starts in seen)


def test_reserved_pages_come_from_free_pages_only(llama):
    """Room for new tokens is reserved only from free pages: a cached prefix is never evicted for it, and when not
    all of it is free each row gets an even share of what is."""
    pool = PagePool.from_model(llama, max_tokens=24 * PAGE, page_size=PAGE)
    astrai_hf.patch(llama, pool=pool)
    try:
        ids, mask = left_padded_batch([30, 22], seed=4)
        llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    finally:
        astrai_hf.unpatch(llama)
    before = pool.stats()
    assert before["num_cached_pages"] > 0
    ids, mask = left_padded_batch([6, 9], seed=5)
    cache = PagedCache(pool, ids, mask, reserve_new_tokens=before["num_free_pages"] * PAGE)
    step = cache.plan_step(2, ids.shape[1], attention_mask=mask, input_ids=ids, paged=True)
    after = pool.stats()
    assert after["evictions"] == before["evictions"] and after["num_cached_pages"] == before["num_cached_pages"]
    room = before["num_free_pages"] - (2 + 3)  # free beyond the prompts' pages, shared evenly by the 2 rows
    assert after["num_used_pages"] == 2 + 3 + 2 * (room // 2)
    assert None not in step.row_starts
    cache.release()
    cache = PagedCache(pool, ids, mask, reserve_new_tokens=7)
    step = cache.plan_step(2, ids.shape[1], attention_mask=mask, input_ids=ids, paged=True)
    assert pool.stats()["num_used_pages"] == -(-(6 + 7) // PAGE) + -(-(9 + 7) // PAGE)
    assert None not in step.row_starts
    cache.release()
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", torch.tensor(2.0)])
def test_reserve_new_tokens_is_checked(llama, bad):
    pool = PagePool.from_model(llama, max_tokens=64, page_size=PAGE)
    with pytest.raises(ValueError, match="reserve_new_tokens must be a non-negative int, got"):
        PagedCache(pool, reserve_new_tokens=bad)
    import numpy as np

    assert PagedCache(pool, reserve_new_tokens=np.int64(3)).reserve_new_tokens == 3


def _eos_after(model, ids, mask, n):
    """EOS ids that make every row stop after ``n`` new tokens (each row's n-th greedy token)."""
    probe = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    return sorted(set(probe[:, -1].tolist()))


def test_unused_reservations_go_back_before_a_row_runs_short(llama):
    """Rows that stop early (EOS) never use their reserved room. Another row of the same call that had to grow page
    by page (it met its first token in a later prefill chunk) takes that room back instead of failing: the call
    fits exactly where it fits without reservations."""
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 0, 0, 0, 0, 0, 0, 0, 21, 22]])
    mask = (ids != 0).long()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, prefill_chunk_size=4,
              eos_token_id=_eos_after(llama, ids, mask, 5))
    ref = llama.generate(ids, **kw)
    pool = PagePool.from_model(llama, max_tokens=8 * PAGE, page_size=PAGE, prefix_cache=False)
    with astrai_hf.patched(llama, pool):
        assert torch.equal(llama.generate(ids, **kw), ref)
    assert pool.stats()["num_used_pages"] == 0


def test_reservations_go_back_before_cached_prefixes_are_evicted(llama):
    """A row that hits the prefix cache gets no reservation; when it runs short, the new row's unused room goes
    back first, so no cached prefix is evicted for it."""
    first = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]])
    turn = llama.generate(first, max_new_tokens=2, do_sample=False)[0].tolist() + [19]
    other = [21, 22, 23]
    ids = torch.tensor([turn, [0] * (len(turn) - len(other)) + other])
    mask = torch.tensor([[1] * len(turn), [0] * (len(turn) - len(other)) + [1] * len(other)])
    kw = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
              eos_token_id=_eos_after(llama, ids, mask, 4))
    ref = llama.generate(ids, **kw)
    pool = PagePool.from_model(llama, max_tokens=30, page_size=1)
    with astrai_hf.patched(llama, pool):
        llama.generate(first, max_new_tokens=2, do_sample=False)  # fills the prefix cache
        assert torch.equal(llama.generate(ids, **kw), ref)
    stats = pool.stats()
    assert stats["evictions"] == 0 and stats["num_used_pages"] == 0 and stats["prefix_hit_tokens"] > 0


def test_reset_cache_learns_the_next_prompts_padding(llama):
    """``reset()`` then reuse on an unpatched model: the next prompt's padding is read afresh, not the old one's."""
    pool = PagePool.from_model(llama, max_tokens=512, page_size=PAGE)
    ids1, mask1 = left_padded_batch([3, 9], seed=0)
    ids2, mask2 = left_padded_batch([9, 2], seed=1)
    cache = PagedCache(pool, ids1, mask1)
    _stock(llama, ids1, mask1, max_new_tokens=6, **{_kw(llama): cache})
    cache.reset()
    out = _stock(llama, ids2, mask2, max_new_tokens=6, **{_kw(llama): cache})
    assert torch.equal(out, _stock(llama, ids2, mask2, max_new_tokens=6))
    cache.release()
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.equivalence
def test_deepcopy_shares_pages_and_gives_the_tokens_of_the_transformers_prompt_reuse_recipe():
    import copy

    from transformers import DynamicCache

    model = tiny_model("llama")
    prompt = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(4))
    turns = [torch.cat([prompt, torch.tensor([[7 + i, 8, 9]])], dim=1) for i in range(2)]
    kw = dict(max_new_tokens=6, do_sample=False)

    def recipe(make_cache):  # fill a cache with the prompt once, then continue from a copy of it per turn
        prompt_cache = make_cache()
        with torch.no_grad():
            model(prompt, past_key_values=prompt_cache)
        outs = [model.generate(t, past_key_values=copy.deepcopy(prompt_cache), **kw) for t in turns]
        return outs, prompt_cache

    want, _ = recipe(DynamicCache)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    got, prompt_cache = recipe(lambda: PagedCache(pool))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    twin = copy.deepcopy(prompt_cache)
    assert twin.pool is pool and twin.seq_lens == prompt_cache.seq_lens == [10]
    used = pool.stats()["num_used_pages"]
    assert used == prompt_cache.num_pages  # the copy holds the same pages, no new ones
    twin.release()
    prompt_cache.release()
    import gc

    gc.collect()  # the copies generate() ran on are released when collected
    assert pool.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("order", ["copy, then clear", "clear, then copy"])
def test_a_copy_of_a_cache_started_from_a_prefix_hit_goes_on_as_it_does_after_the_prefix_cache_is_cleared(order):
    # clear_prefix_cache() with the model and weights unchanged: the cache goes on (its pages are this model's
    # K/V); its copy had been released and refused, as if the pool served another model
    import copy

    model = tiny_model("llama", seed=1)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = model(ids).logits[:, -1]
    with astrai_hf.patched(model, pool=pool), torch.no_grad():
        name = astrai_hf.cache_kwarg(model)
        with PagedCache(pool, ids[:, :7], mask[:, :7]) as first:
            model(input_ids=ids[:, :7], attention_mask=mask[:, :7], **{name: first})
        cache = PagedCache(pool, ids, mask)
        assert cache.get_seq_length() == 7
        if order == "copy, then clear":
            twin = copy.deepcopy(cache)
            pool.clear_prefix_cache()
        else:
            pool.clear_prefix_cache()
            twin = copy.deepcopy(cache)
        positions = torch.arange(7, 9)[None]
        for c in (cache, twin):
            got = model(input_ids=ids[:, 7:], attention_mask=mask, position_ids=positions, **{name: c}).logits
            torch.testing.assert_close(got[:, -1], want, rtol=1e-5, atol=1e-5)
            c.release()
    assert pool.stats()["num_used_pages"] == 0


def test_a_patched_generate_output_pickles_as_a_stock_one_and_a_live_cache_or_pool_says_why_not(tmp_path):
    # torch.save(out) of return_dict_in_generate had failed on the returned cache's weak references
    import copy
    import pickle

    from transformers import DynamicCache

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=1)
    with astrai_hf.patched(model, max_tokens=256, page_size=4):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
        torch.save(out, tmp_path / "out.pt")
        loaded = torch.load(tmp_path / "out.pt", weights_only=False)
        assert torch.equal(loaded.sequences, out.sequences)
        assert type(loaded.past_key_values) is DynamicCache and loaded.past_key_values.get_seq_length() == 0
        pool = astrai_hf.get_pool(model)
        with PagedCache(pool, ids, mask, prefix_cache=False) as live:
            live.plan_step(2, ids.shape[1], attention_mask=mask)  # holds rows now
            with pytest.raises(TypeError, match="holding 2 rows"):
                pickle.dumps(live)
            shallow = copy.copy(live)  # a cache of its own sharing the pages, not the rows
            assert shallow.seq_lens == live.seq_lens and shallow._rows is not live._rows
            shallow.release()
        for action in (pickle.dumps, copy.deepcopy, copy.copy):
            with pytest.raises(TypeError, match="PagePool cannot be pickled or copied"):
                action(pool)
        assert pool.stats()["num_used_pages"] == 0


def test_a_deep_copy_of_the_cache_generate_returned_is_released_like_it():
    # passing the copy back (a recipe that looks like stock's) had made it a cache of the caller's, holding its
    # pages after the call
    import copy

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9], seed=1)
    kw = dict(max_new_tokens=4, do_sample=False)
    with astrai_hf.patched(model, max_tokens=256, page_size=4):
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kw)
        more = torch.cat([out.sequences, torch.full((2, 1), 7)], 1)
        mask2 = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        copied = copy.deepcopy(out.past_key_values)
        again = model.generate(more, attention_mask=mask2, past_key_values=copied, **kw)
        assert astrai_hf.get_pool(model).stats()["num_used_pages"] == 0  # with the copy still alive
    assert torch.equal(again, model.generate(more, attention_mask=mask2, **kw))


def test_crop_refuses_a_non_int_and_leaves_the_cache_as_it_was():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 3])
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    cache = PagedCache(pool, ids, mask)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    with pytest.raises(TypeError, match=r"crop\(max_length\) must be an int, got -1.5"):
        cache.crop(-1.5)
    assert cache.logical_len == 5 and cache.seq_lens == [5, 3]
    cache.reorder_cache(torch.tensor([0, 1, 1]))
    cache.release()
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


@torch.no_grad()
def test_a_crop_of_left_padded_rows_frees_and_forgets_what_each_row_dropped():
    # each row drops the tokens past its own length after the crop (its padding counted out): its dropped columns
    # point at the trash slot again, so a freed page, whatever another sequence wrote there, is never read; and the
    # release offers the prefix cache only the tokens computed after the crop
    from transformers import DynamicCache

    model = tiny_model("llama")
    long, short = [5, 17, 33, 8, 41, 9, 60, 12], [44, 21, 13, 50, 6]
    ids = torch.tensor([long, [0] * 3 + short])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    mask2 = torch.cat([mask[:, :5], torch.ones(2, 2, dtype=mask.dtype)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # generate()'s

    def run(cache, garbage=lambda: None):
        kw = {_kw(model): cache, "use_cache": True}
        model(ids, attention_mask=mask, position_ids=positions, **kw)
        cache.crop(-3)  # row 0 back to long[:5], row 1 to short[:2]
        garbage()
        # (two tokens a row: a step that reads each row's table up to the longest row, where a decode step on a
        # CPU reads only a row's own slots)
        return model(torch.tensor([[70, 72], [71, 73]]), attention_mask=mask2,
                     position_ids=torch.tensor([[5, 6], [2, 3]]), **kw).logits

    want = run(DynamicCache())
    later = torch.tensor([short[:2] + [71, 73] + short[4:] + [22, 23]])  # short's ids, but 71, 73 at columns 2, 3
    stock = model.generate(later, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    ps = pool.page_size

    def fill_free_pages_with_nan():  # as another sequence's overflowed K/V would leave them
        for p in pool.allocator.free_pages():
            for t in pool.storage.k + pool.storage.v:
                t[p * ps : (p + 1) * ps] = float("nan")

    with astrai_hf.patched(model, pool=pool):
        with PagedCache(pool) as cache:
            got = run(cache, fill_free_pages_with_nan)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        later_out = model.generate(later, max_new_tokens=4, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True)
    assert pool.stats()["prefix_hit_tokens"] == 4  # short[:2], 71 and 73: not short[4], computed before the crop
    assert torch.equal(later_out.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(later_out.scores), torch.stack(stock.scores), rtol=1e-4, atol=1e-4)
    assert pool.stats()["num_used_pages"] == 0


def test_activate_past_recording_takes_the_keywords_candidate_decoding_passes():
    # transformers 5.25's assisted and prompt-lookup decoding pass recurrent_states_to_keep= (for layers of
    # fixed-size state), and a patched call had raised TypeError there; the pool keeps every token until crop()
    model = tiny_model("llama")
    with PagedCache(PagePool.from_model(model, max_tokens=64, page_size=PAGE)) as cache:
        cache.activate_past_recording()
        cache.activate_past_recording(recurrent_states_to_keep=3)
        assert cache.get_seq_length() == 0


def _k(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("k, v, layer, error, text", [
    (_k(2, 3, 16), _k(2, 3, 16), 0, ValueError, r"key_states must be \[batch, num_kv_heads, q_len, head_dim\], "
                                                r"got shape \(2, 3, 16\)"),
    (_k(2, 2, 3, 16), _k(2, 2, 4, 16), 0, ValueError, r"key_states \(2, 2, 3, 16\) and value_states "
                                                      r"\(2, 2, 4, 16\) must have the same shape"),
    (_k(2, 2, 3, 16), _k(2, 2, 3, 16), "0", TypeError, "layer_idx must be an int, got '0'"),
    (_k(2, 2, 3, 16), _k(2, 2, 3, 16), True, TypeError, "layer_idx must be an int, got True"),
    ([1.0], _k(2, 2, 3, 16), 0, TypeError, "key_states must be a torch.Tensor, got list"),
    (_k(2, 2, 3, 16, dtype=torch.int64), _k(2, 2, 3, 16, dtype=torch.int64), 0, TypeError,
     r"K in torch.int64 and V in torch.int64; K/V must be floating point \(the pool stores torch.float32\)"),
])
def test_update_names_what_it_cannot_store(llama, k, v, layer, error, text):
    # each had failed deep inside (an unpacking, a reshape, a comparison), or been told to build an int64 pool
    pool = PagePool.from_model(llama, max_tokens=64, page_size=PAGE)
    cache = PagedCache(pool, prefix_cache=False)
    with pytest.raises(error, match=text):
        cache.update(k, v, layer)
    cache.release()
    assert pool.stats()["num_used_pages"] == 0
    if layer == 0 and isinstance(k, torch.Tensor) and k.dim() == 4 and k.is_floating_point():
        cache = PagedCache(pool, prefix_cache=False)
        for index in (np.int64(0), torch.tensor(1)):  # (integer scalars of numpy and torch are ints)
            cache.update(k, k, index)
        assert cache.get_seq_length() == 3
        cache.release()


@torch.no_grad()
def test_a_crop_to_a_page_boundary_then_rows_of_shared_pages_each_keep_their_own_next_token():
    # a crop that kept the page after the boundary made the next token land in a page the rows still shared
    # (copy-on-write looks at a partly filled last page only): the last row's K/V overwrote the others'
    from transformers import DynamicCache

    model = tiny_model("llama")
    prompt = torch.tensor([[5, 17, 33, 8, 41, 9, 60, 12]])  # two full pages of 4
    following = torch.tensor([[70], [71]])

    def run(cache):
        model(prompt, **{_kw(model): cache}, use_cache=True)
        cache.batch_repeat_interleave(2)  # two rows sharing the prompt's pages
        cache.crop(-4)  # back to one full page
        return model(following, **{_kw(model): cache}, use_cache=True, position_ids=torch.tensor([[4], [4]])).logits

    want = run(DynamicCache())
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    with PagedCache(pool) as cache:
        got = run(cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert pool.stats()["num_used_pages"] == 0


@torch.no_grad()
def test_a_crop_in_a_loop_of_ones_own_leaves_no_dropped_token_for_the_prefix_cache():
    # a crop that left the count of tokens whose K/V the cache holds at its old length made the release index the
    # dropped tokens' ids and K/V (computed with the old context) as a prefix; a later prompt of those ids reused them
    model = tiny_model("llama")
    first = [5, 17, 33, 8, 41, 9, 60, 12]
    later = torch.tensor([first[:5] + [70] + first[6:] + [22, 23]])  # first's ids, but 70 at column 5
    want = model.generate(later, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    pool = PagePool.from_model(model, max_tokens=512, page_size=4)
    with astrai_hf.patched(model, pool=pool):
        with PagedCache(pool) as cache:
            model(torch.tensor([first]), **{_kw(model): cache}, use_cache=True)
            cache.crop(-3)  # first[5:] dropped (rejected drafts)
            model(torch.tensor([[70]]), **{_kw(model): cache}, use_cache=True, position_ids=torch.tensor([[5]]))
        got = model.generate(later, max_new_tokens=4, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    assert pool.stats()["prefix_hit_tokens"] == 6  # the six tokens computed after the crop (first[:5], 70)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-4, atol=1e-4)
    assert pool.stats()["num_used_pages"] == 0
