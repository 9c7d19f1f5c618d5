"""StepMetadata: what one forward step of a PagedCache hands to storage writes and to paged attention."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

# K/V slots one more gather-and-attend call is worth (see StepMetadata.buckets): about what a CPU reads in the
# fixed cost of a call; 0 splits rows whenever it saves a slot
BUCKET_CALL_COST = 256


@dataclass(eq=False)
class TableWrites:
    """A decode step's ``req_to_token`` and token-id entries, planned on the host and not written yet.

    Attributes:
        req_to_token: the pool's ``ReqToTokenPool``.
        host: [4, B] int64 on the host, whose rows are each batch row's new slot (``slot_mapping``), table row
            (``req_rows``), tokens after the step (``seq_lens``) and column of the new token (``prev_lens``).
        input_ids: [B, 1], the step's token ids (on the model's device).
    """

    req_to_token: object
    host: torch.Tensor
    input_ids: torch.Tensor


@dataclass(eq=False)
class StepMetadata:
    """The plan of one forward step over a batch of rows, built on the host before any layer runs.

    Conventions: the input is a left-padded rectangle of ``q_len`` columns; in row ``r`` the last ``num_new[r]``
    columns are real tokens, the others padding. Token indices count real tokens only (padding is never stored).

    Attributes:
        q_len: query columns of this step.
        prev_lens: [B] host ints, tokens stored per row before this step.
        seq_lens: [B] host ints, tokens stored per row after this step.
        logical_len: rectangle width after this step (``generate()``'s view of the cache length, padding included).
        paged: True when attention reads the pool (patched model); False when ``update()`` must hand stock
            attention rectangular K/V.
        table: the pool's ``req_to_token`` table, [max_reqs + 1, max_seq_len] int32 (the last row is the trash row).
        req_rows: [B] int64 on the table's device, the table row of each batch row.
        slot_mapping: [N] int64 on the table's device, destination slot of each real new token.
        write_src: [N] int64, index of each real new token in the flattened ``[B * q_len]`` input, or None when
            every column is real.
        group: input rows per stored row: with ``group > 1`` runs of ``group`` identical input rows (a prompt
            expanded for ``num_return_sequences`` / beams) share one stored row, and only the first row of each run
            is written.
        qo_lens: None for a rectangular step. For a *packed* step (see :meth:`pack`) the new tokens of each row,
            which the query holds back to back as one sequence ``[1, sum(qo_lens)]`` (``qo_indptr`` is their
            running sum, as in FlashInfer's ragged layout); rows, ``prev_lens`` and ``seq_lens`` then list only
            the rows that have queries.
        row_starts: None, or per row the slot of its token 0 when its ``seq_lens[r]`` tokens occupy consecutive
            slots (``[start, start + seq_lens[r])``), else None. Attention may then read the row's K/V as a view
            of the pool instead of gathering them through the table.
        decode_indices: None, or for a step of one new token per row ``slot_mapping``, ``req_rows`` and
            ``seq_lens`` as the rows of one [3, B] int64 tensor on the table's device, sent with the step's other
            indices (decode attention reads the lengths there; the graph workspace takes all three in one copy);
            on the host while the step is ``deferred``.
        deferred: None, or the :class:`TableWrites` of a decode step planned for a graph replay, which writes them
            from its workspace; ``req_rows`` and ``slot_mapping`` are None until :meth:`send` (which :meth:`on`
            calls) writes them another way. A step replayed from a graph keeps them None.
    """

    q_len: int
    prev_lens: list[int]
    seq_lens: list[int]
    logical_len: int
    paged: bool
    table: torch.Tensor
    req_rows: torch.Tensor
    slot_mapping: torch.Tensor
    write_src: torch.Tensor | None
    group: int = 1
    qo_lens: list[int] | None = None
    row_starts: list[int | None] | None = None
    decode_indices: torch.Tensor | None = None
    deferred: TableWrites | None = None
    _views: dict = field(default_factory=dict, repr=False)

    def send(self) -> None:
        """Write a deferred step's table entries and token ids, and send its indices to the table's device (one
        host-to-device copy); a no-op for a step that deferred nothing."""
        writes = self.deferred
        if writes is None:
            return
        table = writes.req_to_token
        sent = writes.host.to(table.device, non_blocking=True)
        slots, rows, _, cols = sent
        table.write(rows, cols, slots)
        table.write_ids(rows, cols, writes.input_ids.reshape(-1).to(table.device))
        self.slot_mapping, self.req_rows, self.decode_indices = slots, rows, sent[:3]
        self.deferred = None

    @property
    def is_packed(self) -> bool:
        return self.qo_lens is not None

    @property
    def qo_indptr(self) -> list[int]:
        """[R + 1] host ints: where each row's queries start in a packed step (rectangular: multiples of q_len)."""
        lens = self.qo_lens if self.qo_lens is not None else [self.q_len] * len(self.seq_lens)
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out

    def in_place_spans(self, sliding_window: int | None) -> list[tuple[int, int, int]]:
        """For the rows of this step that add one token and sit in consecutive slots: ``(row, lo, hi)``, the
        slots ``[lo, hi)`` of the keys the new token sees (the last ``sliding_window`` tokens with a window).
        Built once per step and window, on the host."""
        key = ("in_place", sliding_window)
        spans = self._views.get(key)
        if spans is None:
            spans = []
            if self.row_starts is not None:
                for r, (start, p, s) in enumerate(zip(self.row_starts, self.prev_lens, self.seq_lens)):
                    if start is not None and s == p + 1:
                        lo = max(0, s - sliding_window) if sliding_window is not None else 0
                        spans.append((r, start + lo, start + s))
            self._views[key] = spans
        return spans

    def pack(self) -> "StepMetadata":
        """This step with its padding dropped: the real new tokens of every stored row back to back.

        With ``group > 1`` only the first row of each run is kept. ``slot_mapping`` already lists the new tokens
        row by row, so it is the packed order as it is. Built once per step.
        """
        packed = self._views.get("packed")
        if packed is None:
            packed = self._views["packed"] = self._pack()
        return packed

    def _pack(self) -> "StepMetadata":
        g = self.group
        prev, seq = self.prev_lens[::g], self.seq_lens[::g]
        return StepMetadata(
            q_len=sum(s - p for p, s in zip(prev, seq)),
            prev_lens=prev,
            seq_lens=seq,
            logical_len=self.logical_len,
            paged=True,
            table=self.table,
            req_rows=self.req_rows[::g],
            slot_mapping=self.slot_mapping,
            write_src=None,
            qo_lens=[s - p for p, s in zip(prev, seq)],
            row_starts=None if self.row_starts is None else self.row_starts[::g],
        )

    def chunk(self, start: int, end: int) -> "StepMetadata":
        """Packed tokens ``[start, end)`` of a packed step as a step of their own (chunked prefill).

        Rows without a token in the range are left out; a row cut by ``start`` resumes where the previous chunk
        stopped (its ``prev_lens`` counts the tokens of earlier chunks).
        """
        if self.qo_lens is None:
            raise ValueError("only a packed step can be cut into chunks; call pack() first")
        rows, prev, seq, lens = [], [], [], []
        offset = 0
        for r, n in enumerate(self.qo_lens):
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                rows.append(r)
                prev.append(self.prev_lens[r] + lo - offset)
                seq.append(self.prev_lens[r] + hi - offset)
                lens.append(hi - lo)
            offset += n
        index = torch.tensor(rows, dtype=torch.long, device=self.req_rows.device)
        return StepMetadata(
            q_len=end - start,
            prev_lens=prev,
            seq_lens=seq,
            logical_len=self.logical_len,
            paged=True,
            table=self.table,
            req_rows=self.req_rows.index_select(0, index),
            slot_mapping=self.slot_mapping[start:end],
            write_src=None,
            qo_lens=lens,
            row_starts=None if self.row_starts is None else [self.row_starts[r] for r in rows],
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def max_len(self) -> int:
        """Longest row after this step, in tokens (at least 1)."""
        return max(max(self.seq_lens), 1)

    def buckets(self, call_cost: int | None = None, max_buckets: int = 4) -> list[tuple[list[int], "StepMetadata"]]:
        """Rows split into groups of similar length, each with the metadata of its rows alone.

        Gathering a ``[B, max_len]`` rectangle reads K/V for ``B * max_len`` slots; rows sorted by length and cut
        into at most ``max_buckets`` runs read ``sum(rows_g * max_len_g)``. The cut minimises that plus
        ``call_cost`` slots per extra run (one more gather and attention call). One bucket when no cut pays.
        Built once per step.
        """
        found = self._views.get("buckets")
        if found == "whole":
            return [(list(range(len(self.seq_lens))), self)]
        if found is not None:
            return found
        call_cost = BUCKET_CALL_COST if call_cost is None else call_cost
        B = len(self.seq_lens)
        order = sorted(range(B), key=lambda r: self.seq_lens[r])
        lens = [max(self.seq_lens[r], 1) for r in order]
        # best[k][j]: cheapest cost of the first j sorted rows in k runs; a run ending at row j - 1 costs n * lens[j - 1]
        inf = float("inf")
        best = [[inf] * (B + 1) for _ in range(max_buckets + 1)]
        cut = [[0] * (B + 1) for _ in range(max_buckets + 1)]
        best[0][0] = 0
        for k in range(1, max_buckets + 1):
            for j in range(1, B + 1):
                for i in range(k - 1, j):
                    c = best[k - 1][i] + (j - i) * lens[j - 1] + call_cost * (k > 1)
                    if c < best[k][j]:
                        best[k][j], cut[k][j] = c, i
        k = min(range(1, max_buckets + 1), key=lambda k: best[k][B])
        runs, j = [], B
        while k:
            i = cut[k][j]
            runs.append(order[i:j])
            j, k = i, k - 1
        if len(runs) == 1:  # (kept as a mark: a list holding this step, kept by it, would be a reference cycle)
            self._views["buckets"] = "whole"
            return [(list(range(B)), self)]
        found = self._views["buckets"] = [(sorted(rows), self.select(sorted(rows))) for rows in reversed(runs)]
        return found

    def select(self, rows: list[int]) -> "StepMetadata":
        """The step restricted to ``rows`` (for attention only: ``slot_mapping`` is dropped)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.req_rows.device)
        return StepMetadata(
            q_len=self.q_len,
            prev_lens=[self.prev_lens[r] for r in rows],
            seq_lens=[self.seq_lens[r] for r in rows],
            logical_len=self.logical_len,
            paged=self.paged,
            table=self.table,
            req_rows=self.req_rows.index_select(0, index),
            slot_mapping=self.slot_mapping[:0],
            write_src=None,
            row_starts=None if self.row_starts is None else [self.row_starts[r] for r in rows],
        )

    def on(self, device: torch.device) -> "DeviceView":
        """The step's index tensors on ``device`` (built once per device and step)."""
        if self.deferred is not None:
            self.send()
        view = self._views.get(device)
        if view is None:
            view = self._views[device] = DeviceView(self, device)
        return view


class DeviceView:
    """Per-device index tensors of a step, built lazily so a single-device model builds each once per step."""

    def __init__(self, meta: StepMetadata, device: torch.device):
        # (weakly: the step keeps its views, and a cycle between them would leave each step's index tensors to the
        # garbage collector, which servers may run rarely or turn off)
        self.meta, self.device = weakref.proxy(meta), device
        self.slot_mapping = meta.slot_mapping.to(device, non_blocking=True)
        self.write_src = None if meta.write_src is None else meta.write_src.to(device, non_blocking=True)
        self._kv_slots = None
        self._rect_slots = None
        self._q_index = None
        self._rows_index = None
        self._req_rows = None
        self._seq_lens_t = None
        self._masks: dict = {}

    @property
    def req_rows(self) -> torch.Tensor:
        """[B] int64 on this device: the ``req_to_token`` row of each batch row."""
        if self._req_rows is None:
            self._req_rows = self.meta.req_rows.to(self.device, non_blocking=True)
        return self._req_rows

    @property
    def seq_lens_t(self) -> torch.Tensor:
        """[B] int64 on this device: ``meta.seq_lens``, tokens per row after this step."""
        if self._seq_lens_t is None:
            sent = self.meta.decode_indices
            sent = torch.tensor(self.meta.seq_lens) if sent is None else sent[2]
            self._seq_lens_t = sent.to(self.device, non_blocking=True)  # (no copy where it was sent)
        return self._seq_lens_t

    def rows_index(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as an int64 tensor on this device, built once."""
        if self._rows_index is None:
            self._rows_index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self._rows_index

    @property
    def kv_slots(self) -> torch.Tensor:
        """[B * T] int64: slot of token t of row b at ``b * T + t`` with T = ``meta.max_len``; trash past a row's end."""
        if self._kv_slots is None:
            m = self.meta
            self._kv_slots = m.table[m.req_rows, : m.max_len].to(self.device, torch.long).reshape(-1)
        return self._kv_slots

    @property
    def rect_slots(self) -> torch.Tensor:
        """[B * W] int64 with W = ``meta.logical_len``: the rectangle stock attention expects, each row's tokens
        right-aligned behind its padding columns, which read the (zero) trash slot."""
        if self._rect_slots is None:
            m = self.meta
            slots, _ = rect_slots(m.table, m.req_rows, m.seq_lens, m.logical_len)
            self._rect_slots = slots.to(self.device, torch.long).reshape(-1)
        return self._rect_slots

    @property
    def q_index(self) -> torch.Tensor:
        """[B, q_len] int64: token index of each query column, -1 for padding columns."""
        if self._q_index is None:
            m = self.meta
            q = m.q_len
            prev = torch.tensor(m.prev_lens, dtype=torch.long)
            new = torch.tensor([s - p for s, p in zip(m.seq_lens, m.prev_lens)], dtype=torch.long)
            col = torch.arange(q)[None, :]
            first = (q - new)[:, None]
            self._q_index = torch.where(col >= first, prev[:, None] + col - first, -1).to(self.device)
        return self._q_index

    def row_masks(self, sliding_window: int | None, *, need_explicit: bool = False) -> list:
        """Packed step: per row, ``(mask, is_causal)`` for its ``qo_lens[r]`` queries over its ``seq_lens[r]`` keys,
        mask [1, 1, n, T_r] bool or None (then ``is_causal`` tells whether a top-left causal mask is exact)."""
        key = ("rows", sliding_window, need_explicit)
        if key not in self._masks:
            m, out = self.meta, []
            for n, prev, seq in zip(m.qo_lens, m.prev_lens, m.seq_lens):
                no_window = sliding_window is None or seq <= sliding_window
                if (prev == 0 or n == 1) and no_window and not need_explicit:
                    out.append((None, prev == 0 and n > 1))  # one query sees every key; or plain causal
                    continue
                qi = torch.arange(prev, seq, device=self.device)[:, None]
                t = torch.arange(seq, device=self.device)[None, :]
                allowed = t <= qi
                if sliding_window is not None:
                    allowed &= t > qi - sliding_window
                out.append((allowed[None, None], False))
            self._masks[key] = out
        return self._masks[key]

    def mask(self, sliding_window: int | None, *, need_explicit: bool = False):
        """Attention mask for paged attention over ``[B, T]`` gathered keys.

        Returns:
            ``(mask, is_causal)``: mask is None or [B, 1, q_len, T] bool (True = attend). ``is_causal`` is True only
            when mask is None and a plain top-left causal mask is exact (no cached prefix, no padding). With
            ``need_explicit`` the mask is always materialised.
        """
        key = (sliding_window, need_explicit)
        if key in self._masks:
            return self._masks[key]
        m = self.meta
        T, q = m.max_len, m.q_len
        uniform = all(s == T for s in m.seq_lens) and all(p == T - q for p in m.prev_lens)
        no_window = sliding_window is None or T <= sliding_window
        result = None
        if uniform and no_window and not need_explicit:
            if q == 1:
                result = (None, False)
            elif T == q:
                result = (None, True)
        if result is None:
            qi = self.q_index[:, :, None]  # [B, q, 1]
            t = torch.arange(T, device=self.device)[None, None, :]
            allowed = t <= qi
            if sliding_window is not None:
                allowed &= t > qi - sliding_window
            allowed[..., 0] |= qi[..., 0] < 0  # padding queries attend to one key; their output is never used
            result = (allowed[:, None], False)
        self._masks[key] = result
        return result


def rect_slots(table: torch.Tensor, req_rows, seq_lens, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rectangle stock attention expects, as slots of the pool: ``(slots, padding)``, both [B, width] on the
    table's device, ``slots`` int32 with each row's ``seq_lens[b]`` tokens right-aligned behind its padding
    columns, which read slot 0 (the trash page), and ``padding`` bool, True at those columns.

    Args:
        table: ``req_to_token`` [max_reqs + 1, max_seq_len] int32.
        req_rows: the rows' request rows (B ints); seq_lens: their stored tokens (B ints, at most ``width``).
    """
    seq = torch.tensor(seq_lens, dtype=torch.long, device=table.device)
    col = torch.arange(width, device=table.device)[None, :] - (width - seq)[:, None]  # [B, W] token index
    padding = col < 0
    return table[req_rows].gather(1, col.clamp(min=0)).masked_fill(padding, 0), padding
