"""The page allocator against a plain dict model (hypothesis state machine)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from astrai_hf import CacheFullError
from astrai_hf.allocator import PageAllocator

NUM_PAGES, FIRST = 12, 1


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES, first_page=FIRST)
        self.refs: dict[int, int] = {}  # the model: page -> ref count, allocated pages only

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free = NUM_PAGES - FIRST - len(self.refs)
        if n > free:
            with pytest.raises(CacheFullError):
                self.alloc.alloc(n)
            return
        pages = self.alloc.alloc(n)
        assert len(set(pages)) == n
        for p in pages:
            assert p not in self.refs, f"page {p} handed out twice"
            assert FIRST <= p < NUM_PAGES
            self.refs[p] = 1

    @rule(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3))
    def allocate_runs(self, sizes):
        free = set(range(FIRST, NUM_PAGES)) - set(self.refs)
        # the model's answer: can first fit over the sorted free ids place every run?
        segments, placeable = [], True
        for p in sorted(free):
            if segments and segments[-1][0] + segments[-1][1] == p:
                segments[-1][1] += 1
            else:
                segments.append([p, 1])
        for n in sizes:
            seg = next((s for s in segments if s[1] >= n), None)
            if seg is None:
                placeable = False
                break
            seg[0], seg[1] = seg[0] + n, seg[1] - n
        runs = self.alloc.alloc_runs(sizes)
        if not placeable:
            assert runs is None
            assert set(self.alloc.free_pages()) == free  # nothing taken
            return
        assert [len(r) for r in runs] == sizes
        for run in runs:
            assert run == list(range(run[0], run[0] + len(run))), f"run {run} is not consecutive"
            for p in run:
                assert p in free and p not in self.refs, f"page {p} handed out twice"
                self.refs[p] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        page = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.incref([page])
        self.refs[page] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def drop(self, data):
        page = data.draw(st.sampled_from(sorted(self.refs)))
        freed = self.alloc.decref([page])
        self.refs[page] -= 1
        assert freed == (self.refs[page] == 0)
        if self.refs[page] == 0:
            del self.refs[page]

    @rule(page=st.integers(0, NUM_PAGES - 1), data=st.data())
    def double_free_is_refused(self, page, data):
        if page not in self.refs:
            with pytest.raises(ValueError):
                self.alloc.decref([page])
            held = data.draw(st.lists(st.sampled_from(sorted(self.refs)), max_size=3)) if self.refs else []
            with pytest.raises(ValueError):
                self.alloc.incref(held + [page])  # refused whole: the allocated pages before it gain no reference

    @invariant()
    def free_and_used_are_disjoint_and_complete(self):
        free = self.alloc.free_pages()
        assert len(free) == len(set(free))
        assert set(free).isdisjoint(self.refs)
        assert set(free) | set(self.refs) == set(range(FIRST, NUM_PAGES))
        assert self.alloc.num_used == len(self.refs)

    @invariant()
    def ref_counts_match(self):
        for p in range(NUM_PAGES):
            assert self.alloc.ref_count(p) == self.refs.get(p, 0) >= 0


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_reserved_pages_are_never_handed_out():
    alloc = PageAllocator(4, first_page=1)
    assert sorted(alloc.alloc(3)) == [1, 2, 3]
    with pytest.raises(CacheFullError, match=r"needed 1 page, 0 free, 0 evictable; give the pool more tokens "
                                             r"\(PagePool.from_model\(model, max_tokens=...\)"):  # and what to do
        alloc.alloc(1)
    with pytest.raises(CacheFullError, match="needed 2 pages, 0 free"):
        alloc.alloc(2)


def test_alloc_runs_first_fit_and_refusal():
    alloc = PageAllocator(10, first_page=1)
    a = alloc.alloc_runs([3, 2])
    assert a == [[1, 2, 3], [4, 5]]
    alloc.decref([2])  # free ids: 2, 6, 7, 8, 9
    assert alloc.alloc_runs([5]) is None and alloc.num_free == 5  # 5 free, but not consecutive: nothing taken
    assert alloc.alloc_runs([3, 1]) == [[6, 7, 8], [2]]
    assert alloc.ref_count(6) == 1 and alloc.num_free == 1
    with pytest.raises(ValueError, match="positive"):
        alloc.alloc_runs([0])


def test_stale_entries_are_compacted_and_never_handed_out():
    """Pages taken as runs leave stale entries on the free stack; thousands of mixed operations never hand a page
    out twice, and the stack stays bounded."""
    import random

    rng = random.Random(0)
    alloc = PageAllocator(12, first_page=1)
    refs: dict[int, int] = {}
    longest, compactions, compact = 0, [], alloc._compact
    alloc._compact = lambda: (compactions.append(len(alloc._free)), compact())
    for _ in range(5000):
        op = rng.random()
        free = 11 - len(refs)
        if op < 0.35:
            runs = alloc.alloc_runs([rng.randint(1, 3) for _ in range(rng.randint(1, 2))])
            taken = [p for run in runs or () for p in run]
        elif op < 0.6 and free:
            taken = alloc.alloc(rng.randint(1, free))
        else:
            taken = []
            for p in rng.sample(sorted(refs), k=min(len(refs), rng.randint(0, 4))):
                alloc.decref([p])
                refs[p] -= 1
                if refs[p] == 0:
                    del refs[p]
        for p in taken:
            assert p not in refs, f"page {p} handed out twice"
            refs[p] = 1
        assert set(alloc.free_pages()) == set(range(1, 12)) - set(refs) and alloc.num_free == 11 - len(refs)
        longest = max(longest, len(alloc._free))
    assert compactions and longest <= 2 * 11 + 64 + 4
