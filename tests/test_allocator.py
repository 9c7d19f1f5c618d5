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

    @rule(page=st.integers(0, NUM_PAGES - 1))
    def double_free_is_refused(self, page):
        if page not in self.refs:
            with pytest.raises(ValueError):
                self.alloc.decref([page])
            with pytest.raises(ValueError):
                self.alloc.incref([page])

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
    with pytest.raises(CacheFullError, match="needed 1 pages, 0 free"):
        alloc.alloc(1)
