"""PagedCache: the ``transformers.Cache`` that ``generate()`` talks to; K/V live in a shared PagePool."""

from __future__ import annotations

import weakref

import torch
from transformers import Cache

from .errors import CacheFullError
from .metadata import StepMetadata
from .pool import PagePool


class _Rows:
    """The pages and ``req_to_token`` rows one cache holds. Kept apart from the cache so that a finaliser can
    return them without keeping the cache alive."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.req_rows: list[int] = []
        self.pages: list[list[int]] = []

    def release(self) -> None:
        pool = self.pool
        for pages in self.pages:
            pool.allocator.decref(pages)
        pool.req_to_token.free(self.req_rows)
        self.req_rows, self.pages = [], []


class PagedCache(Cache):
    """A ``transformers.Cache`` whose K/V live in the pages of a :class:`PagePool`; padding is never stored.

    Works on any model whose attention calls ``cache.update``: on an unpatched model ``update()`` returns the
    rectangular K/V that stock attention (sdpa / eager) expects, gathered from the pool; on a model patched with
    :func:`astrai_hf.patch` attention reads the pool directly.

    ``generate()`` sees a left-padded rectangle of ``logical_len`` columns (what ``get_seq_length()`` reports); row
    ``r`` stores only its real tokens, ``seq_lens[r] = logical_len - num_pad[r]`` of them.

    Args:
        pool: where the K/V go.
        input_ids: [B, L] int64, optional: the prompt, to check its length against the pool up front.
        attention_mask: [B, L] 0/1, optional: the prompt's left padding. Without it the padding is read from the
            2D attention mask of a patched forward, else from ``position_ids`` (transformers >= 5.24), else every
            column is stored.

    Raises:
        TypeError: ``pool`` is not a PagePool.
        ValueError: the prompt is longer than ``pool.max_seq_len`` or ``attention_mask`` is not left-padded.
    """

    is_compileable = False  # True makes generate() build 4D masks and torch.compile the forward
    is_croppable = True

    def __init__(self, pool: PagePool, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None):
        # Cache.__init__ is not called: it requires per-layer objects, and this cache keeps none.
        if not isinstance(pool, PagePool):
            raise TypeError(f"PagedCache needs a PagePool, got {type(pool).__name__}")
        self.pool = pool
        self.num_layers = pool.num_layers
        self.logical_len = 0
        self._rows = _Rows(pool)
        self._finalizer = weakref.finalize(self, self._rows.release)
        self._num_pad: list[int] | None = None
        self._prompt_pads: list[int] | None = None
        self._step: StepMetadata | None = None
        self._step_layers: set[int] = set()
        self._pending_q = 0
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
            pads = [0] * input_ids.shape[0]
            if attention_mask is not None:
                pads = left_padding(attention_mask)
            longest = input_ids.shape[1] - min(pads)
            if longest > pool.max_seq_len:
                raise ValueError(
                    f"the prompt has {longest} tokens, more than the pool's max_seq_len={pool.max_seq_len}"
                )
            if attention_mask is not None:
                self._prompt_pads = pads

    # ------------------------------------------------------------------ views
    @property
    def seq_lens(self) -> list[int]:
        """Tokens stored per row (padding excluded)."""
        if self._num_pad is None or not self._rows.req_rows:
            return []
        return [max(0, self.logical_len - p) for p in self._num_pad]

    @property
    def num_pages(self) -> int:
        """Page references this cache holds (a page shared by two rows counts twice)."""
        return sum(len(p) for p in self._rows.pages)

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self._rows.req_rows)}, seq_lens={self.seq_lens}, logical_len={self.logical_len})"

    # ------------------------------------------------------------------ planning
    def plan_step(
        self,
        batch_size: int,
        q_len: int,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        paged: bool = False,
    ) -> StepMetadata:
        """Allocate slots for one forward step of ``q_len`` columns and record where each real token goes.

        Called by the patched forward before the model runs (``paged=True``), or by the first ``update()`` of a
        forward on an unpatched model.

        Args:
            batch_size: rows B of the input.
            q_len: columns of the input.
            position_ids: [B or 1, q_len], optional, to find left padding on the first step.
            attention_mask: [B, logical_len + q_len] 0/1, optional, the same.
            paged: attention reads the pool (patched model).

        Raises:
            CacheFullError: the pool has too few free pages or request rows; the cache is released first.
            ValueError: a row would exceed ``max_seq_len`` or the batch size changed; the cache is released first.
        """
        try:
            step = self._plan(batch_size, q_len, position_ids, attention_mask, paged)
        except (CacheFullError, ValueError):
            self.release()
            raise
        self._step, self._step_layers = step, set()
        return step

    def _plan(self, B, q, position_ids, attention_mask, paged) -> StepMetadata:
        rows, pool = self._rows, self.pool
        ps = pool.page_size
        if self._num_pad is None:
            self._num_pad = self._find_padding(B, q, position_ids, attention_mask)
        if rows.req_rows and B != len(rows.req_rows):
            if B % len(rows.req_rows):
                raise ValueError(f"the cache holds {len(rows.req_rows)} rows but the input has {B}")
            self.batch_repeat_interleave(B // len(rows.req_rows))
        elif len(self._num_pad) != B:
            if B % len(self._num_pad):
                raise ValueError(f"the cache expects {len(self._num_pad)} rows but the input has {B}")
            n = B // len(self._num_pad)
            self._num_pad = [p for p in self._num_pad for _ in range(n)]
        start, end = self.logical_len, self.logical_len + q
        if (
            attention_mask is not None
            and attention_mask.dim() == 2
            and attention_mask.shape == (B, end)
            and any(start <= p for p in self._num_pad)
        ):
            # a row with no token stored yet (chunked prefill of long padding) may have more padding than the
            # first chunk showed: re-read it from the wider mask
            fresh = left_padding(attention_mask)
            self._num_pad = [f if start <= p else p for p, f in zip(self._num_pad, fresh)]
        prev = [max(0, start - p) for p in self._num_pad]
        seq = [max(0, end - p) for p in self._num_pad]
        for r, s in enumerate(seq):
            if s > pool.max_seq_len:
                raise ValueError(
                    f"row {r} would hold {s} tokens, more than the pool's max_seq_len={pool.max_seq_len}"
                )
        if not rows.req_rows:
            rows.req_rows = pool.req_to_token.alloc(B)
            rows.pages = [[] for _ in range(B)]
        alloc = pool.allocator
        cow = [
            seq[r] > prev[r] and prev[r] % ps != 0 and alloc.ref_count(rows.pages[r][prev[r] // ps]) > 1
            for r in range(B)
        ]
        needed = sum(-(-seq[r] // ps) - len(rows.pages[r]) + cow[r] for r in range(B))
        if needed > alloc.num_free:
            raise CacheFullError(
                needed, alloc.num_free, 0,
                detail=f"{B} rows, step of {q} tokens, page_size={ps}, num_pages={alloc.num_usable}",
            )
        w_rows, w_cols, w_slots, new_slots, src = [], [], [], [], []
        for r in range(B):
            pages, p0, s0 = rows.pages[r], prev[r], seq[r]
            if s0 == p0:
                continue
            first = p0
            if cow[r]:
                old = pages[p0 // ps]
                (new,) = alloc.alloc(1)
                pool.storage.copy_page_prefix(old, new, p0 % ps)
                alloc.decref([old])
                pages[p0 // ps] = new
                first = p0 - p0 % ps  # the copied tokens get new slots in the table too
            grow = -(-s0 // ps) - len(pages)
            if grow > 0:
                pages.extend(alloc.alloc(grow))
            slots = [pages[i // ps] * ps + i % ps for i in range(first, s0)]
            w_rows.extend([rows.req_rows[r]] * len(slots))
            w_cols.extend(range(first, s0))
            w_slots.extend(slots)
            new_slots.extend(slots[p0 - first :])
            base = r * q + q - (s0 - p0)
            src.extend(range(base, base + s0 - p0))
        dev = pool.req_to_token.device
        if w_slots:
            pool.req_to_token.write(
                torch.tensor(w_rows, dtype=torch.long, device=dev),
                torch.tensor(w_cols, dtype=torch.long, device=dev),
                torch.tensor(w_slots, dtype=torch.long, device=dev),
            )
        slot_mapping = torch.tensor(new_slots, dtype=torch.long, device=dev)
        all_real = len(src) == B * q
        write_src = None if all_real else torch.tensor(src, dtype=torch.long, device=dev)
        self.logical_len = end
        return StepMetadata(
            q_len=q,
            prev_lens=prev,
            seq_lens=seq,
            logical_len=end,
            paged=paged,
            table=pool.req_to_token.table,
            req_rows=torch.tensor(rows.req_rows, dtype=torch.long, device=dev),
            slot_mapping=slot_mapping,
            write_src=write_src,
        )

    def _find_padding(self, B, q, position_ids, attention_mask) -> list[int]:
        """Left-padding columns per row, from the best source available on the first step."""
        width = self.logical_len + q
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] == width:
            return left_padding(attention_mask)
        if self._prompt_pads is not None:
            return list(self._prompt_pads)
        if position_ids is not None and self.logical_len == 0 and position_ids.dim() == 2:
            last = position_ids[:, -1].tolist()
            pads = [max(0, q - (int(p) + 1)) for p in last]
            return pads * B if len(pads) == 1 and B > 1 else pads
        return [0] * B

    # ------------------------------------------------------------------ Cache contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this step's K/V of one layer.

        Args:
            key_states, value_states: [B, num_kv_heads, q_len, head_dim] in the pool's dtype, on the layer's device.
            layer_idx: the layer.
            kwargs: transformers >= 5.24 passes the layer's kwargs as ``kwargs=``; its ``position_ids`` locate the
                padding when the cache was not told.

        Returns:
            On a patched model the inputs, unchanged (paged attention reads the pool). Otherwise K and V of every
            column so far, [B, num_kv_heads, logical_len, head_dim], padding columns zero, for stock attention.

        Raises:
            ValueError / TypeError: the K/V do not fit the pool (layer, heads, head_dim, device, dtype).
            CacheFullError: the pool is full (see :meth:`plan_step`).
        """
        step = self._step
        if step is None or layer_idx in self._step_layers:
            layer_kwargs = kwargs.get("kwargs")
            if layer_kwargs is None and args and isinstance(args[0], dict):
                layer_kwargs = args[0]
            position_ids = layer_kwargs.get("position_ids") if isinstance(layer_kwargs, dict) else None
            B, _, q, _ = key_states.shape
            step = self.plan_step(B, q, position_ids=position_ids, paged=False)
        self._pending_q = 0
        self._step_layers.add(layer_idx)
        self._check_layer(layer_idx, key_states)
        view = step.on(key_states.device)
        B, H, q, D = key_states.shape
        k = key_states.transpose(1, 2).reshape(B * q, H, D)
        v = value_states.transpose(1, 2).reshape(B * q, H, D)
        if view.write_src is not None:
            k, v = k.index_select(0, view.write_src), v.index_select(0, view.write_src)
        storage = self.pool.storage
        storage.write(layer_idx, view.slot_mapping, k, v)
        if step.paged:
            return key_states, value_states
        width = step.logical_len
        keys = storage.k[layer_idx].index_select(0, view.rect_slots).view(B, width, H, D).transpose(1, 2)
        values = storage.v[layer_idx].index_select(0, view.rect_slots).view(B, width, H, D).transpose(1, 2)
        return keys, values

    def _check_layer(self, layer_idx: int, key_states: torch.Tensor) -> None:
        cfg = self.pool.config
        try:
            if not 0 <= layer_idx < cfg.spec.num_layers:
                raise ValueError(f"layer_idx={layer_idx} is outside this pool's {cfg.spec.num_layers} layers")
            _, H, _, D = key_states.shape
            if (H, D) != (cfg.spec.num_kv_heads, cfg.spec.head_dim):
                raise ValueError(
                    f"layer {layer_idx} produced K/V with {H} heads x head_dim {D}, but the pool stores "
                    f"{cfg.spec.num_kv_heads} x {cfg.spec.head_dim}; build the pool with PagePool.from_model(model)"
                )
            if key_states.dtype != cfg.dtype:
                raise TypeError(f"layer {layer_idx} produced K/V in {key_states.dtype}, but the pool stores {cfg.dtype}")
            if key_states.device != cfg.layer_devices[layer_idx]:
                raise ValueError(
                    f"layer {layer_idx} runs on {key_states.device}, but the pool keeps its K/V on "
                    f"{cfg.layer_devices[layer_idx]}"
                )
        except (ValueError, TypeError):
            self.release()
            raise

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of the rectangle generate() has fed so far (padding included)."""
        return self.logical_len - self._pending_q

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older releases pass cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers  # non-empty on purpose: all([]) would make generate() skip prefix slicing

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_initialized(self) -> bool:
        return bool(self._rows.req_rows)

    @property
    def batch_size(self) -> int:
        return len(self._rows.req_rows) or -1

    def __len__(self) -> int:
        return self.num_layers

    def activate_past_recording(self) -> None:
        pass

    # ------------------------------------------------------------------ row operations
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``. Pages are shared (ref counts), not copied."""
        self._select_rows(torch.as_tensor(beam_idx).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times in place (``num_return_sequences`` / beams on a pre-filled cache)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        n = len(self._rows.req_rows) or len(self._num_pad or ())
        self._select_rows([i for i in range(n) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        """Keep the rows at ``indices`` (a sequence or 1-D tensor of row indices)."""
        self._select_rows(torch.as_tensor(indices).reshape(-1).tolist())

    def _select_rows(self, idx: list[int]) -> None:
        self._step = None
        rows, pool = self._rows, self.pool
        n_old = len(rows.req_rows)
        if self._num_pad is not None:
            bad = [i for i in idx if not -len(self._num_pad) <= i < len(self._num_pad)]
            if bad:
                raise ValueError(f"row indices {bad} are out of range for a cache of {len(self._num_pad)} rows")
            self._num_pad = [self._num_pad[i] for i in idx]
        if self._prompt_pads is not None and n_old == 0:
            self._prompt_pads = [self._prompt_pads[i] for i in idx]
        if n_old == 0:
            return
        old_rows = rows.req_rows
        extra = pool.req_to_token.alloc(len(idx) - n_old) if len(idx) > n_old else []
        new_rows = (old_rows + extra)[: len(idx)]
        width = max(max(self.seq_lens, default=0), 1)
        table = pool.req_to_token.table
        dev = table.device
        src = table[torch.tensor([old_rows[i] for i in idx], dtype=torch.long, device=dev), :width]
        table[torch.tensor(new_rows, dtype=torch.long, device=dev), :width] = src
        new_pages = [list(rows.pages[i]) for i in idx]
        for pages in new_pages:
            pool.allocator.incref(pages)
        for pages in rows.pages:
            pool.allocator.decref(pages)
        pool.req_to_token.free(old_rows[len(idx):])
        rows.req_rows, rows.pages = new_rows, new_pages

    def crop(self, max_length: int) -> None:
        """Drop the last ``-max_length`` columns (transformers 5.x: a count <= 0); a positive value keeps that
        many columns (transformers 4.x meaning)."""
        self._step = None
        keep = self.logical_len + max_length if max_length <= 0 else min(max_length, self.logical_len)
        if keep >= self.logical_len:
            return
        keep = max(keep, 0)
        self.logical_len = keep
        rows, pool, ps = self._rows, self.pool, self.pool.page_size
        for r, pages in enumerate(rows.pages):
            n = max(0, keep - self._num_pad[r])
            drop = pages[-(-n // ps):]
            if drop:
                del pages[-(-n // ps):]
                pool.allocator.decref(drop)
            pool.req_to_token.clear_from(rows.req_rows[r], n)

    def reset(self) -> None:
        """Empty the cache (pages go back to the pool); it can be used again."""
        self.release()

    def release(self) -> None:
        """Return every page and request row to the pool. Safe to call more than once."""
        self._rows.release()
        self.logical_len = 0
        self._num_pad = None
        self._step = None
        self._step_layers = set()
        self._pending_q = 0

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def left_padding(attention_mask: torch.Tensor) -> list[int]:
    """Leading zero columns per row of a [B, L] 0/1 mask.

    Raises:
        ValueError: a row has a zero after a one (right or inner padding), which a paged cache cannot express.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq_len], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.to(torch.bool)
    pads = (~mask).sum(-1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= pads[:, None]
    if not torch.equal(mask, expected):
        bad = (mask != expected).any(-1).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {bad} are not left-padded (zeros must come before all ones); "
            "use tokenizer.padding_side = 'left'"
        )
    return pads.tolist()
