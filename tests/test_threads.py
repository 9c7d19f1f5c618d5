"""One pool from several threads, and caches that are garbage but not yet collected.

Stock transformers runs separate caches from separate threads; caches of one pool do the same here, their
bookkeeping (pages, request rows, prefix cache) taking turns. A cache nobody can reach but a reference cycle keeps
gives its pages and rows back when an allocation would otherwise fail.
"""

import gc
import threading
import time

import pytest
import torch
from transformers import DynamicCache

import astrai_hf
from astrai_hf import CacheFullError, PagedCache, PagePool
from tiny_models import left_padded_batch, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _two_steps(model, ids, mask, cache):
    """A prefill (of the columns a cache pre-filled from the prefix cache lacks) and one decode step of the
    caller's own: the logits of both, [B, V] each."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    start = cache.get_seq_length()
    with torch.no_grad():
        first = model(ids[:, start:], attention_mask=mask, position_ids=pos[:, start:],
                      past_key_values=cache).logits[:, -1]
        nxt = first.argmax(-1, keepdim=True)
        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
        second = model(nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, past_key_values=cache).logits[:, -1]
    return first, second


class _Overlap:
    """Wraps the methods that change a pool's books, and records how many threads were inside one at once (a
    short sleep inside widens the window in which another thread could enter)."""

    def __init__(self, pool):
        self.inside, self.most, self._lock = 0, 0, threading.Lock()
        for owner, names in ((pool.allocator, ("alloc", "alloc_runs", "incref", "decref")),
                             (pool.req_to_token, ("alloc", "free"))):
            for name in names:
                setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            with self._lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                time.sleep(0.0005)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.inside -= 1
        return wrapped


def _run_threads(work, n: int) -> list[BaseException]:
    errors = []

    def run():
        try:
            work()
        except BaseException as e:  # (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("page_size", [1, 4])
def test_caches_of_one_pool_in_several_threads_match_dynamic_cache(llama, page_size):
    # An unpatched model's caches planned their steps without a lock: two threads took the same pages (wrong
    # logits), freed pages twice ("page 1 is freed twice"), and left pages counted as used after every release.
    pool = PagePool.from_model(llama, max_tokens=1024, page_size=page_size)
    ids, mask = left_padded_batch([13, 9], seed=0)
    ref = _two_steps(llama, ids, mask, DynamicCache())
    overlap = _Overlap(pool)
    wrong = []

    def work():
        for _ in range(6):
            with PagedCache(pool, ids, mask) as cache:  # (pre-filled from the prefix cache after the first)
                got = _two_steps(llama, ids, mask, cache)
            if not all(torch.allclose(g, r, atol=1e-5) for g, r in zip(got, ref)):
                wrong.append(got)

    errors = _run_threads(work, 3)
    assert not errors and not wrong
    assert overlap.most == 1, "two threads changed the pool's books at once"
    s = pool.stats()
    assert s["num_used_pages"] == 0 and s["num_reqs_used"] == 0
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]
    assert len(pool.allocator.free_pages()) == s["num_free_pages"]


def test_patched_generate_in_threads_beside_unpatched_caches(llama):
    # a patched model's calls take turns on the pool; caches of the caller's own loop in other threads go between
    ids, mask = left_padded_batch([11, 7], seed=1)
    stock = llama.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    ref = _two_steps(llama, ids, mask, DynamicCache())
    pool = PagePool.from_model(llama, max_tokens=1024, page_size=2)
    results = []
    with astrai_hf.patched(llama, pool=pool):
        def generate():
            for _ in range(3):
                results.append(torch.equal(
                    llama.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), stock))

        def own_loop():
            for _ in range(3):
                with PagedCache(pool, ids, mask) as cache:
                    got = _two_steps(llama, ids, mask, cache)
                results.append(all(torch.allclose(g, r, atol=1e-5) for g, r in zip(got, ref)))

        errors = _run_threads(lambda: (generate(), own_loop()), 2)
    assert not errors and results and all(results)
    assert pool.stats()["num_used_pages"] == 0 and pool.stats()["num_reqs_used"] == 0


def _garbage_cache(pool, ids, mask, prefill_with=None):
    """Build a cache, optionally prefill it, and leave it unreachable but in a reference cycle (an exception kept
    in a local: exception -> traceback -> frame -> exception)."""
    cache = PagedCache(pool, ids, mask)
    if prefill_with is not None:
        _two_steps(prefill_with, ids, mask, cache)
    try:
        raise RuntimeError("the caller's code failed")
    except RuntimeError as e:
        kept = e  # noqa: F841
    return None


@pytest.fixture
def no_automatic_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_request_rows_of_garbage_caches_are_collected_before_cache_full(llama, no_automatic_gc):
    ids, mask = left_padded_batch([12, 9], seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    stock = llama.generate(ids, **kw)
    pool = PagePool.from_model(llama, max_tokens=1024, page_size=4, max_reqs=8)
    with astrai_hf.patched(llama, pool=pool):
        assert torch.equal(llama.generate(ids, **kw), stock)  # fills the prefix cache
        for _ in range(4):  # 4 garbage caches, each pre-filled from the prefix cache: 2 rows each, all 8 held
            _garbage_cache(pool, ids, mask)
        assert pool.stats()["num_reqs_used"] == 8
        assert torch.equal(llama.generate(ids, **kw), stock)  # had raised CacheFullError: 0 free request rows
        assert pool.stats()["num_reqs_used"] == 0 and pool.stats()["num_used_pages"] == 0
    # a caller's own cache, and a copy of one, find the rows too
    ref = _two_steps(llama, ids, mask, DynamicCache())
    for _ in range(4):
        _garbage_cache(pool, ids, mask)
    with PagedCache(pool, ids, mask) as cache:  # pre-filled: takes 2 rows
        for _ in range(3):
            _garbage_cache(pool, ids, mask)
        assert pool.stats()["num_reqs_used"] == 8
        twin = cache.__deepcopy__({})  # 2 more rows
        for c in (cache, twin):
            assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(_two_steps(llama, ids, mask, c), ref))
        twin.release()
    assert pool.stats()["num_reqs_used"] == 0 and pool.stats()["num_used_pages"] == 0


def test_request_rows_of_garbage_caches_are_collected_when_one_row_is_short(llama, no_automatic_gc):
    ids, mask = left_padded_batch([7, 5], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    stock = llama.generate(ids, **kw)
    pool = PagePool.from_model(llama, max_tokens=256, page_size=4, max_reqs=3)
    for _ in range(2):  # 2 rows held: 1 free, 2 wanted
        _garbage_cache(pool, ids[:1], mask[:1], prefill_with=llama)
    assert pool.stats()["num_reqs_used"] == 2
    with astrai_hf.patched(llama, pool=pool):
        assert torch.equal(llama.generate(ids, **kw), stock)  # had raised CacheFullError: 1 free request row
    assert pool.stats()["num_reqs_used"] == 0 and pool.stats()["num_used_pages"] == 0


def test_pages_of_garbage_caches_are_collected_before_cache_full(llama, no_automatic_gc):
    # caches of the caller's own loop that hold pages (no prefix cache to give them to): a later call needs them
    ids, mask = left_padded_batch([30, 25], seed=2)
    pool = PagePool.from_model(llama, max_tokens=160, page_size=8, prefix_cache=False)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    stock = llama.generate(ids, **kw)
    for _ in range(2):
        _garbage_cache(pool, ids, mask, prefill_with=llama)
    held = pool.stats()["num_used_pages"]
    assert held > pool.stats()["num_pages"] - 10  # a 2-row call of 36 tokens needs 10 pages
    with astrai_hf.patched(llama, pool=pool):
        assert torch.equal(llama.generate(ids, **kw), stock)
    assert pool.stats()["num_used_pages"] == 0
    # nothing to collect: the error still names the numbers
    with PagedCache(pool, ids, mask) as kept, PagedCache(pool, ids, mask) as also_kept:
        _two_steps(llama, ids, mask, kept)
        _two_steps(llama, ids, mask, also_kept)
        with PagedCache(pool, ids, mask) as third:
            with pytest.raises(CacheFullError, match=r"needed \d+ pages, \d+ free, 0 evictable"):
                _two_steps(llama, ids, mask, third)
    assert pool.stats()["num_used_pages"] == 0


def test_a_finaliser_never_waits_for_the_books_another_thread_holds(llama, no_automatic_gc):
    # A finaliser that waited for the pool's lock deadlocked a thread holding a logging handler's lock (gc ran it
    # while emitting) against the lock's holder logging inside the books. It leaves the rows to the holder instead.
    ids, mask = left_padded_batch([9, 6], seed=3)
    pool = PagePool.from_model(llama, max_tokens=256, page_size=4)
    _garbage_cache(pool, ids, mask, prefill_with=llama)
    assert pool.stats()["num_used_pages"] > 0
    holding, done = threading.Event(), threading.Event()

    def hold_the_books():
        with pool.books():
            holding.set()
            done.wait(20)

    holder = threading.Thread(target=hold_the_books)
    holder.start()
    try:
        assert holding.wait(20)
        collector = threading.Thread(target=gc.collect)
        collector.start()
        collector.join(5)
        finished = not collector.is_alive()
    finally:
        done.set()
        holder.join()
    collector.join()
    assert finished, "the finaliser waited for the books held by another thread"
    s = pool.stats()  # (the rows went back when the holder's block ended)
    assert s["num_used_pages"] == 0 and s["num_reqs_used"] == 0


def test_a_finaliser_run_inside_the_books_waits_until_they_are_consistent(llama, no_automatic_gc):
    # gc runs finalisers at any allocation, also in the middle of the books' changes of this thread: between the
    # prefix cache's match and the ref counts that hold the matched pages, a garbage cache's release inserted a
    # longer tail and freed the matched one ("page 2 is not allocated", a request row leaked)
    pool = PagePool.from_model(llama, max_tokens=64, page_size=4, max_seq_len=32)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, 96, (1, 6), generator=g)
    x, y = torch.randint(3, 96, (2,), generator=g).tolist()

    def fed(ids):
        cache = PagedCache(pool, ids, model=llama)
        with torch.no_grad():
            start = cache.get_seq_length()
            llama(ids[:, start:], position_ids=torch.arange(start, ids.shape[1])[None], past_key_values=cache)
        return cache

    fed(a).release()  # cached: a full page and a tail of 2 tokens
    garbage = fed(torch.cat([a, torch.tensor([[x]])], 1))
    garbage.cycle = garbage  # holds a tail of 3 tokens, garbage once dropped
    del garbage
    alloc = pool.req_to_token.alloc

    def alloc_after_a_collection(n):  # an automatic collection at this allocation
        gc.collect()
        return alloc(n)

    pool.req_to_token.alloc = alloc_after_a_collection
    try:
        ids = torch.cat([a, torch.tensor([[x, y]])], 1)
        cache = PagedCache(pool, ids, model=llama)
    finally:
        pool.req_to_token.alloc = alloc
    assert cache.get_seq_length() > 0
    ref = llama(ids).logits[:, -1]
    with torch.no_grad():
        start = cache.get_seq_length()
        got = llama(ids[:, start:], position_ids=torch.arange(start, ids.shape[1])[None],
                    past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    cache.release()
    s = pool.stats()
    assert s["num_used_pages"] == 0 and s["num_reqs_used"] == 0
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"]


def test_a_step_that_takes_over_a_prefix_page_runs_no_garbage_collection(llama, monkeypatch):
    # a full pool and a prefix hit on a partly used page: the step appends in place instead of copying; it had run
    # a full gc.collect() (160 ms in a large process) before finding that way
    pool = PagePool.from_model(llama, max_tokens=64, page_size=4, max_seq_len=32)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, 96, (1, 6), generator=g)
    cache = PagedCache(pool, a, model=llama)
    with torch.no_grad():
        llama(a, past_key_values=cache)
    cache.release()
    filler = pool.allocator.alloc(pool.allocator.num_free - 1)
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    ids = torch.cat([a, torch.randint(3, 96, (1, 3), generator=g)], 1)
    with PagedCache(pool, ids, model=llama) as cache:
        assert cache.get_seq_length() == 6
        with torch.no_grad():
            llama(ids[:, 6:], position_ids=torch.arange(6, 9)[None], past_key_values=cache)
    assert collections == []
    pool.allocator.decref(filler)
    assert pool.stats()["num_used_pages"] == 0


def _waiting_for_the_locks(monkeypatch, patch_module) -> threading.Event:
    """An event set when the thread named "caller" starts to take a call's locks (past its patch's first check)."""
    waiting, call_locks = threading.Event(), patch_module._call_locks

    def noting_call_locks(*items):
        if threading.current_thread().name == "caller":
            waiting.set()
        return call_locks(*items)

    monkeypatch.setattr(patch_module, "_call_locks", noting_call_locks)
    return waiting


def _patch_again_noting_locks(model, pool, old, seen: list, patch_module) -> None:
    """patch() ``model`` onto ``pool`` again, noting in ``seen`` at each of its forwards whether the thread holds
    the new patch's lock and the old patch's (``old``): the call's forwards must run under the new one's alone."""
    astrai_hf.patch(model, pool=pool)
    new = model.__dict__[patch_module._STATE_ATTR]
    model.model.register_forward_pre_hook(
        lambda module, args: seen.append((new.lock._is_owned(), old.lock._is_owned())))


@pytest.mark.parametrize("then", ["patched again", "unpatched"])
def test_a_call_that_waited_through_unpatch_runs_as_the_model_is_now(monkeypatch, then):
    # a call waiting for the locks while another thread unpatched the model (and patched it again) ran on the old
    # patch, holding its lock and the pool's, while its forwards took the new patch's lock: a thread that took the
    # new patch's lock first (the next unpatch()) and then the pool's waited for it, and it for that thread
    import importlib

    patch_module = importlib.import_module("astrai_hf.patch")
    model = tiny_model("llama")
    pool = PagePool.from_model(model, max_tokens=512)
    ids, mask = left_padded_batch([4, 7], seed=0)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, **kw)
    astrai_hf.patch(model, pool=pool)
    old = model.__dict__[patch_module._STATE_ATTR]
    waiting, seen, result = _waiting_for_the_locks(monkeypatch, patch_module), [], {}

    def caller():
        result["out"] = model.generate(ids, **kw)

    with old.lock, pool.call_lock:  # a call under way: the caller waits for the locks, past the patch's check
        thread = threading.Thread(target=caller, name="caller", daemon=True)
        thread.start()
        assert waiting.wait(30)
        astrai_hf.unpatch(model)  # (the same thread: the locks are taken again)
        if then == "patched again":
            _patch_again_noting_locks(model, pool, old, seen, patch_module)
    thread.join(60)
    assert not thread.is_alive(), "the waiting call hung"
    assert torch.equal(result["out"], ref)
    if then == "patched again":
        assert seen and all(now and not before for now, before in seen), seen
        astrai_hf.unpatch(model)
    else:
        assert not astrai_hf.is_patched(model)
    assert pool.stats()["num_used_pages"] == 0


def test_an_assisted_call_that_waited_through_the_assistants_unpatch_takes_its_new_locks(monkeypatch):
    # the assistant's patch was read before the wait: its drafts ran holding the old patch's lock and the pool's
    # while taking the new patch's, the nesting that hangs against an unpatch() taking them the other way round
    import importlib

    patch_module = importlib.import_module("astrai_hf.patch")
    target, assistant = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    target_pool, assistant_pool = (PagePool.from_model(m, max_tokens=512) for m in (target, assistant))
    ids, mask = left_padded_batch([6])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, assistant_model=assistant)
    ref = target.generate(ids, **kw)
    astrai_hf.patch(target, pool=target_pool)
    astrai_hf.patch(assistant, pool=assistant_pool)
    old = assistant.__dict__[patch_module._STATE_ATTR]
    waiting, seen, result = _waiting_for_the_locks(monkeypatch, patch_module), [], {}

    def caller():
        result["out"] = target.generate(ids, **kw)

    with old.lock, assistant_pool.call_lock:
        thread = threading.Thread(target=caller, name="caller", daemon=True)
        thread.start()
        assert waiting.wait(30)
        astrai_hf.unpatch(assistant)
        _patch_again_noting_locks(assistant, assistant_pool, old, seen, patch_module)
    thread.join(60)
    assert not thread.is_alive(), "the waiting call hung"
    assert torch.equal(result["out"], ref)
    assert seen and all(now and not before for now, before in seen), seen
    for model in (target, assistant):
        astrai_hf.unpatch(model)
    assert target_pool.stats()["num_used_pages"] == assistant_pool.stats()["num_used_pages"] == 0
