"""The ``req_to_token`` table: for each request row, the slot of each of its tokens (SGLang's ReqToTokenPool)."""

from __future__ import annotations

import torch

from .errors import CacheFullError
from .storage import TRASH_PAGE


class ReqToTokenPool:
    """``table[req_idx, i]`` is the slot of token ``i`` of the sequence held in row ``req_idx``.

    Entries at or past a row's length point at the trash page (slot 0), so a padded gather never reads a freed slot.
    ``token_ids[req_idx, i]`` records the token id stored at that position where it is known (the prefix cache keys
    finished rows by it); entries past what a cache has recorded are meaningless.

    Row ``trash_row`` (one past the last usable row) is never handed out and always points at the trash slot: batch
    rows that only pad a fixed-size batch (graph buckets) read it.

    Args:
        max_reqs: usable rows.
        max_seq_len: tokens per row.
        device: where the table lives (the first layer's device).
    """

    def __init__(self, max_reqs: int, max_seq_len: int, device: torch.device):
        self.max_reqs, self.max_seq_len, self.device = max_reqs, max_seq_len, device
        self.trash_row = max_reqs
        self.table = torch.full((max_reqs + 1, max_seq_len), TRASH_PAGE, dtype=torch.int32, device=device)
        self.token_ids = torch.zeros((max_reqs + 1, max_seq_len), dtype=torch.int32, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, num: int) -> list[int]:
        """Take ``num`` rows.

        Raises:
            CacheFullError: fewer than ``num`` rows are free (nothing is taken then).
        """
        if num > len(self._free):
            raise CacheFullError(num, len(self._free), unit="request rows", detail=f"max_reqs={self.max_reqs}")
        return [self._free.pop() for _ in range(num)]

    def free(self, rows: list[int]) -> None:
        """Return rows, resetting them to the trash slot."""
        if not rows:
            return
        self.table[torch.tensor(rows, dtype=torch.long, device=self.device)] = TRASH_PAGE
        self._free.extend(reversed(rows))

    def write(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """``table[rows[i], cols[i]] = slots[i]``; all three [N] int64 on the table's device."""
        self.table.index_put_((rows, cols), slots.to(self.table.dtype))

    def write_ids(self, rows: torch.Tensor, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """``token_ids[rows[i], cols[i]] = ids[i]``; all three [N] on the table's device."""
        self.token_ids.index_put_((rows, cols), ids.to(self.token_ids.dtype))

    def copy_rows(self, src: list[int], dst: list[int], width: int) -> None:
        """Copy the first ``width`` entries (slots and token ids) of rows ``src`` onto rows ``dst``."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.table[d, :width] = self.table[s, :width]
        self.token_ids[d, :width] = self.token_ids[s, :width]

    def clear_from(self, row: int, start: int) -> None:
        """Point ``table[row, start:]`` back at the trash slot (after a crop)."""
        self.table[row, start:] = TRASH_PAGE
