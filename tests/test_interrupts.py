"""Ctrl-C at any moment of a patched generate() leaves the pool as it was: no page or request row is leaked, none
is freed twice, and the next call equals stock."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import weakref

import pytest
import torch

import astrai_hf
from astrai_hf import PagePool
from astrai_hf.interrupts import interrupts_deferred
from tiny_models import tiny_model

KW = dict(max_new_tokens=6, do_sample=False)


@pytest.fixture(autouse=True)
def _sigint_raises():
    # a shell starts a background job (`pytest &`) with SIGINT ignored; these tests are about Python's own handler
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _clean(pool):
    gc.collect()
    s = pool.stats()
    assert (s["num_used_pages"], s["num_reqs_used"]) == (0, 0), s
    assert s["num_free_pages"] + s["num_cached_pages"] == s["num_pages"], s
    indexed = pool.prefix_cache._by_page if pool.prefix_cache is not None else {}
    assert all(pool.allocator.ref_count(p) > 0 for p in indexed)  # nothing indexed was freed


def _raise_once(obj, name, exc, after=0):
    """Make ``obj.name`` raise ``exc`` (or call it, if callable) on its ``after + 1``-th call, once."""
    real, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            setattr(obj, name, real)
            if callable(exc):
                exc()
                return real(*args, **kwargs)
            raise exc
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, real)


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode of the main thread


@pytest.fixture
def setup():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    stock = model.generate(ids, attention_mask=torch.ones_like(ids), **KW)
    longer = torch.cat([stock[:, :13], ids[:, :3]], 1)  # shares 3 pages and 1 token of a page with stock's rows
    stock_longer = model.generate(longer, attention_mask=torch.ones_like(longer), **KW)
    pool = PagePool.from_model(model, max_tokens=256, page_size=4)
    astrai_hf.patch(model, pool=pool)
    yield model, pool, (ids, stock), (longer, stock_longer)
    astrai_hf.unpatch(model)


def _gen(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{**KW, **kw})


# (object holding the function, its name, which call) for steps inside astrai-hf's own bookkeeping
POINTS = {
    "copy-on-write of a shared page": (lambda pool: pool.storage, "copy_page_prefix", 0),
    "indexing pages into the prefix cache": (lambda pool: pool.prefix_cache, "attach", 1),
    "allocating a step's pages": (lambda pool: pool.allocator, "alloc", 0),
    "returning pages": (lambda pool: pool.allocator, "decref", 1),
    "taking a request row": (lambda pool: pool.req_to_token, "alloc", 0),
    "sharing a cached prefix's pages": (lambda pool: pool.allocator, "incref", 0),
    # a warm call's cache taking its prefix from the prefix cache, before generate() holds the cache
    "writing a cached prefix's slots": (lambda pool: pool.req_to_token, "write", 0),
    "writing a cached prefix's token ids": (lambda pool: pool.req_to_token, "write_ids", 0),
    # the call's end: a Ctrl-C as generate() starts to release its cache, before the release holds interrupts back
    "releasing the call's cache": (lambda pool: sys.modules["astrai_hf.patch"], "_release_as_returned", 0),
}


# An exception raised by the allocator's own decref (a double free: the books are already wrong) is not one of
# them: the pages it was returning stay used.
CASES = [(p, "SIGINT arriving there") for p in POINTS] + [
    (p, "KeyboardInterrupt raised there") for p in POINTS if p != "returning pages"]


@pytest.mark.parametrize("point, how", CASES)
def test_interrupt_inside_the_bookkeeping_leaks_nothing(setup, point, how):
    model, pool, (ids, stock), (longer, stock_longer) = setup
    _gen(model, ids)  # fills the prefix cache: the next prompt shares pages with it, partly filled ones too
    holder, name, after = POINTS[point]
    if how.startswith("SIGINT"):
        # a real Ctrl-C in the middle of the step: it must wait until the books are consistent
        undo = _raise_once(holder(pool), name, _ctrl_c, after)
    else:
        undo = _raise_once(holder(pool), name, KeyboardInterrupt(), after)
    try:
        with pytest.raises(KeyboardInterrupt) as kept:
            _gen(model, longer)
    finally:
        undo()
    _clean(pool)  # while the caller keeps the error (a notebook keeps the last one): its traceback holds the cache
    del kept
    for _ in range(2):
        assert torch.equal(_gen(model, ids), stock)
        assert torch.equal(_gen(model, longer), stock_longer)
        _clean(pool)


@pytest.mark.parametrize("after", [0, 2, 5])
def test_interrupt_during_beam_reordering_leaks_nothing(setup, after):
    model, pool, (ids, _), _ = setup
    stock = astrai_hf.unpatch(model).generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, **KW)
    astrai_hf.patch(model, pool=pool)
    undo = _raise_once(pool.allocator, "incref", _ctrl_c, after)
    try:
        with pytest.raises(KeyboardInterrupt):
            _gen(model, ids, num_beams=3)
    finally:
        undo()
    _clean(pool)
    assert torch.equal(_gen(model, ids, num_beams=3), stock)
    _clean(pool)


def test_interrupts_deferred_delivers_sigint_at_the_end_and_nests():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            with interrupts_deferred():
                _ctrl_c()
                reached.append("inner")
            reached.append("outer")
    assert reached == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_inside_interrupts_deferred_puts_the_handler_back():
    # an error inside the books (CacheFullError, a bad row index) had left the holding handler in place: every
    # later Ctrl-C was held for a block that had ended, and lost
    with pytest.raises(RuntimeError, match="inside the books"):
        with interrupts_deferred():
            raise RuntimeError("inside the books")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        _ctrl_c()
        signal.getsignal(signal.SIGINT)  # (a bytecode after the kill, where it lands)


def test_releasing_collected_caches_outside_the_books_defers_ctrl_c_until_the_books_are_consistent():
    """``release_garbage_caches()`` is public: called outside any ``books()`` block, the rows of caches collected
    meanwhile are released inside one that defers Ctrl-C (a block was taken for nested and let Ctrl-C in)."""
    pool = PagePool.from_model(tiny_model("llama"), max_tokens=256, page_size=4, prefix_cache=False)
    log = []

    class Holder:  # the rows of a collected cache, queued by its finaliser while the books were busy
        def release(self):
            with pool.books():
                log.append("half of the books changed")
                _ctrl_c()
                log.append("books consistent")

    pool.release_later(Holder())
    with pytest.raises(KeyboardInterrupt):
        pool.release_garbage_caches()
    assert log == ["half of the books changed", "books consistent"]
    assert pool.books_depth == 0 and pool._books_owner is None
    with pool.books():  # and a later block is an outermost one again
        assert pool._books_owner == threading.get_ident()


def test_interrupts_deferred_is_a_no_op_off_the_main_thread():
    seen = []

    def work():
        with interrupts_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]


@pytest.mark.parametrize("disposition", [signal.SIG_IGN, "user handler"])
def test_interrupts_deferred_keeps_the_callers_sigint_setting(disposition):
    calls = []  # (the signal, and whether a frame came with it, as Python hands its handlers one)
    handler = (lambda signum, frame: calls.append((signum, frame is not None))) if disposition == "user handler" \
        else disposition
    old = signal.signal(signal.SIGINT, handler)
    try:
        with interrupts_deferred():
            _ctrl_c()
            assert calls == []  # held back inside
        assert signal.getsignal(signal.SIGINT) is handler
        assert calls == ([(signal.SIGINT, True)] if disposition == "user handler" else [])
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_inside_unpatch_leaves_the_model_whole():
    # an interrupt between two of unpatch()'s steps had left hooks on the model (a __deepcopy__ that patched the
    # model again when copied) with is_patched() False, so no later unpatch() could take them off
    model = tiny_model("llama")
    before = {id(m): set(m.__dict__) for m in model.modules()}
    undone = []

    def family_patch(*args, **kwargs):  # a family patch whose undo runs second on unpatch (they run reversed)
        return [lambda: undone.append(True), lambda: signal.raise_signal(signal.SIGINT)]

    from astrai_hf import patches

    original = patches.apply
    patches.apply = family_patch
    try:
        astrai_hf.patch(model, max_tokens=256)
        with pytest.raises(KeyboardInterrupt):
            astrai_hf.unpatch(model)
    finally:
        patches.apply = original
    assert undone == [True] and not astrai_hf.is_patched(model)
    assert {id(m): set(m.__dict__) for m in model.modules()} == before


@pytest.mark.parametrize("at", [1, 2])
def test_a_ctrl_c_while_the_padding_check_is_shadowed_leaves_no_module_shadowed(at):
    # the shadow is set on each module in turn: a Ctrl-C between two had left the first shadowed for good (the
    # with block's exit does not run when its enter raises)
    import sys

    from astrai_hf.packing import PADDING_CHECK, padding_check_skipped

    modules = [torch.nn.Linear(1, 1) for _ in range(3)]
    lines = [0]

    def tracer(frame, event, arg):
        if event == "line" and frame.f_code.co_name == "__enter__" and "PADDING_CHECK] =" in _source_line(frame):
            lines[0] += 1
            if lines[0] == at:
                os.kill(os.getpid(), signal.SIGINT)
        return tracer

    ran = False
    sys.settrace(tracer)
    try:
        with padding_check_skipped([weakref.ref(m) for m in modules]):
            ran = True
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    assert lines[0] >= at and not ran
    assert not any(PADDING_CHECK in vars(m) for m in modules)


def _source_line(frame) -> str:
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_a_prefix_interrupted_before_its_token_ids_are_written_is_not_indexed_under_the_rows_old_ids(setup):
    # the rows a warm call takes keep the ids of their last prompt until the prefix's ids are written over them;
    # a cache released before that offers the prefix's pages to the prefix cache under those stale ids, which must
    # not index them there (a later prompt starting with them would be served another prompt's K/V): it indexes no
    # page twice
    model, pool, (ids, stock), (longer, stock_longer) = setup
    _gen(model, ids)
    pool.req_to_token.token_ids.fill_(7)  # as if every row had last held a prompt of 7s
    undo = _raise_once(pool.req_to_token, "write_ids", KeyboardInterrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            _gen(model, longer)
    finally:
        undo()
    _clean(pool)
    assert pool.prefix_cache.match([7] * 16)[1] == 0
    assert torch.equal(_gen(model, longer), stock_longer)


@pytest.mark.parametrize("name, after", [("_candidate_decoding", 1), ("agree", 0), ("forget_rope_deltas", 0)])
def test_a_ctrl_c_between_making_the_calls_cache_and_generating_on_it_returns_its_pages(setup, name, after):
    # the cache is made (a warm call's holds prefix pages) before generate() runs on it: a Ctrl-C in between had
    # left its pages to its finaliser, which the traceback a caller keeps puts off
    model, pool, (ids, stock), (longer, stock_longer) = setup
    _gen(model, ids)
    undo = _raise_once(sys.modules["astrai_hf.patch"], name, _ctrl_c, after)  # (the call after the cache is made)
    try:
        with pytest.raises(KeyboardInterrupt) as kept:
            _gen(model, longer)
    finally:
        undo()
    _clean(pool)
    del kept
    assert torch.equal(_gen(model, longer), stock_longer)
    _clean(pool)
