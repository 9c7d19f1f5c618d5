"""Errors raised by astrai-hf."""

from __future__ import annotations


class CacheFullError(RuntimeError):
    """The page pool cannot hold what a step needs.

    Raised before anything of the failing step is allocated. The cache that raised it has already returned all of
    its pages to the pool, so the pool is usable again at once.

    Attributes:
        needed: pages (or request rows, see ``unit``) the step needed.
        free: pages (or rows) free in the pool when the step was planned.
        evictable: pages that could have been evicted to make room.
        unit: ``"pages"`` or ``"request rows"``.
    """

    def __init__(self, needed: int, free: int, evictable: int = 0, *, unit: str = "pages", detail: str = "",
                 hint: bool = True):
        self.needed, self.free, self.evictable, self.unit = needed, free, evictable, unit
        msg = (f"KV page pool is full: needed {needed} {unit[:-1] if needed == 1 else unit}, {free} free, "
               f"{evictable} evictable")
        if detail:
            msg += f" ({detail})"
        if hint and unit == "pages":
            msg += ("; give the pool more tokens (PagePool.from_model(model, max_tokens=...), "
                    "patch(model, max_tokens=...), or astrai-hf run --max-tokens), or run fewer rows or new tokens")
        elif hint:
            msg += ("; give the pool more request rows (PagePool.from_model(model, max_reqs=...), "
                    "patch(model, max_reqs=...), or astrai-hf run --max-reqs), or run fewer rows")
        super().__init__(msg)
