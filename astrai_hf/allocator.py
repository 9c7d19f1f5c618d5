"""Ref-counted page allocator: a free list and one ref count per page, O(1) per page, no tensors."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import CacheFullError


class PageAllocator:
    """Hands out page ids in ``[first_page, num_pages)`` and counts the references held on each.

    A page is free exactly when its ref count is 0. Allocation pops from a stack of free ids, so recently freed
    (cache-warm, already touched) pages are reused first. The design follows the block manager of vLLM's paged
    attention paper (Kwon et al., SOSP 2023): fixed-size pages, ref counts for sharing, copy-on-write by the owner.

    Args:
        num_pages: total page ids, including the reserved ones.
        first_page: ids below this are reserved (never handed out), e.g. a trash page.

    Raises:
        ValueError: ``num_pages <= first_page``.
    """

    def __init__(self, num_pages: int, first_page: int = 0):
        if num_pages <= first_page:
            raise ValueError(f"num_pages={num_pages} leaves no usable page above the {first_page} reserved ones")
        self.num_pages = num_pages
        self.first_page = first_page
        self._ref_counts = [0] * num_pages
        self._free = list(range(num_pages - 1, first_page - 1, -1))  # stack: lowest id on top

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - self.first_page

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def alloc(self, num: int) -> list[int]:
        """Take ``num`` free pages, each with ref count 1.

        Raises:
            CacheFullError: fewer than ``num`` pages are free (nothing is taken then).
        """
        if num > len(self._free):
            raise CacheFullError(num, len(self._free))
        pages = [self._free.pop() for _ in range(num)]
        for p in pages:
            self._ref_counts[p] = 1
        return pages

    def alloc_runs(self, sizes: list[int]) -> list[list[int]] | None:
        """Take one run of consecutive page ids per entry of ``sizes`` (first fit over the free ids), each page
        with ref count 1; None, taking nothing, when the free ids hold no such runs.

        A row whose tokens lie in consecutive slots can be read by attention as a view of the pool, without a
        gather. O(F log F) for F free pages; meant for a row's first allocation, not for every step.
        """
        if any(n <= 0 for n in sizes):
            raise ValueError(f"run sizes must be positive, got {sizes}")
        if sum(sizes) > len(self._free):
            return None
        segments = []  # [start, length] of maximal runs of free ids, ascending
        for p in sorted(self._free):
            if segments and segments[-1][0] + segments[-1][1] == p:
                segments[-1][1] += 1
            else:
                segments.append([p, 1])
        runs = []
        for n in sizes:
            seg = next((s for s in segments if s[1] >= n), None)
            if seg is None:
                return None
            runs.append(list(range(seg[0], seg[0] + n)))
            seg[0] += n
            seg[1] -= n
        taken = {p for run in runs for p in run}
        self._free = [p for p in self._free if p not in taken]
        for p in taken:
            self._ref_counts[p] = 1
        return runs

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each (already allocated) page.

        Raises:
            ValueError: a page is free or reserved.
        """
        for p in pages:
            if p < self.first_page or self._ref_counts[p] == 0:
                raise ValueError(f"page {p} is not allocated; only allocated pages can be shared")
            self._ref_counts[p] += 1

    def decref(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; pages reaching 0 go back to the free list.

        Returns:
            the number of pages freed.

        Raises:
            ValueError: a page is already free (a double free).
        """
        freed = 0
        for p in pages:
            if p < self.first_page or self._ref_counts[p] == 0:
                raise ValueError(f"page {p} is freed twice or was never allocated")
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def free_pages(self) -> list[int]:
        """The free page ids (a copy), for checks and tests."""
        return list(self._free)
