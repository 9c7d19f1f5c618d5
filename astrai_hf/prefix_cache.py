"""Prefix cache: full pages of earlier sequences, found again by their token ids.

A cached page is a node of a tree whose root is the empty prefix; a node holds ``page_size`` token ids (fewer for
the tail page of a finished sequence, always a leaf) and the page whose K/V those tokens produced after the tokens
of all its ancestors. Nodes are indexed by a chained key,
``key = blake2b(parent_key + token_ids)`` (the chained block hash of vLLM's automatic prefix caching), and every hit
is confirmed by comparing the parent node and the token ids themselves, so a hash collision can never make two
different prefixes share K/V. The children of a node are kept too: they let a prompt that diverges in the middle of
a page reuse that page's leading tokens (SGLang's RadixAttention matches at token granularity the same way).

The cache holds one allocator reference per cached page. A page referenced by nothing else is *evictable*. Eviction
takes least-recently-used leaves first, so the pages of a sequence leave tail first and a hit is always a
contiguous run of pages from the first one.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from array import array
from collections.abc import Iterator, Sequence

from .allocator import PageAllocator

logger = logging.getLogger(__name__)


def page_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained key of a page: a 16-byte blake2b digest of the parent's key and the page's token ids."""
    return hashlib.blake2b(parent_key + array("q", token_ids).tobytes(), digest_size=16).digest()


class _Node:
    __slots__ = ("key", "page", "tokens", "parent", "children", "last_access")

    def __init__(self, key: bytes, page: int, tokens: tuple[int, ...], parent: "_Node | None"):
        self.key, self.page, self.tokens, self.parent = key, page, tokens, parent
        self.children: list[_Node] = []
        self.last_access = 0


class PrefixCache:
    """Index of cached full pages, keyed by chained token-id hashes, with LRU eviction of leaves.

    Args:
        allocator: the pool's page allocator; the cache takes one reference on every page it keeps.
        page_size: tokens per page.
    """

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node(b"", -1, (), None)
        self._buckets: dict[bytes, list[_Node]] = {}
        self._by_page: dict[int, _Node] = {}
        self._clock = 0
        self.evictions = 0
        # bumped by every clear(): K/V computed before a clear (another model's, older weights) must not be
        # inserted after it
        self.epoch = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Pages indexed (whether or not a live row also holds them)."""
        return len(self._by_page)

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    @property
    def num_cached_only(self) -> int:
        """Pages held by the cache alone (no live row holds them)."""
        return sum(self.allocator.ref_count(p) == 1 for p in self._by_page)

    @property
    def num_evictable(self) -> int:
        """Pages :meth:`evict` can free: held by the cache alone, and so is every cached page below them (eviction
        takes leaves, so a page whose cached continuation a live row still holds stays until that row lets go)."""
        ref = self.allocator.ref_count
        evictable: set[int] = set()  # id() of evictable nodes
        for node in reversed(list(self.nodes())):  # children before their parents
            if ref(node.page) == 1 and all(id(c) in evictable for c in node.children):
                evictable.add(id(node))
        return len(evictable)

    def nodes(self) -> Iterator[_Node]:
        """Every node, parents before children."""
        stack = list(reversed(self.root.children))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def _child(self, parent: _Node, tokens: tuple[int, ...], key: bytes) -> _Node | None:
        for node in self._buckets.get(key, ()):
            if node.parent is parent and node.tokens == tokens:
                return node
        return None

    def find(self, parent: _Node, tokens: tuple[int, ...]) -> _Node | None:
        """The cached child of ``parent`` holding exactly ``tokens``, or None."""
        return self._child(parent, tokens, page_key(parent.key, tokens))

    def attach(self, parent: _Node, tokens: tuple[int, ...], page: int) -> _Node:
        """Index ``page`` as the child of ``parent`` holding ``tokens``. The cache takes over one reference the
        caller already holds on ``page``; an exception midway leaves nothing indexed and the reference with the
        caller."""
        key = page_key(parent.key, tokens)
        node = _Node(key, page, tokens, parent)
        self._clock += 1
        node.last_access = self._clock
        try:
            self._by_page[page] = node
            self._buckets.setdefault(key, []).append(node)
            parent.children.append(node)
        except BaseException:  # an interrupt midway: unindex what was indexed (the reference stays the caller's)
            self._by_page.pop(page, None)
            if node in self._buckets.get(key, ()):
                self._buckets[key].remove(node)
            if node in parent.children:
                parent.children.remove(node)
            raise
        return node

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The longest cached prefix of ``token_ids``.

        Full pages are followed down the tree; then, if a cached child of the last matched page starts with some of
        the following tokens, that page is returned too, partly used (its first ``num_tokens % page_size`` slots).
        The caller must take a reference on the pages before anything else allocates.

        Args:
            token_ids: the real (unpadded) tokens of one sequence.

        Returns:
            ``(pages, num_tokens)``: the page ids in order and how many leading tokens they hold,
            ``len(pages) == ceil(num_tokens / page_size)``.
        """
        ps = self.page_size
        self._clock += 1
        node, pages, n = self.root, [], 0
        tokens = tuple(int(t) for t in token_ids)
        while n + ps <= len(tokens):
            chunk = tokens[n : n + ps]
            found = self._child(node, chunk, page_key(node.key, chunk))
            if found is None:
                break
            node = found
            node.last_access = self._clock
            pages.append(node.page)
            n += ps
        rest = tokens[n : n + ps]
        best, best_len = None, 0
        for child in node.children:
            common = _common_prefix(child.tokens, rest)
            if common > best_len:
                best, best_len = child, common
        if best is not None:
            best.last_access = self._clock
            pages.append(best.page)
            n += best_len
        return pages, n

    # ------------------------------------------------------------------ updates
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Index the pages of one finished sequence: its full pages, then its partly filled tail page.

        A tail page is a leaf holding fewer than ``page_size`` tokens; it is only ever reused partly (copied into
        a fresh page before anything is appended), and a later sibling that extends it replaces it.

        Args:
            token_ids: the sequence's tokens, in order.
            pages: the sequence's pages, ``pages[i]`` holding tokens ``[i * page_size, (i + 1) * page_size)``.

        Returns:
            the number of pages newly indexed (a page whose tokens are already cached under the same prefix is
            skipped; the cached twin stays).
        """
        ps = self.page_size
        self._clock += 1
        tokens = tuple(int(t) for t in token_ids)
        node, added = self.root, 0
        for i in range(min(-(-len(tokens) // ps), len(pages))):
            chunk = tokens[i * ps : (i + 1) * ps]
            found = self._child(node, chunk, page_key(node.key, chunk))
            if found is None and len(chunk) < ps:
                found = next((c for c in node.children if c.tokens[: len(chunk)] == chunk), None)
            if found is None:
                page = int(pages[i])
                if page in self._by_page:  # cannot happen for a consistent row; never index a page twice
                    break
                self.allocator.incref([page])
                try:
                    found = self.attach(node, chunk, page)
                except BaseException:  # not indexed: the reference taken for the index goes back
                    self.allocator.decref([page])
                    raise
                added += 1
                self._drop_covered_tails(node, found)
            found.last_access = self._clock
            node = found
        return added

    def _drop_covered_tails(self, parent: _Node, new: _Node) -> None:
        """Unindex cached-only tail pages of ``parent`` whose tokens are a prefix of ``new``'s."""
        for sibling in list(parent.children):
            if (
                sibling is not new
                and len(sibling.tokens) < len(new.tokens)
                and new.tokens[: len(sibling.tokens)] == sibling.tokens
                and not sibling.children
                and self.allocator.ref_count(sibling.page) == 1
            ):
                self._remove(sibling)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages held by the cache alone: least recently used leaves first.

        Returns:
            pages freed.
        """
        if num_pages <= 0:
            return 0
        ref = self.allocator.ref_count
        heap = [(n.last_access, n.page, n) for n in self._by_page.values() if not n.children and ref(n.page) == 1]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not self.root and not parent.children and ref(parent.page) == 1:
                heapq.heappush(heap, (parent.last_access, parent.page, parent))
        self.evictions += freed
        if freed:
            logger.debug("prefix cache: evicted %d pages (%d wanted)", freed, num_pages)
        return freed

    def give_up(self, page: int) -> bool:
        """Unindex ``page`` and its cached continuations, dropping the cache's references: a row that holds the
        page's other references can then append into it in place instead of copying it. The continuations follow
        the page's present tokens, which that row overwrites, so they go too; it does so only when the cache alone
        holds each of them. Returns whether it did."""
        node = self._by_page.get(page)
        if node is None:
            return False
        below, stack = [], list(node.children)
        while stack:
            child = stack.pop()
            below.append(child)
            stack.extend(child.children)
        if any(self.allocator.ref_count(n.page) != 1 for n in below):
            return False
        for n in reversed(below):  # children after their parents in `below`: remove them first
            self._remove(n)
        self._remove(node)
        return True

    def remove(self, node: _Node) -> None:
        """Unindex ``node``, which must have no children, and drop the cache's reference on its page."""
        if node.children:
            raise ValueError(f"page {node.page} has {len(node.children)} cached children; remove them first")
        self._remove(node)

    def _remove(self, node: _Node) -> None:
        node.parent.children.remove(node)
        bucket = self._buckets[node.key]
        bucket.remove(node)
        if not bucket:
            del self._buckets[node.key]
        del self._by_page[node.page]
        self.allocator.decref([node.page])

    def clear(self) -> int:
        """Drop every page held by the cache alone; pages a live row still uses are unindexed but stay with it.

        Returns:
            pages dropped from the index.
        """
        dropped = len(self._by_page)
        self.epoch += 1
        for page in self._by_page:
            self.allocator.decref([page])
        self.root.children.clear()
        self._buckets.clear()
        self._by_page.clear()
        return dropped


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
