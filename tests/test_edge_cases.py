"""Inputs from the field's bug reports that once broke the promise (same tokens as stock, clear errors, no stale
K/V): generate() with no length, candidate generation after a prefix hit, two models on one pool, weights changed in
place, several threads, outputs of every position, and masks generate() cannot serve left-padded."""

import contextlib
import copy
import gc
import re
import threading

import pytest
import torch

import astrai_hf
from astrai_hf import PagePool
from tiny_models import VOCAB, left_padded_batch, tiny_model

pytestmark = pytest.mark.equivalence


def _used(model):
    return astrai_hf.get_pool(model).stats()["num_used_pages"]


def test_generate_with_no_length_argument():
    model = tiny_model("llama")
    model.generation_config.max_length = model.generation_config.max_new_tokens = None
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    ref = model.generate(input_ids=ids, do_sample=False)
    with astrai_hf.patched(model):
        assert torch.equal(model.generate(input_ids=ids, do_sample=False), ref)
        assert _used(model) == 0


@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_transformers_chunked_prefill_after_a_prefix_hit(chunk):
    # generate(prefill_chunk_size=...): before 5.24 transformers feeds the prompt's chunks from its first column
    # whatever the cache holds, so a prefix hit would be stored twice; there the call skips the prefix cache
    from astrai_hf.patch import _chunked_prefill_resumes

    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 7], seed=12)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, prefill_chunk_size=chunk)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, page_size=4):
        pool = astrai_hf.get_pool(model)
        for _ in range(3):
            assert torch.equal(model.generate(ids, **kw), ref)
            assert _used(model) == 0
        assert (pool.stats()["prefix_hit_tokens"] > 0) == _chunked_prefill_resumes()
        cache = astrai_hf.PagedCache(pool, ids, mask)  # a cache of the caller's, pre-filled from the prefix cache
        assert torch.equal(model.generate(ids, **kw, **{astrai_hf.cache_kwarg(model): cache}), ref)
        cache.release()
        assert _used(model) == 0


def test_transformers_chunked_prefill_after_a_prefix_hit_shorter_than_a_rows_padding():
    # a chunk that ends inside a row's left padding: the row's padding as that chunk's mask shows it is cut at the
    # chunk's end, and the check against the prompt's padding cuts it there too (it had raised a ValueError)
    from tiny_models import PAD

    model = tiny_model("llama")
    long, short = list(range(10, 22)), [40, 41, 42]
    ids = torch.tensor([long, [PAD] * 9 + short])
    mask = (ids != PAD).long()
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, prefill_chunk_size=2)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, page_size=4):
        warm = torch.tensor([long[:2] + [70, 71, 72]])  # shares the long row's first 2 tokens
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=1, do_sample=False)
        assert torch.equal(model.generate(ids, **kw), ref)
        assert _used(model) == 0


@pytest.mark.parametrize("chunk", [3, 8])
def test_transformers_chunked_prefill_given_a_cache_back_gives_a_fresh_calls_tokens(chunk):
    # before 5.24 stock's chunked prefill feeds the whole prompt again on top of the cache passed back (its cache
    # then holds the first turn twice); a patched call stores each token once, and gives a fresh call's tokens
    stock, model = tiny_model("llama"), tiny_model("llama")
    ids, mask = left_padded_batch([11, 6], seed=2)
    kw = dict(max_new_tokens=4, do_sample=False, prefill_chunk_size=chunk)
    with astrai_hf.patched(model, page_size=4):
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kw)
        cache = out[astrai_hf.cache_kwarg(model)]
        turn = torch.cat([out.sequences, torch.tensor([[5, 6, 7, 8, 9]] * 2)], 1)
        mask = torch.cat([mask, torch.ones(2, 4 + 5, dtype=mask.dtype)], 1)
        fresh = stock.generate(turn, attention_mask=mask, **kw)
        assert torch.equal(model.generate(turn, attention_mask=mask, **kw, **{astrai_hf.cache_kwarg(model): cache}),
                           fresh)
        assert cache.get_seq_length() == turn.shape[1] + 4 - 1
        del out, cache
        assert _used(model) == 0


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_transformers_chunked_prefill_of_chunks_that_are_only_padding(chunk):
    # rows of a padded batch taken apart (ids[1:]) keep its width: the first chunks hold no real token, and the
    # packed prefill of such a chunk had raised "range() arg 3 must not be zero"
    model = tiny_model("llama")
    ids, mask = left_padded_batch([9, 4, 3], seed=13)
    ids, mask = ids[1:], mask[1:]
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, prefill_chunk_size=chunk)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, page_size=4):
        for _ in range(2):  # (the second call from the prefix cache)
            assert torch.equal(model.generate(ids, **kw), ref)
            assert _used(model) == 0


@pytest.mark.parametrize("candidates", ["prompt_lookup", "assistant_model"])
def test_candidate_generation_after_a_prefix_hit(candidates):
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    extra = {"prompt_lookup": dict(prompt_lookup_num_tokens=2),
             "assistant_model": dict(assistant_model=tiny_model("llama", seed=1))}[candidates]
    kw = dict(do_sample=False, max_new_tokens=12, **extra)
    ref = model.generate(x, **kw)
    with astrai_hf.patched(model, page_size=4):
        model.generate(x[:, :5], do_sample=False, max_new_tokens=1)  # caches a prefix of the prompt
        model.generate(x, do_sample=False, max_new_tokens=12)  # and the whole prompt
        for _ in range(3):
            assert torch.equal(model.generate(x, **kw), ref)
        assert torch.equal(model.generate(x, do_sample=False, max_new_tokens=12),
                           model.generate(x, do_sample=False, max_new_tokens=12))
        assert _used(model) == 0


@pytest.mark.parametrize("other", ["other weights", "one embedding row changed", "values moved within a run"])
def test_two_models_on_one_pool_never_share_kv(other):
    import copy

    a = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch([7, 12], seed=2)
    if other == "other weights":
        b = tiny_model("llama", seed=1)
    elif other == "values moved within a run":
        # the same values in other places, within one run of the weights digest (4 rows of 64 float32 words):
        # a digest that only summed the words would not see it
        b = copy.deepcopy(a)
        with torch.no_grad():
            for layer in b.model.layers:
                layer.self_attn.v_proj.weight[:4] = layer.self_attn.v_proj.weight[:4].flip(0).clone()
    else:  # a copy with one token's embedding set anew (a new special token, say), and that token in the prompts
        b = copy.deepcopy(a)
        ids[:, -5] = 90
        with torch.no_grad():
            b.get_input_embeddings().weight[90].normal_(generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=8)
    ref_a, ref_b = a.generate(ids, **kw), b.generate(ids, **kw)
    assert not torch.equal(ref_a, ref_b)
    pool = PagePool.from_model(a, max_tokens=1024, page_size=4)
    astrai_hf.patch(a, pool=pool)
    astrai_hf.patch(b, pool=pool)
    try:
        for _ in range(2):
            assert torch.equal(a.generate(ids, **kw), ref_a)
            assert torch.equal(b.generate(ids, **kw), ref_b)
    finally:
        astrai_hf.unpatch(a)
        astrai_hf.unpatch(b)
    assert pool.stats()["num_used_pages"] == 0


def test_clear_prefix_cache_after_writes_into_param_data_takes_the_digests_again():
    # writes into .data bypass every check; the README says to clear the prefix cache after them. Two twins share
    # the pool: after the clear, the edited twin's K/V must not pass for the other's
    import copy

    a = tiny_model("llama")
    b = copy.deepcopy(a)
    ids, mask = left_padded_batch([9, 14], seed=4)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=6)
    pool = PagePool.from_model(a, max_tokens=1024, page_size=4)
    astrai_hf.patch(a, pool=pool)
    astrai_hf.patch(b, pool=pool)
    try:
        a.generate(ids, **kw)
        b.generate(ids, **kw)
        with torch.no_grad():
            for p in a.parameters():
                p.data.mul_(1.5)
        pool.clear_prefix_cache()
        out_a = a.generate(ids, **kw)
        out_b = b.generate(ids, **kw)
    finally:
        astrai_hf.unpatch(a)
        astrai_hf.unpatch(b)
    assert torch.equal(out_a, a.generate(ids, **kw)) and torch.equal(out_b, b.generate(ids, **kw))
    assert pool.stats()["num_used_pages"] == 0


def test_weights_changed_in_place_drop_the_prefix_cache():
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    kw = dict(do_sample=False, max_new_tokens=8)
    astrai_hf.patch(model, page_size=4)
    try:
        model.generate(x, **kw)
        assert astrai_hf.get_pool(model).stats()["num_cached_pages"] > 0
        with torch.no_grad():  # an optimizer step
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        out = model.generate(x, **kw)
        hits = astrai_hf.get_pool(model).stats()["prefix_hit_tokens"]
    finally:
        astrai_hf.unpatch(model)
    assert torch.equal(out, model.generate(x, **kw))
    assert hits == 0


@pytest.mark.parametrize("optimizer", ["AdamW(fused=True)", "SGD(fused=True)", "AdamW(foreach=True)", "Adagrad"])
def test_an_optimizer_step_drops_the_prefix_cache(optimizer):
    # fused optimizers write the parameters without bumping their version counters (transformers' Trainer picks
    # adamw_torch_fused by default): the prompt had been served K/V of the weights before the step
    import warnings

    make = {"AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
            "SGD(fused=True)": lambda ps: torch.optim.SGD(ps, lr=0.5, fused=True),
            "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
            "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.5)}[optimizer]
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 20], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    astrai_hf.patch(model, max_tokens=1024)
    pool = astrai_hf.get_pool(model)
    model.generate(ids, **kw)  # fills the prefix cache
    x, x_mask = left_padded_batch([10, 10], seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = make(list(model.parameters()))
    model(input_ids=x, attention_mask=x_mask, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    before = pool.stats()["prefix_hit_tokens"]
    out = model.generate(ids, **kw)
    assert pool.stats()["prefix_hit_tokens"] == before  # nothing served from the weights before the step
    assert torch.equal(out, astrai_hf.unpatch(model).generate(ids, **kw))
    assert pool.stats()["num_used_pages"] == 0


def test_an_optimizer_step_without_gradients_keeps_the_prefix_cache():
    # torch's optimizers leave a parameter without a gradient unchanged: nothing to drop
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 20], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with astrai_hf.patched(model, max_tokens=1024):
        pool = astrai_hf.get_pool(model)
        model.generate(ids, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt.step()  # no backward: every grad is None
        before = pool.stats()["prefix_hit_tokens"]
        model.generate(ids, **kw)
        assert pool.stats()["prefix_hit_tokens"] > before


def test_generate_from_several_threads():
    model = tiny_model("llama")
    batches = [left_padded_batch([5 + i, 9, 3 + i], seed=i) for i in range(4)]
    kw = dict(do_sample=False, max_new_tokens=20)
    refs = [model.generate(ids, attention_mask=mask, **kw) for ids, mask in batches]
    implementation = model.config._attn_implementation
    astrai_hf.patch(model, max_tokens=4096, page_size=4)
    results = [None] * 4

    def work(i):
        try:
            results[i] = model.generate(batches[i][0], attention_mask=batches[i][1], **kw)
        except Exception as e:  # recorded, checked below
            results[i] = e

    try:
        for _ in range(2):
            threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(isinstance(r, torch.Tensor) and torch.equal(r, ref) for r, ref in zip(results, refs)), results
            assert _used(model) == 0
    finally:
        astrai_hf.unpatch(model)
    assert model.config._attn_implementation == implementation
    assert torch.equal(model.generate(batches[0][0], attention_mask=batches[0][1], **kw), refs[0])


@pytest.mark.parametrize("with_pool", [False, True])
def test_patch_of_one_model_from_two_threads_at_once_installs_once(with_pool):
    # both threads found the model unpatched and installed their wrappers, the second over the first: generate()
    # then ran a wrapper inside a wrapper, and unpatch() left the outer one on the model
    ids, mask = left_padded_batch([6, 4], seed=2)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=5)
    for attempt in range(4):
        model = tiny_model("llama", seed=attempt)
        ref = model.generate(ids, **kw)
        pool = PagePool.from_model(model, max_tokens=256, page_size=4) if with_pool else None
        barrier, errors = threading.Barrier(2), []

        def work():
            try:
                barrier.wait()
                astrai_hf.patch(model, pool=pool) if with_pool else astrai_hf.patch(model, max_tokens=256)
            except Exception as e:  # recorded, checked below
                errors.append(e)

        threads = [threading.Thread(target=work, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert torch.equal(model.generate(ids, **kw), ref)
        assert _used(model) == 0
        astrai_hf.unpatch(model)
        assert not astrai_hf.is_patched(model)
        assert not {"forward", "generate", "__deepcopy__", "__reduce_ex__"} & set(model.__dict__)


def test_calls_from_two_threads_while_a_third_swaps_the_pool():
    # a call chose its pool's lock before it held the model's, so one that raced patch()'s pool swap held the old
    # pool's lock and ran on the new one: its forward then waited for the new pool's lock, held by the other call,
    # which waited for the model's lock (a deadlock), or two calls ran on one pool at once
    import sys
    import time

    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 3], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, **kw)
    astrai_hf.patch(model, max_tokens=512)
    results, done = [], threading.Event()

    def generate():
        for _ in range(40):
            try:
                results.append(torch.equal(model.generate(ids, **kw), ref))
            except Exception as e:  # recorded, checked below
                results.append(e)
        done.set()

    def swap():
        for i in range(10**6):
            if done.is_set():
                break
            astrai_hf.patch(model, max_tokens=256 if i % 2 else 512)
            time.sleep(0.001)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often
    threads = [threading.Thread(target=f, daemon=True) for f in (generate, generate, swap)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 90
        for t in threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert results == [True] * 80, [r for r in results if r is not True][:3]
    assert _used(model) == 0
    astrai_hf.unpatch(model)


@pytest.mark.parametrize("b_patched", ["before", "in its thread"])
def test_two_models_on_one_pool_called_from_two_threads_wait_for_each_other(b_patched):
    # the pool's prefix cache belongs to one model at a time: a call of the other model between two steps of a
    # call would clear it under that call. Here b's call starts from a streamer of a's, in the middle of a's call;
    # b patched onto the pool then (a's call had started on a pool of one model) waits too
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([20], seed=3)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=12)
    refs = {"a": a.generate(ids, **kw), "b": b.generate(ids, **kw)}
    astrai_hf.patch(a, max_tokens=1024, page_size=4)
    if b_patched == "before":
        astrai_hf.patch(b, pool=astrai_hf.get_pool(a))
    results = {}

    def call_b():
        try:
            if b_patched != "before":
                astrai_hf.patch(b, pool=astrai_hf.get_pool(a))
            results["b"] = b.generate(ids, **kw)
        except Exception as e:  # recorded, checked below
            results["b"] = e

    class StartsB:
        steps, thread = 0, None

        def put(self, value):
            self.steps += 1
            if self.steps == 4:
                self.thread = threading.Thread(target=call_b)
                self.thread.start()
                self.thread.join(timeout=1.0)  # b waits for a's call to end: it cannot finish meanwhile

        def end(self):
            pass

    try:
        a.generate(ids, **kw)  # a's prompt in the prefix cache: a's next call starts from a hit
        streamer = StartsB()
        results["a"] = a.generate(ids, **kw, streamer=streamer)
        streamer.thread.join()
        for name, out in results.items():
            assert isinstance(out, torch.Tensor) and torch.equal(out, refs[name]), (name, out)
        assert _used(a) == 0
    finally:
        astrai_hf.unpatch(a)
        astrai_hf.unpatch(b)


def test_embeddings_with_input_ids_of_no_columns_give_stocks_tokens():
    # generate() makes ids of no columns itself for a call fed embeddings alone; passed by the caller, they had
    # been taken for the prompt (refused: a mask not of their shape, rows of nothing but the pad token)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([4, 6], seed=1)
    embeds = model.get_input_embeddings()(ids).detach()
    empty = ids[:, :0]
    calls = [((), dict(input_ids=empty, inputs_embeds=embeds, attention_mask=mask)),
             ((empty[:1],), dict(inputs_embeds=embeds[:1]))]
    kw = dict(max_new_tokens=3, do_sample=False)
    want = [model.generate(*args, **call, **kw) for args, call in calls]
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        for (args, call), w in zip(calls, want):
            assert torch.equal(model.generate(*args, **call, **kw), w)
            assert _used(model) == 0
        # ids of another row count: refused, as stock refuses them (it had run on the embeddings)
        with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 6\) does not match input_ids of shape "
                           r"\(1, 0\)"):
            model.generate(empty[:1], inputs_embeds=embeds, attention_mask=mask, **kw)
        assert _used(model) == 0
    with pytest.raises(RuntimeError):
        model.generate(empty[:1], inputs_embeds=embeds, attention_mask=mask, **kw)


def test_capture_graphs_of_another_model_on_the_pool_waits_for_a_call_under_way():
    # capture_graphs(b) binds the pool to b: between two steps of a's call it had cleared the prefix cache under
    # that call (a's prompt and answer were not cached), as a call of b's would have, which waits
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([20], seed=3)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=12)
    want = a.generate(ids, **kw)
    astrai_hf.patch(a, max_tokens=1024, page_size=4, max_reqs=4)
    astrai_hf.patch(b, pool=astrai_hf.get_pool(a), cuda_graphs=True)
    seen = {}

    class CapturesB:
        steps, thread = 0, None

        def put(self, value):
            self.steps += 1
            if self.steps == 4:
                self.thread = threading.Thread(target=lambda: seen.update(captured=astrai_hf.capture_graphs(b)))
                self.thread.start()
                self.thread.join(timeout=3.0)
                seen["waited"] = self.thread.is_alive()  # for a's call to end

        def end(self):
            pass

    try:
        streamer = CapturesB()
        out = a.generate(ids, **kw, streamer=streamer)
        streamer.thread.join()
        assert torch.equal(out, want)
        assert seen["waited"] and seen["captured"] == {4: 0.0, 2: 0.0, 1: 0.0}
        assert _used(a) == 0
    finally:
        astrai_hf.unpatch(a)
        astrai_hf.unpatch(b)


def test_another_model_on_the_pool_called_from_a_streamer_in_the_same_thread_leaves_the_call_intact():
    # the nested call takes the pool over and clears its prefix cache; the outer call, whose cache started from a
    # prefix hit of its own model's, had then refused to go on ("the prefix cache ... has been cleared since")
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([20, 14], seed=3)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=6)
    refs = {"a": a.generate(ids, **kw), "b": b.generate(ids, **kw)}
    results = {}

    class CallsB:
        calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 1:  # generate() puts the prompt before its first forward
                results["b"] = b.generate(ids, **kw)

        def end(self):
            pass

    with astrai_hf.patched(a, max_tokens=1024, page_size=4):
        pool = astrai_hf.get_pool(a)
        with astrai_hf.patched(b, pool=pool):
            a.generate(ids, **kw)  # a's prompt in the prefix cache
            hits = pool.stats()["prefix_hit_tokens"]
            results["a"] = a.generate(ids, **kw, streamer=CallsB())
            assert pool.stats()["prefix_hit_tokens"] > hits
            assert all(torch.equal(results[k], refs[k]) for k in refs)
            assert _used(a) == 0


def test_assisted_decoding_across_two_pools_from_two_threads_does_not_deadlock():
    # A (pool P) assisted by B (pool Q) in one thread, C (pool Q) assisted by D (pool P) in another: calls nest
    # across the pools in both orders
    a, b, c, d = (tiny_model("llama", seed=s) for s in range(4))
    ids, mask = left_padded_batch([6])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    refs = {id(m): m.generate(ids, assistant_model=asst, **kw) for m, asst in ((a, b), (c, d))}
    p = PagePool.from_model(a, max_tokens=1024, page_size=4)
    q = PagePool.from_model(b, max_tokens=1024, page_size=4)
    for model, pool in ((a, p), (d, p), (b, q), (c, q)):
        astrai_hf.patch(model, pool=pool)
    outs = {id(a): [], id(c): []}

    def work(main, assistant):
        for _ in range(4):
            outs[id(main)].append(main.generate(ids, assistant_model=assistant, **kw))

    threads = [threading.Thread(target=work, args=pair, daemon=True) for pair in ((a, b), (c, d))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "deadlocked"
        for key, got in outs.items():
            assert len(got) == 4 and all(torch.equal(o, refs[key]) for o in got)
        assert p.stats()["num_used_pages"] == q.stats()["num_used_pages"] == 0
    finally:
        for model in (a, b, c, d):
            astrai_hf.unpatch(model)


def test_a_patched_generate_from_a_worker_thread_inside_another_models_generate_returns():
    # a reward or moderation model run on a thread pool from a logits processor of another model's generate():
    # models on pools of their own do not wait for each other
    from transformers import LogitsProcessor, LogitsProcessorList

    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids, mask = left_padded_batch([6, 4], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    ref_b = b.generate(ids, **kw)
    seen = []

    class AsksB(LogitsProcessor):
        def __call__(self, input_ids, scores):
            worker = threading.Thread(target=lambda: seen.append(b.generate(ids, **kw)), daemon=True)
            worker.start()
            worker.join(timeout=60)
            assert not worker.is_alive(), "b.generate() from a worker thread never returned"
            return scores

    ref_a = a.generate(ids, **kw)
    astrai_hf.patch(a, max_tokens=512, page_size=4)
    astrai_hf.patch(b, max_tokens=512, page_size=4)
    try:
        out = a.generate(ids, **kw, logits_processor=LogitsProcessorList([AsksB()]))
        assert torch.equal(out, ref_a)
        assert len(seen) == 4 and all(torch.equal(o, ref_b) for o in seen)
    finally:
        astrai_hf.unpatch(a)
        astrai_hf.unpatch(b)


def test_attentions_and_hidden_states_of_every_position():
    model = tiny_model("llama", attn_implementation="eager")
    x = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    kw = dict(do_sample=False, max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True,
              output_attentions=True)
    ref = model.generate(x, **kw)
    with astrai_hf.patched(model, page_size=4):
        model.generate(x, do_sample=False, max_new_tokens=3)  # a cached prefix must not shorten the outputs
        out = model.generate(x, **kw)
        assert _used(model) == 0
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.attentions, ref.attentions):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for got, want in zip(out.hidden_states, ref.hidden_states):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_masks_that_are_not_left_padded_get_clear_errors():
    model = tiny_model("llama")
    with astrai_hf.patched(model):
        with pytest.raises(ValueError, match=r"rows \[1\] have no tokens"):
            model.generate(torch.tensor([[5, 6, 7], [0, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]),
                           max_new_tokens=2)
        assert _used(model) == 0


@pytest.mark.parametrize("rows", [[[0, 0], [0, 0], [10, 11]], [[10, 11, 12], [0, 0, 0], [0, 13, 14]], [[0, 0, 0]]])
def test_a_row_of_only_pad_tokens_without_a_mask_gets_the_error_a_mask_of_zeros_gets(rows):
    # generate() masks every pad token when no mask is passed: such a row has no token, as a row of zeros in a mask
    # passed has, which is refused. It had crashed inside generate() or taken another row's logits
    model = tiny_model("llama")  # pad_token_id 0
    ids = torch.tensor(rows)
    empty = [r for r, row in enumerate(rows) if not any(row)]
    with astrai_hf.patched(model):
        with pytest.raises(ValueError, match=rf"input_ids rows {re.escape(str(empty))} hold only the pad token "
                                             r"\(pad_token_id=0\)"):
            model.generate(ids, max_new_tokens=3, do_sample=False)
        assert _used(model) == 0
        with pytest.raises(ValueError, match=rf"rows {re.escape(str(empty))} "), astrai_hf.PagedCache(
                astrai_hf.get_pool(model)) as cache:
            model.generate(ids, max_new_tokens=3, do_sample=False, **{astrai_hf.cache_kwarg(model): cache})
        assert _used(model) == 0


def test_a_pad_token_inside_a_prompt_without_a_mask_runs_as_stock():
    # generate() masks it (a hole no paged cache holds): the call had been refused, also the assistant's calls in
    # assisted decoding, which transformers makes without a mask after the target emitted the pad token
    model = tiny_model("llama")  # pad_token_id 0
    _generates_as_stock_twice(model, torch.tensor([[5, 6, 0, 7, 8], [9, 0, 0, 4, 3]]), max_new_tokens=4)


def _generates_as_stock_twice(model, ids, **kw):
    """Greedy generate() without a mask: the patched call's tokens and scores equal stock's, twice (the second
    with the prefix cache filled), and no page stays used."""
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        for _ in range(2):
            out = model.generate(ids, **kw)
            assert torch.equal(out.sequences, ref.sequences)
            for a, b in zip(out.scores, ref.scores):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert _used(model) == 0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_an_assistant_after_the_target_emitted_the_pad_token_runs_as_stock(arch):
    # pad_token_id 0, no EOS: the target emits token 0 at its 6th (llama) or 7th (mistral) new token. Mistral with a
    # window of 4: the assistant's next rounds ran on a cache whose sliding-window layers could not be cropped
    target, assistant = ((tiny_model("llama"), tiny_model("llama", seed=3)) if arch == "llama" else
                         (tiny_model("mistral", seed=4, sliding_window=4),
                          tiny_model("mistral", seed=3, sliding_window=4)))
    ids = left_padded_batch([5, 9, 3])[0][1:2]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    ref = target.generate(ids, assistant_model=assistant, **kw)
    assert 0 in ref[0, ids.shape[1]:-1].tolist()
    for patched in ("assistant", "both"):
        with astrai_hf.patched(assistant, max_tokens=2048), (
                astrai_hf.patched(target, max_tokens=2048) if patched == "both" else contextlib.nullcontext()):
            assert torch.equal(target.generate(ids, assistant_model=assistant, **kw), ref)
            assert _used(assistant) == 0


@pytest.mark.parametrize("fed", ["input_ids", "inputs_embeds"])
@pytest.mark.parametrize("hole", ["right padding", "a masked token inside"])
def test_a_mask_with_a_hole_passed_without_a_cache_runs_as_stock(hole, fed):
    # no paged cache holds the hole; stock attention applies it (it had been refused)
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if hole == "right padding":
        mask[1, 4:] = 0
    else:
        mask[0, 2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
              output_scores=True)
    inputs = dict(input_ids=ids) if fed == "input_ids" else dict(
        inputs_embeds=model.get_input_embeddings()(ids).detach())
    ref = model.generate(**inputs, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        out = model.generate(**inputs, **kw)
        assert _used(model) == 0
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drafts", ["an assistant model", "early exit"])
def test_drafts_of_a_prompt_with_a_pad_token_inside_run_as_stock(drafts):
    # transformers hands the drafting generate() the mask input_ids != pad_token_id: a patched assistant had
    # refused it, and under early exit the failure left transformers' lowered config.num_hidden_layers in place
    # (every later call gave other tokens)
    target, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = torch.tensor([[57, 82, 91, 0, 51, 80, 71, 81, 27]])  # pad token 0 inside, no mask
    other = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=8, do_sample=False)
    extra = dict(assistant_model=assistant) if drafts == "an assistant model" else dict(assistant_early_exit=1)
    patched = assistant if drafts == "an assistant model" else target
    ref = target.generate(ids, **extra, **kw)
    later = target.generate(other, attention_mask=torch.ones_like(other), **kw)
    with astrai_hf.patched(patched, max_tokens=1024, page_size=4):
        assert torch.equal(target.generate(ids, **extra, **kw), ref)
        assert target.config.num_hidden_layers == 2
        assert torch.equal(target.generate(other, attention_mask=torch.ones_like(other), **kw), later)
        assert _used(patched) == 0


@pytest.mark.parametrize("shape", ["fewer rows", "more rows", "narrower", "wider"])
def test_a_mask_of_another_shape_than_the_prompt_gets_a_clear_error(shape):
    # stock raises from deep inside (or, for a wider mask, computes over columns no token fills); a mask of one
    # row for two prompts had run as if every row had the first row's padding
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 6], seed=1)
    bad = {"fewer rows": mask[:1], "more rows": torch.cat([mask, mask]), "narrower": mask[:, 1:],
           "wider": torch.cat([torch.ones(2, 2, dtype=mask.dtype), mask], 1)}[shape]
    with astrai_hf.patched(model):
        with pytest.raises(ValueError, match=re.escape(f"attention_mask of shape {tuple(bad.shape)}")):
            model.generate(ids, attention_mask=bad, max_new_tokens=2)
        assert _used(model) == 0
        if shape.endswith("rows"):  # with a cache of the caller's too
            cache = astrai_hf.PagedCache(astrai_hf.get_pool(model))
            with pytest.raises(ValueError, match="rows for input_ids of shape"):
                model.generate(ids, attention_mask=bad, max_new_tokens=2, past_key_values=cache)
            cache.release()
            assert _used(model) == 0
        assert model.generate(ids, attention_mask=mask, max_new_tokens=2).shape == (2, 8)  # a right one still runs


def test_one_row_of_ones_as_the_mask_of_a_batch_is_broadcast_as_in_stock():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    ones = torch.ones(1, 6, dtype=torch.long)
    ref = model.generate(ids, attention_mask=ones, max_new_tokens=3, do_sample=False)
    with astrai_hf.patched(model):
        for _ in range(2):  # the second from the prefix cache
            assert torch.equal(model.generate(ids, attention_mask=ones, max_new_tokens=3, do_sample=False), ref)
        assert _used(model) == 0


@pytest.mark.parametrize("call", ["the same prompt again", "a shorter prompt", "only the new tokens, the whole mask",
                                  "one row of ones as the mask", "row 0 no longer padded"])
def test_a_cache_of_the_callers_fits_the_next_prompt(call):
    # The same cache passed again with the same prompt: stock slices the prompt by a negative count, and a patched
    # generate() had returned other tokens than stock's; the cache is cut back so the call returns what a fresh one
    # gives. Only the new tokens with a mask of the whole sequence (transformers reads them so) and a broadcast row
    # of ones (refused by the mask check for a while) run as stock.
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 8], seed=1)
    if call == "one row of ones as the mask":
        ids, mask = ids[:, 3:], torch.ones(1, 5, dtype=mask.dtype)
    kw = dict(max_new_tokens=4, do_sample=False)
    stock = model.__class__.generate  # (a patched model's own generate() is an instance attribute)
    with astrai_hf.patched(model, max_tokens=1024):
        cache = astrai_hf.PagedCache(astrai_hf.get_pool(model))
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
        assert torch.equal(out, stock(model, ids, attention_mask=mask, **kw)) and cache.get_seq_length() == out.shape[1] - 1
        whole_mask = torch.cat([mask.expand(2, -1), torch.ones(2, 5, dtype=mask.dtype)], 1)
        longer = torch.cat([out, torch.full((2, 1), 7)], 1)
        unpadded = torch.cat([torch.full((1, 3), 11), ids[:1, 3:]], 1)  # row 0's padding columns now hold tokens
        prompt, prompt_mask, expected_ids = {
            "the same prompt again": (ids, mask, ids),
            "row 0 no longer padded": (torch.cat([unpadded, ids[1:]]), torch.ones_like(ids),
                                       torch.cat([unpadded, ids[1:]])),
            "a shorter prompt": (out[:, :6], mask[:, :6], out[:, :6]),
            "only the new tokens, the whole mask": (longer[:, -2:], whole_mask, longer),
            "one row of ones as the mask": (longer, torch.ones(1, longer.shape[1], dtype=mask.dtype), longer),
        }[call]
        got = model.generate(prompt, attention_mask=prompt_mask, past_key_values=cache, **kw)
        expected = stock(model, expected_ids, attention_mask=whole_mask if call.startswith("only") else prompt_mask, **kw)
        assert torch.equal(got, expected[:, -got.shape[1]:])
        cache.release()
        assert _used(model) == 0


def test_a_cache_of_the_callers_given_another_prompt_offers_the_earlier_one_to_the_prefix_cache():
    # a prompt that differs from column 0 on empties the cache (reset): its tokens go to the prefix cache, as a
    # release's do; a crop to no column had dropped them
    model = tiny_model("llama")
    first = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    other = (first + 1) % VOCAB
    kw = dict(max_new_tokens=4, do_sample=False)
    stock = model.__class__.generate(model, first, attention_mask=torch.ones_like(first), **kw)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        pool = astrai_hf.get_pool(model)
        cache = astrai_hf.PagedCache(pool)
        for prompt in (first, other):
            model.generate(prompt, attention_mask=torch.ones_like(prompt), **{astrai_hf.cache_kwarg(model): cache}, **kw)
        cache.release()
        hits = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(model.generate(first, attention_mask=torch.ones_like(first), **kw), stock)
        assert pool.stats()["prefix_hit_tokens"] - hits == 9  # all but the last prompt token
        assert _used(model) == 0


def test_a_one_row_cache_is_shared_by_a_batch_that_starts_with_its_tokens():
    # a shared prompt computed once, then a batch of continuations: stock raises on the row count; the rows share
    # the cache's pages. Continuations that do not start with its tokens had silently decoded from its K/V.
    model = tiny_model("llama")
    prefix = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    tails = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(5))
    batch = torch.cat([prefix.expand(3, -1), tails], 1)
    kw = dict(max_new_tokens=4, do_sample=False)
    with astrai_hf.patched(model, max_tokens=1024):
        cache = astrai_hf.PagedCache(astrai_hf.get_pool(model))
        with torch.no_grad():
            model(input_ids=prefix, past_key_values=cache, use_cache=True)
        got = model.generate(batch, attention_mask=torch.ones_like(batch), past_key_values=cache, **kw)
        assert torch.equal(got, model.__class__.generate(model, batch, attention_mask=torch.ones_like(batch), **kw))
        cache.release()
        cache = astrai_hf.PagedCache(astrai_hf.get_pool(model))
        with torch.no_grad():
            model(input_ids=prefix, past_key_values=cache, use_cache=True)
        other = batch.clone()
        other[1, 2] = (other[1, 2] + 1) % VOCAB
        with pytest.raises(ValueError, match="row 1 differs at column 2"):
            model.generate(other, attention_mask=torch.ones_like(other), past_key_values=cache, **kw)
        cache.release()
        for shared in (prefix.expand(2, -1), prefix[:, :4].expand(2, -1)):  # no longer than the cache: cut back
            cache = astrai_hf.PagedCache(astrai_hf.get_pool(model))
            with torch.no_grad():
                model(input_ids=prefix, past_key_values=cache, use_cache=True)
            got = model.generate(shared, attention_mask=torch.ones_like(shared), past_key_values=cache, **kw)
            assert torch.equal(got, model.__class__.generate(model, shared, attention_mask=torch.ones_like(shared),
                                                             **kw))
            cache.release()
        cache = astrai_hf.PagedCache(astrai_hf.get_pool(model))
        model(input_ids=prefix, past_key_values=cache, use_cache=True)  # recorded by autograd: no token ids kept
        with pytest.raises(ValueError, match=r"did not record the tokens of row\(s\) \[0\]"):
            model.generate(batch, attention_mask=torch.ones_like(batch), past_key_values=cache, **kw)
        cache.release()
        assert _used(model) == 0


@pytest.mark.parametrize("mode", [dict(do_sample=True, num_return_sequences=2), dict(do_sample=False, num_beams=2),
                                  dict(do_sample=False, num_beams=3, num_return_sequences=2)],
                         ids=["two samples", "two beams", "three beams, two returned"])
def test_a_returned_cache_continued_with_samples_or_beams_serves_each_rows_copies(mode):
    # a 2-row cache a greedy call returned, passed to a call whose samples or beams make 2 x n rows: stock raises on
    # the row count (it does not expand the cache); each row's copies share its pages and decode as a call without
    # the cache does
    stock = tiny_model("llama")
    model = copy.deepcopy(stock)
    ids, mask = left_padded_batch([7, 10], seed=1)
    name = astrai_hf.cache_kwarg(model)
    first = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    stock_first = stock.generate(ids, **first)
    tail = torch.tensor([[5], [6]])
    ids2 = torch.cat([stock_first.sequences, tail], 1)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    kw = dict(attention_mask=mask2, max_new_tokens=5, **mode)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.manual_seed(0)
        stock.generate(ids2, **kw, **{name: getattr(stock_first, name)})
    torch.manual_seed(0)
    expected = stock.generate(ids2, **kw)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        out = model.generate(ids, **first)
        assert torch.equal(out.sequences, stock_first.sequences)
        cache = getattr(out, name)
        torch.manual_seed(0)
        got = model.generate(ids2, **kw, **{name: cache})
        assert torch.equal(got, expected)
        del out, cache
        gc.collect()
        assert _used(model) == 0


def test_a_one_row_cache_shared_by_rows_of_embeddings_computes_each_row():
    # rows fed as inputs_embeds carry no ids to compare: they were taken as identical, computed once, and every row
    # after the first decoded from the first row's K/V
    model = tiny_model("llama")
    prefix = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    batch = torch.cat([prefix.expand(3, -1), torch.tensor([[5, 9], [17, 3], [40, 41]])], 1)
    embeds = model.get_input_embeddings()(batch).detach()
    kw = dict(attention_mask=torch.ones_like(batch), max_new_tokens=5, do_sample=False)
    stock = model.generate(inputs_embeds=embeds, **kw)
    name = astrai_hf.cache_kwarg(model)
    with astrai_hf.patched(model, max_tokens=1024, page_size=4):
        with astrai_hf.PagedCache(astrai_hf.get_pool(model), prefix_cache=False) as cache:
            with torch.no_grad():
                model(input_ids=prefix, use_cache=True, **{name: cache})
            assert torch.equal(model.generate(inputs_embeds=embeds, **kw, **{name: cache}), stock)
        assert _used(model) == 0


def test_an_empty_batch_gets_a_clear_error():
    model = tiny_model("llama")
    ids, mask = left_padded_batch([3, 5])
    with astrai_hf.patched(model):
        with pytest.raises(ValueError, match=r"shape \(0, 5\) holds no prompt"):
            model.generate(ids[:0], attention_mask=mask[:0], max_new_tokens=2)
        assert _used(model) == 0
    with pytest.raises(ValueError, match="holds no prompt"):
        astrai_hf.PagedCache(PagePool.from_model(model, max_tokens=64), ids[:0], mask[:0])


@pytest.mark.parametrize("masked", [False, True])
def test_a_prompt_of_no_tokens_gets_a_clear_error(masked):
    # it had been blamed on the pad token (a pad token id of None named) or on the mask's rows
    model = tiny_model("llama")
    model.generation_config.pad_token_id = None
    ids = torch.zeros(2, 0, dtype=torch.long)
    kw = dict(attention_mask=torch.zeros(2, 0, dtype=torch.long)) if masked else {}
    with astrai_hf.patched(model):
        with pytest.raises(ValueError, match=r"input_ids of shape \(2, 0\) holds no prompt; pass at least one token"):
            model.generate(ids, max_new_tokens=2, **kw)
        assert _used(model) == 0
    with pytest.raises(ValueError, match=r"shape \(2, 0\) holds no prompt"):
        astrai_hf.PagedCache(PagePool.from_model(model, max_tokens=64), ids, kw.get("attention_mask"))


def test_candidates_past_max_seq_len_get_an_error_that_says_why():
    """Prompt lookup verifies candidate tokens past the generation length; a pool with no room for them refuses
    with an error that says so, and nothing is leaked."""
    model = tiny_model("llama")
    ids = torch.randint(3, 50, (1, 40), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4, max_seq_len=124)
    with astrai_hf.patched(model, pool=pool):
        with pytest.raises(ValueError, match="max_seq_len=124; prompt lookup and assisted decoding store candidate"):
            model.generate(ids, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=5)
        assert _used(model) == 0


def test_a_cache_released_after_the_pool_changed_models_caches_nothing():
    """A live cache holding model A's K/V, released after model B took the shared pool (which cleared the prefix
    cache), must not leave A's K/V for B's prompts."""
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    pool = PagePool.from_model(a, max_tokens=256, page_size=4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    greedy = dict(max_new_tokens=6, do_sample=False)
    ref = b.generate(ids, **greedy)
    astrai_hf.patch(a, pool=pool)
    astrai_hf.patch(b, pool=pool)
    try:
        held = astrai_hf.PagedCache(pool, ids)
        a.generate(ids, **greedy, **{astrai_hf.cache_kwarg(a): held})
        b.generate(torch.tensor([[3, 4, 5]]), **greedy)  # the pool now holds B's K/V
        held.release()
        before = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(b.generate(ids, **greedy), ref)
        assert pool.stats()["prefix_hit_tokens"] == before
        assert _used(b) == 0
    finally:
        astrai_hf.unpatch(a)
        astrai_hf.unpatch(b)


@pytest.mark.parametrize("custom", ["inputs_embeds", "position_ids"])
def test_kv_from_embeddings_or_custom_positions_never_reach_the_prefix_cache(custom):
    model = tiny_model("qwen3")
    ids, mask = left_padded_batch([12], seed={"inputs_embeds": 1, "position_ids": 3}[custom])
    extra = {"inputs_embeds": lambda: model.get_input_embeddings()(ids).detach() * 1.5,  # e.g. soft prompts
             "position_ids": lambda: torch.arange(12)[None] + 100}[custom]()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    # (positions shifted by a constant give stock's tokens, RoPE being relative, but K/V rotated by that shift)
    ref, ref_custom = model.generate(ids, **kw), model.generate(ids, **{custom: extra}, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        assert torch.equal(model.generate(ids, **{custom: extra}, **kw), ref_custom)
        assert torch.equal(model.generate(ids, **kw), ref)  # the same ids: must not reuse the K/V above
        assert torch.equal(model.generate(ids, **{custom: extra}, **kw), ref_custom)  # nor hand these its own
        assert _used(model) == 0


def test_the_positions_generate_computes_passed_by_hand_reach_the_prefix_cache():
    # (the positions transformers hands an assistant model's drafts: taken for positions of the caller's own)
    model = tiny_model("llama")
    ids, mask = left_padded_batch([12, 7], seed=3)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kw = dict(attention_mask=mask, position_ids=positions, max_new_tokens=6, do_sample=False)
    ref = model.generate(ids, **kw)
    with astrai_hf.patched(model, max_tokens=512, page_size=4):
        pool = astrai_hf.get_pool(model)
        assert torch.equal(model.generate(ids, **kw), ref)
        hits = pool.stats()["prefix_hit_tokens"]
        assert torch.equal(model.generate(ids, **kw), ref)
        assert pool.stats()["prefix_hit_tokens"] - hits == 11 + 6  # all but each row's last prompt token
        assert _used(model) == 0


def test_an_assistant_model_computes_each_rounds_new_tokens_only(monkeypatch):
    # each round of assisted decoding hands the drafting model the sequence so far, the cache it returned last
    # round and the target's positions: those kept every round out of the prefix cache, and the patched assistant
    # computed the whole sequence again at each round
    target = tiny_model("llama", max_position_embeddings=1024)
    assistant = tiny_model("llama", seed=3, max_position_embeddings=1024)
    for m in (target, assistant):
        m.generation_config.pad_token_id = m.config.pad_token_id = VOCAB - 1  # (one these models do not emit here)
    x = torch.randint(3, VOCAB - 8, (1, 120), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30, assistant_model=assistant)
    computed = []
    embed = torch.nn.Embedding.forward

    def counting(self, input_ids):
        if self is assistant.get_input_embeddings():
            computed.append(input_ids.shape[-1])
        return embed(self, input_ids)

    monkeypatch.setattr(torch.nn.Embedding, "forward", counting)
    ref = target.generate(x, **kw)
    stock = sum(computed)
    computed.clear()
    with astrai_hf.patched(assistant, max_tokens=1024, page_size=4):
        assert torch.equal(target.generate(x, **kw), ref)
        assert _used(assistant) == 0
    assert len(computed) > 3 and computed[0] == 120 and sum(computed) <= stock, computed


def test_a_pad_token_that_starts_a_prompt_without_a_mask_is_padding_as_in_stock():
    from tiny_models import BOS

    model = tiny_model("llama")
    model.generation_config.pad_token_id = BOS  # pad == bos: generate() masks the leading bos
    x = torch.tensor([[BOS, 11, 12, 13, 14, 15, 16, 17]])
    kw = dict(max_new_tokens=5, do_sample=False)
    ref_ones, ref = model.generate(x, attention_mask=torch.ones_like(x), **kw), model.generate(x, **kw)
    with astrai_hf.patched(model, max_tokens=256, page_size=4):
        for _ in range(2):
            assert torch.equal(model.generate(x, attention_mask=torch.ones_like(x), **kw), ref_ones)
            assert torch.equal(model.generate(x, **kw), ref)
        assert _used(model) == 0


@pytest.mark.parametrize("rows", [[[2, 11, 12, 13, 14, 15]], [[11, 12, 2, 14, 15]], [[2, 2, 2]],
                                  [[2, 11, 12, 2, 14, 15], [2, 2, 2, 2, 2, 2]]],
                         ids=["leading", "inside", "only", "batch"])
def test_a_pad_token_that_is_also_eos_is_attended_without_a_mask_as_in_stock(rows):
    # GPT-2-style tokenizers set pad = eos: generate() then cannot tell padding from tokens and masks none of them
    # (a leading one was taken as left padding, a row of nothing else was refused)
    from tiny_models import EOS

    assert EOS == 2
    model = tiny_model("llama")
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = EOS
    _generates_as_stock_twice(model, torch.tensor(rows), max_new_tokens=5, min_new_tokens=5)


def test_a_mask_row_of_zeros_is_refused_with_a_cache_of_the_callers_too():
    # refused as a call without a cache of its own refuses it; it had crashed inside generate() (the forward
    # returned a row fewer), and PagedCache took the row as empty
    model = tiny_model("llama")
    ids, mask = torch.tensor([[0, 0, 5], [6, 7, 8]]), torch.tensor([[0, 0, 0], [1, 1, 1]])
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    with pytest.raises(ValueError, match=r"attention_mask rows \[0\] have no tokens"):
        astrai_hf.PagedCache(pool, ids, mask)
    with astrai_hf.patched(model, pool=pool):
        with astrai_hf.PagedCache(pool) as cache:
            with pytest.raises(ValueError, match=r"attention_mask rows \[0\] have no tokens"):
                model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               **{astrai_hf.cache_kwarg(model): cache})
        assert _used(model) == 0
    assert pool.stats()["num_used_pages"] == 0
