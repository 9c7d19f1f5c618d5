"""Ref-counted page allocator: a free list and one ref count per page, O(1) per page, no tensors."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import CacheFullError


class PageAllocator:
    """Hands out page ids in ``[first_page, num_pages)`` and counts the references held on each.

    A page is free exactly when its ref count is 0. Allocation pops from a stack of free ids, so recently freed
    (cache-warm, already touched) pages are reused first. The design follows the block manager of vLLM's paged
    attention paper (Kwon et al., SOSP 2023): fixed-size pages, ref counts for sharing, copy-on-write by the owner.

    Runs of consecutive free ids (:meth:`alloc_runs`) are found in a free map, one byte per page, searched at C
    speed. Pages taken that way stay in the stack as stale entries, skipped when popped (the newest entry of a page
    is always above its older ones, so a page is never handed out twice); the stack is compacted when stale
    entries outnumber the pages.

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
        self._is_free = bytearray(first_page) + bytearray(b"\x01") * (num_pages - first_page)
        self._num_free = num_pages - first_page
        self._free = list(range(num_pages - 1, first_page - 1, -1))  # stack: lowest id on top

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_usable(self) -> int:
        return self.num_pages - self.first_page

    @property
    def num_used(self) -> int:
        return self.num_usable - self._num_free

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def alloc(self, num: int) -> list[int]:
        """Take ``num`` free pages, each with ref count 1.

        Raises:
            CacheFullError: fewer than ``num`` pages are free (nothing is taken then).
        """
        if num > self._num_free:
            raise CacheFullError(num, self._num_free)
        pages = []
        while len(pages) < num:
            p = self._free.pop()
            if self._is_free[p]:  # else a stale entry of a page taken by alloc_runs
                self._take(p)
                pages.append(p)
        return pages

    def alloc_runs(self, sizes: list[int]) -> list[list[int]] | None:
        """Take one run of consecutive page ids per entry of ``sizes`` (first fit, lowest ids first), each page
        with ref count 1; None, taking nothing, when the free pages hold no such runs.

        A row whose tokens lie in consecutive slots can be read by attention as a view of the pool, without a
        gather. Each run is a search of the free map (``bytearray.find``), O(num_pages) at C speed.

        Raises:
            ValueError: a size is not positive.
        """
        if any(n <= 0 for n in sizes):
            raise ValueError(f"run sizes must be positive, got {sizes}")
        if sum(sizes) > self._num_free:
            return None
        runs = []
        for n in sizes:
            start = self._is_free.find(b"\x01" * n, self.first_page)
            if start < 0:
                for run in runs:  # give back what this call took
                    for p in run:
                        self._give_back(p, push=False)
                return None
            run = list(range(start, start + n))
            for p in run:
                self._take(p)
            runs.append(run)
        return runs

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each (already allocated) page.

        Raises:
            ValueError: a page is free or reserved.
        """
        pages = list(pages)
        for p in pages:  # (all checked first: a refused call adds no reference)
            if p < self.first_page or self._ref_counts[p] == 0:
                raise ValueError(f"page {p} is not allocated; only allocated pages can be shared")
        for p in pages:
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
                self._give_back(p, push=True)
                freed += 1
        if len(self._free) > 2 * self.num_usable + 64:
            self._compact()
        return freed

    def free_pages(self) -> list[int]:
        """The free page ids, ascending, for checks and tests."""
        return [p for p in range(self.first_page, self.num_pages) if self._is_free[p]]

    def _take(self, p: int) -> None:
        self._is_free[p] = 0
        self._ref_counts[p] = 1
        self._num_free -= 1

    def _give_back(self, p: int, *, push: bool) -> None:
        self._is_free[p] = 1
        self._ref_counts[p] = 0
        self._num_free += 1
        if push:
            self._free.append(p)

    def _compact(self) -> None:
        """Drop stale stack entries, keeping the newest entry of each free page in its place."""
        seen, kept = set(), []
        for p in reversed(self._free):
            if self._is_free[p] and p not in seen:
                seen.add(p)
                kept.append(p)
        kept.reverse()
        self._free = kept
