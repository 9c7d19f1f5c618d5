"""PagedCache: the ``transformers.Cache`` that ``generate()`` talks to; K/V live in a shared PagePool."""

from __future__ import annotations

import copy
import logging
import operator
import warnings
import weakref
from typing import NamedTuple

import torch
from transformers import Cache

from .config import as_count, as_flag, as_int, rope_depends_on_length
from .distributed import agree
from .errors import CacheFullError
from .metadata import StepMetadata, TableWrites, rect_slots
from .pool import PagePool, has_caller_hooks
from .storage import gather_kv


def _positive_crop_refused() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 18)


_POSITIVE_CROP_REFUSED = _positive_crop_refused()  # DynamicCache.crop(n > 0) raises from transformers 5.18 on

logger = logging.getLogger(__name__)


class HeldTokens(NamedTuple):
    """The columns a stock cache holds after a ``generate()`` call, as the released cache a patched call returned
    records them, so that a later call given it continues them (see ``patch.py``).

    ``ids``: [B, L] int64, the tokens the columns were computed from; ``mask``: [B, L], their attention mask;
    ``embeds``: [B, E, hidden] or None, the embeddings the first ``E <= L`` columns were computed from (a call fed
    ``inputs_embeds``: no token id stands for them, and ``ids`` holds placeholders there), a copy detached from
    the caller's tensor."""

    ids: torch.Tensor
    mask: torch.Tensor
    embeds: torch.Tensor | None = None

    def rows(self, idx: list[int]) -> HeldTokens:
        """The rows ``idx`` (``batch_select_indices``, ``reorder_cache``, ``batch_repeat_interleave``)."""
        rows = torch.tensor(idx, dtype=torch.long)
        return HeldTokens(*(None if t is None else t[rows.to(t.device)] for t in self))

    def columns(self, keep: int) -> HeldTokens:
        """The first ``keep`` columns (``crop``)."""
        return HeldTokens(*(None if t is None else t[:, :keep] for t in self))


class _Rows:
    """The pages and ``req_to_token`` rows one cache holds. Kept apart from the cache so that a finaliser can
    return them without keeping the cache alive.

    ``known[r]``: leading tokens of row ``r`` whose K/V is complete in every layer and whose token ids are recorded
    in ``req_to_token.token_ids``; their full pages go to the prefix cache on release.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.req_rows: list[int] = []
        self.pages: list[list[int]] = []
        self.known: list[int] = []
        # reserved[r]: pages taken for row r's next tokens, following its last page, not yet holding any token
        self.reserved: list[list[int]] = []
        self.insert_on_release = True  # offer the pages to the prefix cache on release
        self.epoch: int | None = None  # the prefix cache's epoch when these rows were first written
        # whether every step stored K/V as generate() would compute them for these token ids: False after a step
        # under active dropout; a device bool (read at release only) after steps at positions of the caller's own
        self.reusable: bool | torch.Tensor = True

    def release(self) -> None:
        pool = self.pool
        if pool is None:  # (the rows of a returned cache, which hold nothing and let their pool go)
            return
        with pool.books():
            try:
                # rows written before the prefix cache was last cleared (the pool bound to another model, or the
                # weights changed) hold K/V no later prompt may reuse
                if (pool.prefix_cache is not None and self.insert_on_release and self.epoch == pool.prefix_cache.epoch
                        and bool(self.reusable)):
                    self._insert_into_prefix_cache()
            finally:
                # the rows are emptied before anything is returned: a release that fails midway may leak, but it
                # never returns a page twice (the finaliser calls release again)
                pages, req_rows = self.pages, self.req_rows
                self.req_rows, self.pages, self.known, self.reusable = [], [], [], True
                try:
                    self.drop_reserved()
                finally:
                    try:
                        pool.allocator.decref([p for row in pages for p in row])
                    finally:
                        pool.req_to_token.free(req_rows)

    def drop_reserved(self) -> None:
        """Give the reserved pages back to the pool (the rows keep what they hold)."""
        reserved, self.reserved = self.reserved, [[] for _ in self.req_rows]
        self.pool._reservations.discard(self)
        self.pool.allocator.decref([p for row in reserved for p in row])

    def take(self, r: int, num: int) -> list[int]:
        """``num`` pages for row ``r``'s next tokens: its reserved pages first, then any free ones."""
        pages = self.reserved[r][:num]
        del self.reserved[r][:num]
        if len(pages) < num:
            pages += self.pool.allocator.alloc(num - len(pages))
        return pages

    def contiguous_starts(self) -> list[int | None]:
        """Per row, the slot of its token 0 when all its pages are consecutive page ids (its tokens then occupy
        consecutive slots), else None."""
        ps = self.pool.page_size
        return [pages[0] * ps if _consecutive(pages) else None for pages in self.pages]

    def _insert_into_prefix_cache(self) -> None:
        todo = [(r, n) for r, n in enumerate(self.known) if n > 0]
        if not todo:
            return
        width = max(n for _, n in todo)
        table = self.pool.req_to_token
        rows = torch.tensor([self.req_rows[r] for r, _ in todo], dtype=torch.long, device=table.device)
        ids = table.token_ids[rows, :width].tolist()
        for (r, n), row_ids in zip(todo, ids):
            self.pool.prefix_cache.insert(row_ids[:n], self.pages[r])


def _release_when_collected(rows: _Rows) -> None:
    """The finaliser of a cache nobody released: return its rows now, or, when another thread holds the pool's
    books or this thread is in the middle of changing them (the garbage collector runs finalisers at any
    allocation), leave them to the pool, which returns them as soon as the books are consistent
    (:meth:`PagePool.release_later`). A finaliser never waits for a lock: the thread it runs in may hold another
    (a logging handler's) that the books' holder wants."""
    pool = rows.pool
    if pool is None:
        return
    if not pool.books_lock.acquire(blocking=False):
        pool.release_later(rows)
        return
    try:
        if pool.books_depth:
            pool.release_later(rows)
        else:
            rows.release()
    finally:
        pool.books_lock.release()


PATCH_STATE_ATTR = "_astrai_patch_state"  # where patch() keeps a patched model's state (on the model's __dict__)


def autocast_on(pool: PagePool) -> bool:
    """Whether ``torch.autocast`` is on for a device type the pool's layers are on (a type autocast does not know,
    such as meta, has it off)."""
    for device_type in pool.device_types:
        try:
            if torch.is_autocast_enabled(device_type):
                return True
        except RuntimeError:
            continue
    return False


def forget_rope_deltas(model: torch.nn.Module) -> None:
    """Drop the M-RoPE offsets (``rope_deltas``, Qwen2-VL and its kin) that ``model``'s modules keep from their last
    call, before a text call starts from a cache the prefix cache pre-filled.

    transformers adds the kept offsets to the positions of any call whose cache is not empty, as for a conversation
    continued on its own cache; stock starts every other call empty and recomputes them (zeros for text). A cache
    pre-filled from the prefix cache is not empty, so without this the offsets of an earlier call (an image's, or a
    batch of another size) would shift the positions. With them dropped, the model computes this call's own.
    """
    for module in model.modules():
        if isinstance(vars(module).get("rope_deltas"), torch.Tensor):
            module.rope_deltas = None


class PagedCache(Cache):
    """A ``transformers.Cache`` whose K/V live in the pages of a :class:`PagePool`; padding is never stored.

    Works on any model whose attention calls ``cache.update``: on an unpatched model ``update()`` returns the
    rectangular K/V that stock attention (sdpa / eager) expects, gathered from the pool; on a model patched with
    :func:`astrai_hf.patch` attention reads the pool directly.

    ``generate()`` sees a left-padded rectangle of ``logical_len`` columns (what ``get_seq_length()`` reports); row
    ``r`` stores only its real tokens, ``seq_lens[r] = logical_len - num_pad[r]`` of them.

    Prefix cache: given the prompt, the cache looks each row up in the pool's prefix cache at once and starts
    pre-filled with the longest prefix every row has cached (``get_seq_length()`` then tells ``generate()`` to
    compute only the rest; the last prompt token is always computed). When the cache is released, the pages of
    every row (prompt and generated tokens whose ids it saw, the partly filled tail page included) are offered to
    the prefix cache.

    Args:
        pool: where the K/V go.
        input_ids: [B, L] int64, optional: the prompt. Its length is checked against the pool, and it is matched
            against the prefix cache. Used without ``patch()``, the cache cannot see the forward's inputs and takes
            the K/V it stores for the prompt to be these ids': for a call that feeds ``inputs_embeds`` or token
            types in their place, build it without ``input_ids`` or with ``prefix_cache=False`` (a patched
            ``generate()`` sees them and leaves the prefix cache itself).
        attention_mask: [B, L] 0/1, optional: the prompt's left padding. Without it a one-row prompt is taken as
            unpadded; a batch without it is not matched, and its padding is read from the 2D attention mask of a
            patched forward, else from ``position_ids`` (transformers >= 5.24), else every column is stored.
        prefix_cache: take part in the pool's prefix cache: look the prompt up, and offer the pages to it on
            release (default True; no effect on a pool built with ``prefix_cache=False``).
        reserve_new_tokens: tokens each row is expected to grow past its prompt (a patched ``generate()`` passes
            its number of new tokens). A row's first pages are taken as one run of consecutive page ids, and with
            this set, the run also covers that many more tokens, or an even share per row of the free pages
            when they do not hold that many (free pages only: nothing cached is evicted for it). A row whose
            tokens sit in consecutive slots is read by attention as a view of the pool, without a gather. Reserved
            pages count as used; they return to the pool on release, when rows are reordered, selected or
            cropped, and whenever a step of any cache finds the pool short (before a cached prefix is evicted or
            ``CacheFullError`` raised) (default 0).
        model: the model this cache will serve, checked against the pool before the prompt is looked up
            (:meth:`PagePool.check_weights`), so that prefixes cached by another model sharing the pool, or by
            weights changed since, are not reused. Default: the pool's bound model, which catches changed weights;
            on a patched model, a cache pre-filled for another model is refused at its first forward.

    Raises:
        TypeError: ``pool`` is not a PagePool, ``model`` not a ``torch.nn.Module``, ``prefix_cache`` not a bool,
            ``input_ids`` not an integer tensor.
        ValueError: ``input_ids`` is not [batch, seq_len] or has no row, the prompt is longer than
            ``pool.max_seq_len``, ``attention_mask`` is not left-padded, has a row of zeros or does not have the
            shape of ``input_ids``, ``reserve_new_tokens`` is not a non-negative int.
        CacheFullError: a prefix hit needs more request rows than the pool has free.
        ValueError, at the first forward of a patched model: this cache was pre-filled with prefixes computed by
            another model, or by weights changed since (the cache is released first).
    """

    is_compileable = False  # True makes generate() build 4D masks and torch.compile the forward
    stock_attention = False  # a patched model runs its own attention on this cache (set for output_attentions)
    verifies_candidates = False  # set by a patched generate() running prompt lookup or assisted decoding
    # set by a patched generate() whose peft adapters act per row (patch.peft_adapters_by_row): every forward runs on
    # the rows as fed (prefills neither packed nor chunked, decode steps not padded to a graph bucket)
    rows_as_fed = False
    made_by_generate = False  # set on the cache a patched generate() makes for itself (and releases)
    returned_by_generate = False  # set when that generate() has returned: the cache is released for good
    _prompt_width = None  # columns of the prompt the cache was built with (input_ids.shape[1])
    # what a stock cache would hold after that generate() (see patch.py)
    held_tokens: HeldTokens | None = None
    # the DynamicCache a call given this returned cache continued on (a mask with a hole): later calls given this
    # cache continue it (patch.py), and the methods below act on it, as on stock's cache
    stock_cache = None
    returned_len = 0  # the columns the cache held when that generate() returned (for one that recorded no tokens)
    returned_rows = 0  # and its rows (moved by the row operations below)
    _grad_step = None  # the last step that stored K/V while autograd recorded it (their graph is not kept)
    _warned_grad = False
    is_croppable = True

    def __init__(
        self,
        pool: PagePool,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        prefix_cache: bool = True,
        reserve_new_tokens: int = 0,
        model: torch.nn.Module | None = None,
        _held_columns: int = 0,
    ):
        # Cache.__init__ is not called: it requires per-layer objects, and this cache keeps none.
        if not isinstance(pool, PagePool):
            raise TypeError(f"PagedCache needs a PagePool, got {type(pool).__name__}")
        self.reserve_new_tokens = as_count("reserve_new_tokens", reserve_new_tokens, 0)
        prefix_cache = as_flag("prefix_cache", prefix_cache)
        self.pool = pool
        self.num_layers = pool.num_layers
        self._num_storing_layers = len(pool.config.spec.stored_layers)  # layers that call update() per step
        self.logical_len = 0
        self._rows = _Rows(pool)
        self._rows.insert_on_release = self._wants_prefix_cache = prefix_cache  # (see rejoin_prefix_cache())
        self._finalizer = weakref.finalize(self, _release_when_collected, self._rows)
        self._num_pad: list[int] | None = None
        self._prompt_pads: list[int] | None = None
        self._prompt_ids: list[list[int]] | None = None
        self._first_step_planned = False
        self._step: StepMetadata | None = None
        self._step_layers: set[int] = set()
        self._step_shape: tuple[int, int] | None = None  # (rows, tokens) of the K/V the step's first layer stored
        self._pending_known: list[int] | None = None
        self._pending_q = 0
        self.prefix_hit_tokens: list[int] = []
        self._hit_model_key: tuple | None = None  # the pool's held_model_key() when the prefix hits were matched
        self.checked_model: int | None = None  # id() of the model a patched forward last checked this cache for
        self.step_saw_positions = False
        self._pads_on_device: tuple | None = None  # ((num_pad, B, device), [B] tensor) for _note_positions
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if input_ids is None:
            return
        for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__} (a tokenizer gives "
                                "tensors with return_tensors='pt')")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        B, L = input_ids.shape
        if B == 0:
            raise ValueError(f"input_ids of shape {(B, L)} holds no prompt; pass at least one row")
        if L == 0:
            raise ValueError(f"input_ids of shape {(B, L)} holds no prompt; pass at least one token per row")
        pads = [0] * B
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, L):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {(B, L)}; they must match"
                )
            check_rows_have_tokens(attention_mask)
            pads = left_padding(attention_mask)
        longest = L - min(pads)
        if longest > pool.max_seq_len:
            raise ValueError(f"the prompt has {longest} tokens, more than the pool's max_seq_len={pool.max_seq_len}")
        if attention_mask is None and B > 1:
            return
        self._prompt_pads, self._num_pad = pads, list(pads)
        self._prompt_ids = [row[p:] for row, p in zip(input_ids.tolist(), pads)]
        self._prompt_width = L
        target = model if model is not None else pool.model
        if prefix_cache:
            from .packing import ids_outside_vocabulary
            from .patch import peft_adapters_by_row

            # an id outside the vocabulary (masked padding too): stock's forward of the prompt fails on it; a hit
            # would leave those columns unfed. A RoPE whose frequencies follow the forward's length rotated a cached
            # prefix for another forward than the one stock runs over the whole prompt; an activated LoRA adapts the
            # tokens after the prompt's last invocation sequence, a position each prompt sets anew.
            if rope_depends_on_length(target) or pool.rope_by_length or (
                    target is not None and peft_adapters_by_row(target) is not None):
                prefix_cache = self._rows.insert_on_release = self._wants_prefix_cache = False
            elif ids_outside_vocabulary(target, input_ids):
                prefix_cache = self._rows.insert_on_release = False
        if prefix_cache and autocast_on(pool):  # (plan_step keeps a step under autocast out of the prefix cache)
            prefix_cache = False
        if prefix_cache and pool.prefix_cache is not None and L > 1:
            if target is not None:
                pool.check_weights(target)  # another model's K/V, or weights changed in place: no stale hits
                self.checked_model = id(target)
            # hooks of the caller's see, in stock, the whole prompt of a fresh call, and the columns after those of
            # the cache an earlier call returned (_held_columns, a patched generate() says): they may act on a
            # position by its index in the forward, or record every position they are shown
            limit = _held_columns if target is not None and has_caller_hooks(target) else None
            try:
                if limit != 0:
                    self._match_prefix(pads, L, limit)
                if target is not None and self.prefilled_from_prefix_cache and PATCH_STATE_ATTR not in vars(target):
                    # a model used without patch(): nothing sees the call start, so the cache drops them now (a
                    # patched generate() drops them when the call that uses the cache starts)
                    forget_rope_deltas(target)
            except BaseException:
                # (a Ctrl-C or an error before anyone holds this cache: only its finaliser would return the rows
                # and pages it matched, and a traceback the caller keeps, as a notebook does, keeps it alive)
                self.release()
                raise

    @property
    def prefilled_from_prefix_cache(self) -> bool:
        """True while this cache holds only what the prefix cache served (no step has run on it). Columns served
        stay served when the rows kept by a row selection hold none of their tokens (only padding there)."""
        return not self._first_step_planned and self.logical_len > 0

    def rejoin_prefix_cache(self) -> None:
        """Offer this cache's K/V to the prefix cache on release again, as built (``prefix_cache=``), when it holds
        none: a cache that left it for one call (:meth:`leave_prefix_cache`) and has been emptied since. K/V stored
        in a call that left it are never offered, however many calls continue on them. A patched ``generate()``
        calls it for a cache of the caller's in a call that can read and fill the prefix cache."""
        if not self._rows.req_rows:
            self._rows.insert_on_release = self._wants_prefix_cache

    def leave_prefix_cache(self) -> None:
        """Neither build on the prefix cache nor fill it: a cache that was pre-filled from it and has run no step
        yet drops its hit and starts empty, keeping the prompt (the pages stay cached), and no K/V this cache holds
        are offered to it on release. A patched ``generate()`` calls it for a cache of the caller's when the call
        can neither read nor fill the prefix cache (candidate decoding, inputs_embeds or token types, outputs of
        every prompt position, autocast, dropout in training mode; see the README's prefix-cache section)."""
        self._rows.insert_on_release = False
        if self.prefilled_from_prefix_cache:
            self._rows.release()
            self.logical_len = 0
            self.prefix_hit_tokens = [0] * len(self.prefix_hit_tokens)

    def fit_to(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Make this cache fit a ``generate()`` call on ``input_ids`` [B, W], the whole sequence so far (or only the
        new tokens, with ``attention_mask`` covering the whole sequence, which generate() then reads so). A patched
        ``generate()`` calls it for a cache of the caller's; tokens are compared where the cache recorded their ids
        (a forward fed ``inputs_embeds`` records none).

        - A cache holding as many columns as ``input_ids`` or more (the same cache passed again with the same
          prompt): stock then slices the prompt by a negative count. The cache is cut back to the columns the
          prompt starts with, leaving at least the last to compute, so the call returns what a fresh cache gives.
        - A cache of fewer rows than ``input_ids`` (a shared prompt computed once): its rows are shared by the
          input rows that start with their tokens, ``B / rows`` each (stock raises on the row count), cut back as
          above where the prompt is no longer than the cache.
        - A prompt longer than the cache is left to use the cache's K/V for its first columns, as stock does,
          whatever tokens it has there.

        A row padded otherwise than the cache's row (read from ``attention_mask``) differs from its first column.

        Returns:
            the columns kept (``get_seq_length()`` after the call).

        Raises:
            ValueError: input rows meant to share a row of the cache do not start with its tokens.
        """
        L, rows = self.logical_len, self._rows
        if not rows.req_rows or not L or input_ids.dim() != 2 or self._num_pad is None:
            return L
        B, W = input_ids.shape
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] != W:
            return L
        held = len(rows.req_rows)
        if B % held:
            return L  # (planning the step raises, naming both counts)
        row_of = [i // (B // held) for i in range(B)]
        pads = None  # the prompt's own padding, where its mask tells it
        if attention_mask is not None and attention_mask.dim() == 2:
            pads = _broadcast_rows(left_padding(attention_mask), B)
        if B != held:
            unknown = [r for r, (k, p) in enumerate(zip(rows.known, self._num_pad)) if k < L - p]
            if unknown:
                raise ValueError(
                    f"this PagedCache holds {held} row(s) and input_ids has {B} rows; they may share its rows only "
                    f"where they start with its tokens, and it did not record the tokens of row(s) {unknown} (it "
                    "records those generate() feeds, and those of a patched model's forward fed input_ids under "
                    "torch.no_grad()). Build the cache for the whole batch"
                )
        if W > L:
            if B == held:
                return L
            agree, b = self._agreeing_columns(input_ids, row_of, L, pads)
            if agree < L:
                raise ValueError(
                    f"this PagedCache holds {held} row(s) of {L} columns and input_ids has {B} rows, {B // held} per "
                    f"row of the cache, which they may share only where they start with its tokens (and padding): "
                    f"row {b} differs at column {agree}. Build the cache for the whole batch, or pass a fresh "
                    "PagedCache(pool)"
                )
            return L
        keep, _ = self._agreeing_columns(input_ids, row_of, W - 1, pads)
        logger.debug("PagedCache: kept %d of its %d columns for a prompt of %d columns", keep, L, W)
        if keep <= 0:
            self.reset()
        else:
            self.crop(keep - L)
        return self.logical_len

    def _agreeing_columns(self, input_ids: torch.Tensor, row_of, limit: int,
                          pads: list[int] | None = None) -> tuple[int, int | None]:
        """``(columns, b)``: up to which column (at most ``limit``) each input row ``b``, left-padded by ``pads[b]``
        columns where given, holds the padding and tokens recorded for cache row ``row_of[b]``, and the first input
        row that differs there (None where all agree)."""
        token_ids, rows = self.pool.req_to_token.token_ids, self._rows
        agree, first = limit, None
        for b, r in enumerate(row_of):
            pad = self._num_pad[r]
            if pads is not None and pads[b] != pad and min(pads[b], pad) < agree:
                agree, first = min(pads[b], pad), b  # padded otherwise: the columns differ from the first token on
            n = min(rows.known[r], agree - pad)
            if n <= 0:
                continue
            held = token_ids[rows.req_rows[r], :n].to(input_ids.device)
            differs = (held != input_ids[b, pad : pad + n].to(held.dtype)).nonzero()
            if len(differs):
                agree, first = pad + int(differs[0]), b
        return agree, first

    def check_prefix_hits(self) -> None:
        """Raise if the prefixes this cache started with were dropped from the prefix cache since it matched them:
        the pool was bound to another model or saw the weights change (:meth:`PagePool.check_weights`), so their
        K/V may not be what this model computes. The cache is released first.

        Raises:
            ValueError: as above.
        """
        hit, pc = sum(self.prefix_hit_tokens), self.pool.prefix_cache
        if not hit or pc is None or self._rows.epoch is None or self._rows.epoch == pc.epoch:
            return
        if self._hit_model_key is not None and self._hit_model_key == self.pool.held_model_key():
            # cleared by a turn of another model on the pool (a call from this call's streamer), which the pool
            # has been taken back from: the pages this cache holds are still this model's K/V
            self._rows.epoch = pc.epoch
            return
        self.release()
        raise ValueError(
            f"this PagedCache started with {hit} prompt tokens from the prefix cache, which has been cleared since "
            "because the pool now serves another model or the weights changed: those K/V may not be this model's. "
            "Build the cache right before generate() with PagedCache(pool, input_ids, attention_mask, model=model), "
            "or let the patched generate() make its own"
        )

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

    # ------------------------------------------------------------------ prefix cache
    def _match_prefix(self, pads: list[int], width: int, limit: int | None = None) -> None:
        """Start pre-filled with the longest prefix all rows have in the pool's prefix cache.

        ``generate()`` reads one cached length for the whole left-padded batch, so row ``r`` reuses
        ``P - pads[r]`` tokens where ``P = min_r(pads[r] + hit[r])``, capped at ``width - 1`` so that the last
        prompt column is computed and yields logits, and at ``limit`` columns where given. A partly used page is
        shared until the row writes into it, then copied (copy-on-write).
        """
        pool, ps = self.pool, self.pool.page_size
        rows = self._rows
        with pool.books():  # (another thread's allocation must not evict the matched pages before they are held)
            pool.make_room_for_rows(len(pads))  # (before the match: a garbage cache released adds to the prefixes)
            hits = [pool.prefix_cache.match(ids) for ids in self._prompt_ids]
            logical = min(min(p + n for p, (_, n) in zip(pads, hits)), width - 1, width if limit is None else limit)
            use = [max(0, logical - p) for p in pads]
            pool.counters["prefix_query_tokens"] += sum(len(ids) for ids in self._prompt_ids)
            self.prefix_hit_tokens = use
            logger.debug("prefix cache: %d rows, reusing %s tokens (cached prefixes %s)", len(pads), use,
                         [n for _, n in hits])
            if not any(use):
                return
            shared = [list(pages[: -(-u // ps)]) for (pages, _), u in zip(hits, use)]
            req_rows = pool.req_to_token.alloc(len(pads))
            rows.req_rows, rows.reserved = req_rows, [[] for _ in req_rows]  # held before anything else can fail
            pool.allocator.incref([p for pages in shared for p in pages])  # locked before this call allocates
            rows.pages, rows.known = shared, list(use)
            rows.epoch = pool.prefix_cache.epoch
            pool.counters["prefix_hit_tokens"] += sum(use)
        self._hit_model_key = pool.held_model_key() if self.checked_model is not None else None
        w_rows, w_cols, w_slots, w_ids = [], [], [], []
        for r, u in enumerate(use):
            pages = rows.pages[r]
            w_rows.extend([req_rows[r]] * u)
            w_cols.extend(range(u))
            w_slots.extend(pages[i // ps] * ps + i % ps for i in range(u))
            w_ids.extend(self._prompt_ids[r][:u])
        table = pool.req_to_token
        dev = table.device
        r_t = torch.tensor(w_rows, dtype=torch.long, device=dev)
        c_t = torch.tensor(w_cols, dtype=torch.long, device=dev)
        table.write(r_t, c_t, torch.tensor(w_slots, dtype=torch.long, device=dev))
        table.write_ids(r_t, c_t, torch.tensor(w_ids, dtype=torch.long, device=dev))
        self._num_pad = list(pads)
        self.logical_len = logical

    # ------------------------------------------------------------------ planning
    def plan_step(
        self,
        batch_size: int,
        q_len: int,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        paged: bool = False,
        given_positions: torch.Tensor | None = None,
        defer_writes: bool = False,
        rows_differ: bool = False,
    ) -> StepMetadata:
        """Allocate slots for one forward step of ``q_len`` columns and record where each real token goes.

        Called by the patched forward before the model runs (``paged=True``), or by the first ``update()`` of a
        forward on an unpatched model.

        Args:
            batch_size: rows B of the input.
            q_len: columns of the input.
            position_ids: [B or 1, q_len], optional, to find left padding on the first step.
            attention_mask: [B, logical_len + q_len] 0/1, optional, the same.
            input_ids: [B, q_len], optional: the step's token ids, recorded for the prefix cache. On a patched
                model, when the cache holds fewer rows than the input and each group of input rows is identical
                (``num_return_sequences`` / beams expanding a prompt), one copy per group is stored and shared.
            paged: attention reads the pool (patched model).
            given_positions: the ``position_ids`` the caller passed, where ``position_ids`` is left out for
                finding padding (default: ``position_ids``); they tell a pre-filled cache's continuation from its
                prompt fed again.
            defer_writes: a step of one new token per row (with ``input_ids``, no page copied) keeps its
                ``req_to_token`` and token-id entries and its indices on the host (``StepMetadata.deferred``): a
                decode graph writes them from its workspace, anything else calls ``step.send()`` (``step.on()``
                does). Saves a decode step replayed from a graph the launches of those writes.
            rows_differ: rows may differ beyond their ids and mask (an image per row fed with them): each input
                row is computed and stored, none shared with an identical one.

        Raises:
            CacheFullError: the pool has too few free (or evictable) pages or request rows; the cache is released
                first.
            ValueError: a row would exceed ``max_seq_len``, the batch size changed, or the padding differs from the
                prompt's the cache was built with; the cache is released first, except where a row holding
                tokens would exceed ``max_seq_len``: that step is refused before anything changes, and the cache
                keeps its columns.

        Under tensor parallelism (a pool bound to a ``tp_plan`` model) the ranks agree on the outcome with one
        all-reduce of 5 integers: when planning fails on any rank, every rank releases its cache and raises (see
        :meth:`astrai_hf.distributed.RankGroup.agree`), so none is left waiting in the model's next collective.
        """
        if given_positions is None:
            given_positions = position_ids
        if (not self._first_step_planned and self.logical_len
                and self._refeeds_prompt(q_len, input_ids, given_positions, attention_mask, paged)):
            # (assisted and prompt-lookup generate() on an unpatched model feed the whole prompt themselves)
            continuation = (
                "for new columns that repeat the prompt's tokens, pass an attention_mask over every column or their "
                "position_ids" if paged else
                f"an unpatched model's cache cannot tell {q_len} new columns after the cached ones from the prompt "
                "fed again: it sees neither their ids nor whether their positions were given; for those, build the "
                "cache with prefix_cache=False, or patch the model")
            unpatched = "" if paged else (
                "; assisted and prompt-lookup generate() on an unpatched model feed the whole prompt whatever the "
                "cache holds: for them, build the cache with prefix_cache=False, or patch the model")
            raise ValueError(
                f"this PagedCache starts pre-filled with {self.logical_len} of the prompt's {q_len} columns from the "
                f"prefix cache, and the first forward feeds all {q_len} again (they would be stored twice); feed "
                "input_ids[:, cache.get_seq_length():], as generate() does, or build the cache with prefix_cache=False "
                f"({continuation}){unpatched}"
            )
        if (not paged and not self._first_step_planned and self.logical_len and given_positions is None
                and self._prompt_width is not None and q_len > self._prompt_width):
            # (an unpatched model whose layers hand update() no positions: transformers before 5.24, GPT-NeoX)
            raise ValueError(
                f"this PagedCache starts pre-filled with {self.logical_len} of the prompt's {self._prompt_width} "
                f"columns from the prefix cache, and the first forward feeds {q_len} columns, more than the prompt "
                "holds, as assisted and prompt-lookup generate() do on an unpatched model (the whole prompt again "
                "with draft tokens: its columns would be stored twice); this model's layers hand the cache no "
                "positions, so it cannot tell that from new columns after the cached ones: build the cache with "
                "prefix_cache=False, or patch the model"
            )
        if self.prefilled_from_prefix_cache and not self.made_by_generate:
            self._check_prefilled_positions(q_len, given_positions, paged)
        if autocast_on(self.pool):
            # K/V computed under torch.autocast are rounded to its dtype: no prefix for a later call, and a prefix
            # computed without it is not what stock computes for the whole prompt under it
            pads = self._prompt_pads
            if self.prefilled_from_prefix_cache and (pads is None or any(p < self.logical_len for p in pads)):
                # (rows whose served columns are all their padding hold no K/V computed without autocast)
                raise ValueError(
                    f"this PagedCache starts pre-filled with {self.logical_len} columns from the prefix cache, "
                    "computed without torch.autocast, and its first forward runs under autocast (stock computes the "
                    "whole prompt in autocast's dtype); build the cache with prefix_cache=False for this call"
                )
            self._rows.reusable = False
        step, failed = None, None
        refused = self._past_max_seq_len(q_len)  # (before anything changes: the cache keeps what it holds)
        with self.pool.books():
            if refused is None:
                try:
                    step = self._plan(batch_size, q_len, position_ids, attention_mask, input_ids, paged,
                                      defer_writes, rows_differ)
                except BaseException as e:  # an interrupt too: pages taken for this step are in no row yet
                    failed = e
            try:
                agree(self.pool.ranks, failed or refused)
            except BaseException:
                if refused is None:
                    self.release()
                raise
            finally:
                failed = refused = None  # (held by the traceback's frame, they would make a cycle)
        self._step, self._step_layers = step, set()
        self.step_saw_positions = False  # whether the layers passed update() this step's position_ids
        return step

    def _refeeds_prompt(self, q_len: int, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                        attention_mask: torch.Tensor | None = None, paged: bool = True) -> bool:
        """Whether a pre-filled cache's first forward feeds the whole prompt it was built with again, judged by
        what the forward gives, in this order: a mask over the cached columns and these (a continuation);
        positions, [B or 1, q_len], ending where the prompt's own end (the prompt again: the mask's count, or
        ``arange``) or where the columns after the cached ones end (a continuation); the prompt's tokens. A longer
        prompt whose uncached columns happen to be as many, even holding the same tokens, is not refused.

        Unpatched (``paged`` False), positions that continue the cached columns tell nothing: from transformers
        5.24 the layers hand ``update()`` the positions the model counted from ``get_seq_length()`` when the
        caller gave none, which are those for the prompt fed again too; and the ids are not seen."""
        if q_len != self._prompt_width:
            return False
        pads, prompt, L = self._prompt_pads, self._prompt_ids, self.logical_len
        if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                and attention_mask.shape[1] == L + q_len):
            return False  # a mask over the cached columns and these: a continuation
        rows = _positions_per_prompt_row(position_ids, len(pads), q_len)
        if rows is not None:
            last = [row[-1] for row in rows]
            if all(pos in (q_len - 1 - p, q_len - 1) for pos, p in zip(last, pads)):
                return True  # the prompt's own positions
            if (paged or input_ids is not None) and all(pos == L - p + q_len - 1 for pos, p in zip(last, pads)):
                return False  # the positions after the cached columns
        if input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] % len(prompt) == 0:
            group = input_ids.shape[0] // len(prompt)
            rows = input_ids[::group].tolist()
            return all(row[p:] == ids for row, p, ids in zip(rows, pads, prompt))
        return True

    def _check_prefilled_positions(self, q_len: int, position_ids: torch.Tensor | None, paged: bool) -> None:
        """Refuse a first forward of a pre-filled cache that places its tokens at other positions than the ones the
        cached K/V continue: those were computed at the positions ``generate()`` gives a left-padded batch (each
        row's real tokens counted from 0). A forward without ``position_ids`` on a padded batch counts the padding
        instead (the column index); its tokens would follow K/V of another numbering. ``position_ids``: the
        forward's, or (unpatched, transformers 5.24 and later) the ones the layers hand ``update()``; None
        (patched: none passed) is refused only for a padded batch; unknown positions (unpatched, earlier
        releases) are not checked."""
        pads, L = self._prompt_pads, self.logical_len
        if pads is None:
            return
        # (a row whose cached columns are all its padding, p >= L, holds no K/V whose positions could be contradicted)
        if position_ids is None:
            if paged and any(0 < p < L for p in pads):
                bad = "no position_ids (the model then counts the padding columns)"
            else:
                return
        else:
            rows = _positions_per_prompt_row(position_ids, len(pads), q_len)
            if rows is None:
                return
            wrong = [r for r, (row, p) in enumerate(zip(rows, pads))
                     if p < L and any(pos != L - p + j for j, pos in enumerate(row) if L - p + j >= 0)]
            if not wrong:
                return
            whole_prompt = self._prompt_width is not None and q_len >= self._prompt_width
            if not paged and whole_prompt and all(
                    rows[r][0] == 0 or (pads[r] < q_len and rows[r][pads[r]] == 0) for r in wrong):
                raise ValueError(
                    f"this PagedCache starts pre-filled with {L} columns from the prefix cache, and the first forward "
                    f"feeds {q_len} columns from the prompt's first position again (as assisted and prompt-lookup "
                    "generate() do on an unpatched model, which does not slice the prompt by the cache's length): "
                    "build the cache with prefix_cache=False, or patch the model"
                )
            bad = f"positions in rows {wrong} that do not continue them (row {wrong[0]}: {rows[wrong[0]][:6]}...)"
        expected = [max(L - p, 0) for p in pads]
        raise ValueError(
            f"this PagedCache starts pre-filled with {L} columns of a prompt from the prefix cache, "
            "computed at the positions generate() gives (each row's real tokens counted from 0), and the first "
            f"forward gives {bad}; pass position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)"
            f"[:, cache.get_seq_length():] (its rows start at {expected}), or build the cache with prefix_cache=False"
        )

    def mask_has_holes(self, attention_mask: torch.Tensor | None, batch_size: int, q_len: int) -> bool:
        """Whether a step's 2-D ``attention_mask`` [B, logical_len + q_len or wider] masks a column after a row's left
        padding (a finished row fed a pad token with mask 0, a token masked out later), which paged attention,
        masking by each row's stored length alone, cannot apply. Only known once the cache holds a step (a first
        step's mask is checked for holes by :meth:`plan_step`). Reads the mask on the host: a device sync."""
        pads = self._num_pad
        width = self.logical_len + q_len
        if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or pads is None
                or not self._rows.req_rows or attention_mask.shape[1] < width
                or attention_mask.shape[0] not in (1, batch_size) or batch_size % len(pads)):
            return False
        attention_mask = attention_mask[:, :width]  # a mask made at its final width up front: stock cuts it so
        pads = torch.tensor(pads, device=attention_mask.device).repeat_interleave(batch_size // len(pads))
        expected = torch.arange(width, device=attention_mask.device)[None, :] >= pads[:, None]
        return bool((attention_mask.to(torch.bool) != expected).any())

    def _check_padding(self, B, q, position_ids, attention_mask) -> None:
        end = self.logical_len + q
        if self._num_pad is None:
            self._num_pad = self._find_padding(B, q, position_ids, attention_mask)
        elif (
            not self._first_step_planned
            and attention_mask is not None
            and attention_mask.dim() == 2
            and attention_mask.shape[1] == end
            and B % len(self._num_pad) == 0
        ):
            n = B // len(self._num_pad)
            expected = [min(p, end) for p in self._num_pad for _ in range(n)]
            seen = _broadcast_rows(left_padding(attention_mask), B)
            if seen != expected:
                if self.logical_len == 0 and not self._rows.req_rows:
                    self._num_pad, self._prompt_ids, self._prompt_pads = seen, None, None
                else:
                    raise ValueError(
                        f"the attention_mask of the first forward has left padding {seen}, but this cache was built "
                        f"for a prompt with padding {expected}; pass the same attention_mask to PagedCache and "
                        "generate()"
                    )
        self._first_step_planned = True

    def _too_long(self, row: int, tokens: int) -> ValueError:
        hint = (
            "; prompt lookup and assisted decoding store candidate tokens past the generation length before "
            "verifying them, so leave the pool's max_seq_len room for them"
            if self.verifies_candidates else ""
        )
        return ValueError(
            f"row {row} would hold {tokens} tokens, more than the pool's max_seq_len={self.pool.max_seq_len}{hint}"
        )

    def _past_max_seq_len(self, q: int) -> ValueError | None:
        """The error for a step of ``q`` columns that would take a row already holding tokens past the pool's
        ``max_seq_len`` (a draft too long for a speculative loop), found before anything changes: the cache keeps
        its columns, as a stock cache does after a refused forward. Rows with no token yet are checked by
        ``_plan``, where the step's mask may show them more padding."""
        pads, start = self._num_pad, self.logical_len
        over = start + q - self.pool.max_seq_len  # a row of fewer pads than this goes past (none, in most steps)
        if over <= 0 or not start or pads is None or not self._rows.req_rows:
            return None
        for r, p in enumerate(pads):
            if p < start and p < over:
                return self._too_long(r, start + q - p)
        return None

    def _plan(self, B, q, position_ids, attention_mask, input_ids, paged, defer_writes=False,
              rows_differ=False) -> StepMetadata:
        if self.returned_by_generate:
            raise ValueError(
                "this PagedCache is the one a patched generate() returned; it was released when that call ended "
                "(its pages went to the prefix cache), so it holds no K/V to continue from. Pass it, or nothing, to "
                "a patched model's generate() with the whole sequence so far (the prefix cache serves what was "
                "computed), or run your own forward loop on a PagedCache(pool, ...) of your own; an unpatched model "
                "(after unpatch(), or past a patched() block) cannot continue from it: call its generate() without "
                "the cache, which computes the same tokens from the whole sequence"
            )
        rows, pool = self._rows, self.pool
        ps = pool.page_size
        self._check_padding(B, q, position_ids, attention_mask)
        held = len(rows.req_rows) or len(self._num_pad)
        group = 1
        if B != held:
            if B % held:
                raise ValueError(f"the cache holds {held} rows but the input has {B}")
            group = B // held
            # (identical rows computed once; rows fed as embeddings carry no ids to compare, rows fed with images
            # differ beyond them; a hook of the caller's may treat rows apart, a steering strength per sample, and
            # is shown each)
            if not (paged and not rows_differ and input_ids is not None and _grouped(input_ids, group)
                    and _grouped(attention_mask, group)) or (
                    self.pool.model is not None and has_caller_hooks(self.pool.model)):
                self.batch_repeat_interleave(group)
                group = 1
        Bp = B // group  # rows planned (and stored); with group > 1 each is shared by `group` input rows
        start, end = self.logical_len, self.logical_len + q
        if (
            attention_mask is not None
            and attention_mask.dim() == 2
            and attention_mask.shape == (B, end)
            and any(start <= p for p in self._num_pad)
        ):
            # a row with no token stored yet (chunked prefill of long padding) may have more padding than the
            # first chunk showed: re-read it from the wider mask
            fresh = left_padding(attention_mask[::group])
            self._num_pad = [f if start <= p else p for p, f in zip(self._num_pad, fresh)]
        prev = [max(0, start - p) for p in self._num_pad]
        seq = [max(0, end - p) for p in self._num_pad]
        for r, s in enumerate(seq):
            if s > pool.max_seq_len:
                raise self._too_long(r, s)
        if not rows.req_rows:
            pool.make_room_for_rows(Bp)
            rows.req_rows = pool.req_to_token.alloc(Bp)
            rows.epoch = pool.prefix_cache.epoch if pool.prefix_cache is not None else None
            rows.pages = [[] for _ in range(Bp)]
            rows.known = [0] * Bp
            rows.reserved = [[] for _ in range(Bp)]
        alloc = pool.allocator
        cow = self._copies_on_write(prev, seq)
        grows = [max(0, -(-seq[r] // ps) - len(rows.pages[r])) for r in range(Bp)]

        def to_allocate() -> int:  # pages this step takes from the pool (beyond what its rows reserved)
            return sum(max(0, grows[r] - len(rows.reserved[r])) + cow[r] for r in range(Bp))

        needed = to_allocate()
        try:
            try:
                pool.reserve(needed, collect_garbage=not any(cow))
            except CacheFullError:
                # no free page to copy a partly used prefix page into: take such pages over from the prefix cache
                # (a row then appends in place), which leaves the step needing what it would on an empty cache
                # (tried before the garbage collector, which costs a full collection; tried after it otherwise)
                if self._take_over_cow_pages(prev, seq):
                    cow = self._copies_on_write(prev, seq)
                    needed = to_allocate()
                pool.reserve(needed)
            if to_allocate() != needed:  # the pool took this cache's reserved pages back to make room
                needed = to_allocate()
                pool.reserve(needed)
        except CacheFullError as e:
            logger.info("KV pool full: a step of %d x %d tokens needs %d pages, %d free, %d evictable",
                        B, q, e.needed, e.free, e.evictable)
            raise CacheFullError(
                e.needed, e.free, e.evictable,
                detail=f"{B} row{'s' if B != 1 else ''}, step of {q} token{'s' if q != 1 else ''}, page_size={ps}, "
                       f"num_pages={alloc.num_usable}",
            ) from None
        self._reserve_runs(grows, seq, needed, group)
        w_rows, w_cols, w_slots, new_slots, src = [], [], [], [], []
        new_rows, new_cols, id_rows, id_cols, id_vals = [], [], [], [], []
        known = list(rows.known)
        for r in range(Bp):
            pages, p0, s0 = rows.pages[r], prev[r], seq[r]
            if s0 == p0:
                continue
            first = p0
            if p0 % ps and alloc.ref_count(pages[p0 // ps]) > 1:  # copy-on-write (counted in `cow` above)
                old = pages[p0 // ps]
                (new,) = alloc.alloc(1)
                try:
                    pool.storage.copy_page_prefix(old, new, p0 % ps)
                except BaseException:
                    alloc.decref([new])
                    raise
                pages[p0 // ps] = new
                alloc.decref([old])
                first = p0 - p0 % ps  # the copied tokens get new slots in the table too
            if grows[r] > 0:
                pages.extend(rows.take(r, grows[r]))
            slots = [pages[i // ps] * ps + i % ps for i in range(first, s0)]
            req_row = rows.req_rows[r]
            w_rows.extend([req_row] * len(slots))
            w_cols.extend(range(first, s0))
            w_slots.extend(slots)
            new_slots.extend(slots[p0 - first :])
            base = r * group * q + q - (s0 - p0)
            src.extend(range(base, base + s0 - p0))
            new_rows.extend([req_row] * (s0 - p0))
            new_cols.extend(range(p0, s0))
            prompt = self._prompt_ids[r] if self._prompt_ids is not None else None
            if input_ids is not None:
                known[r] = s0 if known[r] == p0 else known[r]
            elif prompt is not None and s0 <= len(prompt) and known[r] == p0:
                id_rows.extend([req_row] * (s0 - p0))
                id_cols.extend(range(p0, s0))
                id_vals.extend(prompt[p0:s0])
                known[r] = s0
        dev = pool.req_to_token.device
        table = pool.req_to_token
        # every index the step sends to the device travels in one host-to-device copy (on an accelerator each copy is
        # a call into the driver, and a decode step replayed from a graph has little else to do on the host)
        ids_from_input = input_ids is not None and bool(new_rows)
        if ids_from_input:  # the token ids of the new columns come from the input, on the device already
            id_rows, id_cols, id_vals = new_rows, new_cols, []
        some_columns = len(src) != B * q  # padding columns: write_src picks the real ones
        one_per_row = group == 1 and q == 1 and len(new_slots) == B  # (one column: every row has its token)
        if defer_writes and one_per_row and len(w_slots) == B and ids_from_input:
            # one new token per row and no page copied: the decode graph writes the table entries itself, from its
            # workspace; the indices stay on the host until the workspace takes them (StepMetadata.send)
            self.logical_len = end
            self._pending_known = known
            host = torch.tensor([new_slots, rows.req_rows, seq, prev], dtype=torch.long)
            return StepMetadata(
                q_len=q, prev_lens=prev, seq_lens=seq, logical_len=end, paged=paged, table=table.table,
                req_rows=None, slot_mapping=None, write_src=None, row_starts=rows.contiguous_starts(),
                decode_indices=host[:3], deferred=TableWrites(table, host, input_ids),
            )
        # (the last three side by side: a step of one new token per row hands them on as one [3, B] block)
        parts = [w_rows, w_cols, w_slots, src if some_columns else [], id_rows, id_cols, id_vals, new_slots,
                 rows.req_rows if group == 1 else [], seq if one_per_row else []]
        staged = torch.tensor([v for part in parts for v in part], dtype=torch.long).to(dev, non_blocking=True)
        (w_rows_t, w_cols_t, w_slots_t, src_t, id_rows_t, id_cols_t, id_vals_t, slot_mapping,
         req_rows, _) = staged.split([len(part) for part in parts])
        if w_slots:
            table.write(w_rows_t, w_cols_t, w_slots_t)
        write_src = src_t if some_columns else None
        if ids_from_input:
            flat = input_ids.reshape(-1).to(dev)
            table.write_ids(id_rows_t, id_cols_t, flat if write_src is None else flat[write_src])
        elif id_rows:
            table.write_ids(id_rows_t, id_cols_t, id_vals_t)
        self.logical_len = end
        if group > 1:
            self._pending_known = None
            self._select_rows([r for r in range(Bp) for _ in range(group)])
            known = [k for k in known for _ in range(group)]
            prev = [p for p in prev for _ in range(group)]
            seq = [s for s in seq for _ in range(group)]
        self._pending_known = known
        return StepMetadata(
            q_len=q,
            prev_lens=prev,
            seq_lens=seq,
            logical_len=end,
            paged=paged,
            table=pool.req_to_token.table,
            # (with group > 1 the rows were just expanded: their table rows are new)
            req_rows=req_rows if group == 1 else torch.tensor(rows.req_rows, dtype=torch.long, device=dev),
            slot_mapping=slot_mapping,
            write_src=write_src,
            group=group,
            row_starts=rows.contiguous_starts(),
            decode_indices=staged[staged.shape[0] - 3 * B:].view(3, B) if one_per_row else None,
        )

    def _cow_pages(self, prev: list[int], seq: list[int]) -> dict[int, list[int]]:
        """``{page: rows}``: the partly used pages this step's rows append into, shared (with the prefix cache,
        another row or another cache), each with the rows that append into it, in order."""
        rows, ps, alloc = self._rows, self.pool.page_size, self.pool.allocator
        shared: dict[int, list[int]] = {}
        for r in range(len(rows.req_rows)):
            if seq[r] > prev[r] and prev[r] % ps:
                page = rows.pages[r][prev[r] // ps]
                if alloc.ref_count(page) > 1:
                    shared.setdefault(page, []).append(r)
        return shared

    def _copies_on_write(self, prev: list[int], seq: list[int]) -> list[bool]:
        """Per row: whether it copies its partly used page before appending. Rows that share a page copy it one
        by one; when they hold every reference to it, the last one appends in place."""
        cow = [False] * len(self._rows.req_rows)
        for page, holders in self._cow_pages(prev, seq).items():
            in_place = self.pool.allocator.ref_count(page) == len(holders)
            for r in holders[:-1] if in_place else holders:
                cow[r] = True
        return cow

    def _take_over_cow_pages(self, prev: list[int], seq: list[int]) -> bool:
        """Unindex from the prefix cache the partly used pages that only this step's rows and the cache hold (with
        their cached continuations, see :meth:`PrefixCache.give_up`), so that the last row appends into each in
        place. Returns whether any page was taken over."""
        cache, alloc = self.pool.prefix_cache, self.pool.allocator
        if cache is None:
            return False
        taken = False
        for page, holders in self._cow_pages(prev, seq).items():
            if alloc.ref_count(page) == len(holders) + 1 and cache.give_up(page):
                taken = True
        if taken:
            logger.debug("KV pool full: took partly used prefix pages over from the prefix cache instead of copying")
        return taken

    def _reserve_runs(self, grows: list[int], seq: list[int], needed: int, group: int) -> None:
        """Give each row that holds no page yet one run of consecutive pages: what this step needs, plus room for
        ``reserve_new_tokens`` more out of the pages free beyond the step's ``needed`` (an even share per row when
        they do not hold all of it). Without such runs, the rows take scattered pages."""
        rows, pool = self._rows, self.pool
        ps, alloc = pool.page_size, pool.allocator
        fresh = [r for r, g in enumerate(grows) if g > 0 and not rows.pages[r] and not rows.reserved[r]]
        if not fresh:
            return
        extra = [0] * len(fresh)
        if self.reserve_new_tokens and group == 1:
            prompts = self._prompt_ids if self._prompt_ids is not None and len(self._prompt_ids) == len(grows) else None
            for i, r in enumerate(fresh):
                prompt = max(seq[r], len(prompts[r]) if prompts is not None else 0)
                total = -(-min(prompt + self.reserve_new_tokens, pool.max_seq_len) // ps)
                extra[i] = max(0, total - grows[r])
            room = alloc.num_free - needed
            if sum(extra) > room:  # not enough free for all of it: an even share each
                extra = [min(e, max(0, room) // len(fresh)) for e in extra]
        runs = alloc.alloc_runs([grows[r] + e for r, e in zip(fresh, extra)])
        if runs is not None and any(extra):
            pool._reservations.add(rows)  # the pool may take the room back when it runs short
        elif runs is None and any(extra):
            runs = alloc.alloc_runs([grows[r] for r in fresh])
        for r, run in zip(fresh, runs or ()):
            rows.reserved[r] = run

    def note_padding(self, attention_mask, batch_size: int, q_len: int) -> None:
        """Before a first forward whose K/V reach the cache through :meth:`update` alone (a patched model running its
        own attention: autograd on, attention weights asked for, dropout, a 4-D mask), read the rows' left padding
        from its ``attention_mask``, which ``update()`` is not given (nor, before transformers 5.24, the positions):
        the padding columns are then not stored as tokens, which the paged steps after would attend. A 2-D mask
        [B, logical_len + q_len] gives each row's leading zeros; a 4-D one [B, 1 or heads, q_len, logical_len +
        q_len] (bool, or additive float) the leading columns no query sees. A no-op once the padding is known, or
        for a mask of another shape."""
        if (self._num_pad is not None or self._first_step_planned or not isinstance(attention_mask, torch.Tensor)
                or attention_mask.dim() not in (2, 4) or attention_mask.shape[-1] != self.logical_len + q_len
                or attention_mask.shape[0] not in (1, batch_size)):
            return
        if attention_mask.dim() == 4:
            seen = attention_mask if attention_mask.dtype == torch.bool else (
                attention_mask > torch.finfo(attention_mask.dtype).min / 2 if attention_mask.is_floating_point()
                else attention_mask.bool())
            seen = seen.any(dim=1).any(dim=1)  # [B, columns]: a column some query of the row sees
        else:
            seen = attention_mask.bool()
        # (a row's leading columns alone: a hole after them is the mask's to apply, as the model's own attention does)
        leading = (seen.long().cumsum(-1) == 0).sum(-1).tolist()
        self._num_pad = _broadcast_rows(leading, batch_size)

    def _note_positions(self, position_ids: torch.Tensor, step: StepMetadata, B: int, q: int) -> None:
        """Keep this cache's tokens out of the prefix cache if a step placed them at positions other than the ones
        ``generate()`` gives them (a forward of the caller's own on a padded batch without ``position_ids``, or
        with positions of its choosing): the prefix cache keys K/V by token ids alone. The comparison stays on
        the device; it is read once, at release."""
        rows = self._rows
        if (rows.reusable is False or self.pool.prefix_cache is None or not rows.insert_on_release
                or position_ids.dim() != 2 or position_ids.shape[-1] != q or position_ids.shape[0] not in (1, B)
                or self._num_pad is None or B % len(self._num_pad)):
            return
        dev = position_ids.device
        key = (tuple(self._num_pad), B, dev)
        if self._pads_on_device is None or self._pads_on_device[0] != key:  # a host-to-device copy once, not per step
            pads = torch.tensor(self._num_pad, device=dev).repeat_interleave(B // len(self._num_pad))
            self._pads_on_device = (key, pads)
        pads = self._pads_on_device[1]
        start = step.logical_len - q
        expected = torch.arange(start, start + q, device=dev)[None, :] - pads[:, None]  # each row's own positions
        ok = ((position_ids == expected) | (expected < 0)).all()  # padding columns may hold anything
        rows.reusable = ok if rows.reusable is True else rows.reusable & ok.to(rows.reusable.device)

    def _find_padding(self, B, q, position_ids, attention_mask) -> list[int]:
        """Left-padding columns per row, from the best source available on the first step."""
        width = self.logical_len + q
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] == width:
            return _broadcast_rows(left_padding(attention_mask), B)
        if self._prompt_pads is not None:
            return list(self._prompt_pads)
        if position_ids is not None and self.logical_len == 0 and position_ids.dim() == 2:
            pads = [_padding_from_positions(row) for row in position_ids.tolist()]
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
            TypeError: K or V is not a tensor, ``layer_idx`` not an int.
            ValueError / TypeError: the K/V do not fit the pool (not 4-D, K and V of different shapes, layer, heads,
                head_dim, device, dtype).
            CacheFullError: the pool is full (see :meth:`plan_step`).
        """
        if not (type(layer_idx) is int and isinstance(key_states, torch.Tensor)
                and isinstance(value_states, torch.Tensor) and key_states.dim() == 4
                and key_states.shape == value_states.shape):
            layer_idx = _checked_update_args(key_states, value_states, layer_idx)
        step = self._step
        first = step is None or layer_idx in self._step_layers or not self._step_layers  # this step's first layer
        position_ids = None
        if first:
            layer_kwargs = kwargs.get("kwargs")
            if layer_kwargs is None and args and isinstance(args[0], dict):
                layer_kwargs = args[0]
            position_ids = layer_kwargs.get("position_ids") if isinstance(layer_kwargs, dict) else None
        if step is None or layer_idx in self._step_layers:
            stopped = self._unfinished_step()
            if stopped is not None:
                # an unfinished step: stock's layers would be of different lengths now; here the missing layers'
                # columns hold nothing
                shape, (rows_done, q_done) = (key_states.shape[0], key_states.shape[2]), self._step_shape
                if shape != self._step_shape:
                    # a new forward of another length, or a second set of K/V in the same forward: the cache is
                    # kept as it is, so that crop() can mend the first case
                    raise ValueError(
                        f"layer {layer_idx} stores K/V of {shape[1]} tokens x {shape[0]} rows while the step of "
                        f"{q_done} x {rows_done} is unfinished. Either the previous forward {stopped}; or this "
                        "forward stores a second set of K/V in a layer (a PagedCache holds the self-attention K/V of "
                        "the rows it was fed: an encoder-decoder model's cross-attention K/V cannot go in it)"
                    )
                raise ValueError(f"the previous forward {stopped}")
            B, _, q, _ = key_states.shape
            step = self.plan_step(B, q, position_ids=position_ids, paged=False)
        if first and position_ids is not None and isinstance(step, StepMetadata):
            # (a decode graph's step takes its positions from the runner's workspace, filled from the forward's
            # position_ids, which the patched forward checks itself; nothing may run on the host inside a capture)
            self.step_saw_positions = True
            if not self.made_by_generate:
                self._note_positions(position_ids, step, key_states.shape[0], key_states.shape[2])
        self._pending_q = 0
        shape = (key_states.shape[0], key_states.shape[2])
        if first:
            self._step_shape = shape
        elif shape != self._step_shape:
            self.release()
            raise ValueError(
                f"layer {layer_idx} stored K/V of {shape[1]} tokens x {shape[0]} rows in a step whose first layer "
                f"stored {self._step_shape[1]} x {self._step_shape[0]}: a PagedCache holds the self-attention K/V "
                "of the rows it was fed (an encoder-decoder model's cross-attention K/V cannot go in it)"
            )
        self._step_layers.add(layer_idx)
        key_states, value_states = self._check_layer(layer_idx, key_states, value_states)
        if self._pending_known is not None and len(self._step_layers) == self._num_storing_layers:
            self._rows.known, self._pending_known = self._pending_known, None  # every layer stored this step
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
        # contiguous, as DynamicCache's torch.cat gives them: attention written by hand (GPT-NeoX-Japanese, models
        # patch() refuses) may .view() them
        keys = gather_kv(storage.k[layer_idx], view.rect_slots, B, width).contiguous()
        values = gather_kv(storage.v[layer_idx], view.rect_slots, B, width).contiguous()
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # The pool is outside autograd: this step's columns are handed back as the live tensors, so gradients
            # reach this step's K/V as with a DynamicCache (K/V stored by earlier forwards are constants).
            earlier = self._grad_step
            if earlier is not None and earlier is not step and width > q and not self._warned_grad:
                self._warned_grad = True
                warnings.warn(
                    "PagedCache: this forward attends to K/V that an earlier forward stored while autograd recorded "
                    "it; the pool keeps them without their graph, so gradients do not flow back through them as "
                    "they do through a DynamicCache's (the loss is the same, the gradients differ). Compute such a "
                    "loss in one forward, or train with a DynamicCache", UserWarning, stacklevel=2)
            self._grad_step = step
            keys = torch.cat([keys[:, :, : width - q], key_states], dim=2)
            values = torch.cat([values[:, :, : width - q], value_states], dim=2)
        return keys, values

    def _check_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Check one layer's K/V [B, H_kv, q, D] against the pool; returns them, cast to the pool's dtype under
        ``torch.autocast`` (where K and V of one layer can come in two dtypes)."""
        cfg = self.pool.config
        if key_states.dtype != cfg.dtype or value_states.dtype != cfg.dtype:
            if torch.is_autocast_enabled(key_states.device.type):
                key_states, value_states = key_states.to(cfg.dtype), value_states.to(cfg.dtype)
        try:
            if not 0 <= layer_idx < cfg.spec.num_layers:
                raise ValueError(f"layer_idx={layer_idx} is outside this pool's {cfg.spec.num_layers} layers (a layer "
                                 "added since the pool was built?); build the pool with PagePool.from_model(model)")
            _, H, _, D = key_states.shape
            if (H, D) != (cfg.spec.num_kv_heads, cfg.spec.head_dim):
                fix = "build the pool with PagePool.from_model(model)"
                if D == cfg.spec.head_dim:  # (a config field the family's attention ignores, e.g. a stray one)
                    fix += (f"; if it was built from this model, the model's config names {cfg.spec.num_kv_heads} "
                            f"KV heads where its attention computes {H} (a num_key_value_heads its family ignores): "
                            f"set model.config.num_key_value_heads = {H} and build the pool again "
                            "(PagePool.from_model(model), or patch(model) again)")
                elif H == cfg.spec.num_kv_heads:  # (a head_dim in the config that the family ignores)
                    fix += (f" (which reads the head size from the attention: a pool built from the config takes its "
                            f"head_dim, {cfg.spec.head_dim}, which this family may ignore)")
                raise ValueError(
                    f"layer {layer_idx} produced K/V with {H} heads x head_dim {D}, but the pool stores "
                    f"{cfg.spec.num_kv_heads} x {cfg.spec.head_dim}; {fix}"
                )
            if not (key_states.is_floating_point() and value_states.is_floating_point()):
                raise TypeError(f"layer {layer_idx} produced K in {key_states.dtype} and V in {value_states.dtype}; "
                                f"K/V must be floating point (the pool stores {cfg.dtype})")
            if key_states.dtype != cfg.dtype or value_states.dtype != cfg.dtype:
                raise TypeError(
                    f"layer {layer_idx} produced K in {key_states.dtype} and V in {value_states.dtype}, but the pool "
                    f"stores {cfg.dtype}; build the pool in the dtype the model computes K/V in, "
                    f"PagePool.from_model(model, dtype={key_states.dtype}) (a pool holds one dtype: a model whose "
                    "layers compute K/V in several, a layer kept in float32, is cast to one first). A model moved to "
                    "another dtype during a call (by another thread, or a streamer or callback) fails this call; a "
                    "pool patch() built follows the move at the next call"
                )
            if key_states.device != cfg.layer_devices[layer_idx]:
                raise ValueError(
                    f"layer {layer_idx} runs on {key_states.device}, but the pool keeps its K/V on "
                    f"{cfg.layer_devices[layer_idx]}"
                )
        except (ValueError, TypeError):
            self.release()
            raise
        return key_states, value_states

    def _unfinished_step(self) -> str | None:
        """How the last step stopped when some layers stored its K/V and others not (an unpatched model whose
        forward raised midway), naming the ``crop()`` that drops it; None when no step is unfinished."""
        step = self._step
        if step is None or step.paged or not self._step_layers or len(self._step_layers) >= self._num_storing_layers:
            return None
        q_done = self._step_shape[1]
        return (f"stopped after {len(self._step_layers)} of {self._num_storing_layers} layers stored their K/V "
                f"(an exception inside the model?), so its {q_done} new column{'s are' if q_done != 1 else ' is'} "
                f"not filled in every layer; call cache.crop(-{q_done}) to drop them before feeding again (a "
                "patched model drops them itself)")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of the rectangle generate() has fed so far (padding included). A layer asking during a forward,
        before it stored that forward's K/V, gets the columns before the forward, as from ``DynamicCache``, whose
        layers fill one by one (Llama 4's NoPE layers scale their queries by positions counted so). A layer index
        past the model's layers, or a cache holding no rows, gets 0, as from ``DynamicCache``. The released cache a
        patched ``generate()`` returned gets the columns stock's returned cache would hold (those it recorded, as
        cut back by :meth:`crop` since; 0 where it recorded none): assisted decoding reads it to crop the cache."""
        if layer_idx >= self.num_layers:
            return 0
        if self.returned_by_generate:
            if self.stock_cache is not None:
                return self.stock_cache.get_seq_length(layer_idx)
            if not self._num_rows():  # (every row dropped: 0, as DynamicCache)
                return 0
            return self.returned_len if self.held_tokens is None else self.held_tokens[0].shape[1]
        if not self._rows.req_rows:  # (every row dropped: 0, as DynamicCache)
            return 0
        step = self._step
        if (step is not None and self._step_layers and layer_idx not in self._step_layers
                and len(self._step_layers) < self._num_storing_layers):
            return self.logical_len - step.q_len
        return self.logical_len - self._pending_q

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Nothing to do: the pool's K/V storage is allocated when the pool is built (``DynamicCache`` allocates its
        layers here instead)."""

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

    @property
    def layers(self) -> tuple["PagedLayer", ...]:
        """One read-only :class:`PagedLayer` per model layer, in the manner of ``DynamicCache.layers``
        (transformers' own code walks them, e.g. ``generate()`` on Apple's MPS when it hands the cache back). Under
        KV sharing (Gemma 3n) a sharing layer's entry shows its source layer's K/V, where ``DynamicCache`` has no
        entry for it."""
        return tuple(PagedLayer(self, i) for i in range(self.num_layers))

    def __iter__(self):
        """``(keys, values, None)`` per layer, as iterating a ``DynamicCache`` gives (each a gathered copy)."""
        for i in range(self.num_layers):
            yield *self.layer_kv(i), None

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as a ``DynamicCache`` holds them: [B, num_kv_heads, logical_len, head_dim] each,
        every row's tokens right-aligned behind its left padding, the padding columns zero. A copy gathered from
        the pool, on the layer's device; [0, num_kv_heads, logical_len, head_dim] while it holds no rows.

        Raises:
            ValueError: ``layer_idx`` is not a layer of the model.
        """
        return self._gathered(layer_idx, "k"), self._gathered(layer_idx, "v")

    def _gathered(self, layer_idx: int, which: str) -> torch.Tensor:
        """One layer's K (``which="k"``) or V of :meth:`layer_kv`."""
        layer_idx = as_int("layer_idx", layer_idx)
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside this cache's {self.num_layers} layers")
        if "pool" not in self.__dict__ and "_empty_kv" in self.__dict__:  # (released, its pool held weakly)
            return self._empty_kv[which][layer_idx].clone()
        layer = getattr(self.pool.storage, which)[layer_idx]
        rows = self._rows
        if not rows.req_rows:  # nothing yet, or every row dropped (logical_len stays, as in DynamicCache)
            return layer.new_zeros(0, layer.shape[1], self.logical_len, layer.shape[2])
        width = self.logical_len
        seq = [max(0, width - p) for p in self._num_pad[: len(rows.req_rows)]]
        slots, padding = rect_slots(self.pool.req_to_token.table, rows.req_rows, seq, width)
        out = gather_kv(layer, slots.to(layer.device, torch.long).reshape(-1), len(seq), width)
        return out.masked_fill(padding.to(layer.device)[:, None, :, None], 0)

    def activate_past_recording(self, **kwargs) -> None:
        """Candidate decoding calls this before it crops the cache (keyword arguments such as
        ``recurrent_states_to_keep`` from transformers 5.25 on, for layers of fixed-size state): the pool keeps every
        token of a row until :meth:`crop` drops them, so there is nothing to turn on."""

    # ------------------------------------------------------------------ row operations
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``. Pages are shared (ref counts), not copied.

        Raises:
            ValueError: an index is negative or out of range, or ``beam_idx`` is not a 1-D sequence of integers.
        """
        if self.stock_cache is not None:
            self.stock_cache.reorder_cache(beam_idx)
            return
        self._select_rows(self._row_indices(beam_idx, "beam_idx", allow_bool=False, allow_negative=False))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times in place (``num_return_sequences`` / beams on a pre-filled cache); 0
        drops every row, as ``DynamicCache``'s ``repeat_interleave`` empties its tensors.

        Raises:
            ValueError: ``repeats`` is not an int of 0 or more (integer scalars of numpy or torch count).
        """
        repeats = as_count("repeats", repeats, 0)
        if self.stock_cache is not None:
            self.stock_cache.batch_repeat_interleave(repeats)
            return
        n = self._num_rows()
        self._select_rows([i for i in range(n) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        """Keep the rows at ``indices``: a sequence or 1-D tensor of row indices, or a boolean mask of one entry per
        row (rows where it is True), as ``DynamicCache`` indexes its tensors with it.

        Raises:
            ValueError: an index is out of range, a boolean mask's length is not the number of rows, or
                ``indices`` is neither integers nor booleans.
        """
        if self.stock_cache is not None:
            self.stock_cache.batch_select_indices(indices)
            return
        self._select_rows(self._row_indices(indices, "indices", allow_bool=True))

    def _row_indices(self, indices, name: str, *, allow_bool: bool, allow_negative: bool = True) -> list[int]:
        """``indices`` as a list of row indices (a boolean mask read as the rows where it is True; negative indices
        count from the end where ``allow_negative``, as tensor indexing does, else are refused, as ``index_select``
        refuses them)."""
        t = torch.as_tensor(indices)
        if t.numel() == 0 and t.dtype != torch.bool:
            return []  # no rows ([] reads as float32)
        if t.dim() > 1:
            t = t.reshape(-1)
        if t.dtype == torch.bool:
            n = self._num_rows()
            if not allow_bool:
                raise ValueError(f"{name} must hold row indices, got a boolean tensor {t.tolist()}")
            if t.numel() != n:
                raise ValueError(f"{name} is a boolean mask of {t.numel()} entries, but the cache holds {n} rows")
            return t.nonzero().flatten().tolist()
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"{name} must hold integer row indices, got dtype {t.dtype}")
        idx = t.reshape(-1).tolist()
        if not allow_negative and any(i < 0 for i in idx):
            raise ValueError(f"{name} must hold row indices from 0, got {[i for i in idx if i < 0]} in {idx}")
        return idx

    def _num_rows(self) -> int:
        if self.returned_by_generate:
            return self.returned_rows if self.held_tokens is None else self.held_tokens[0].shape[0]
        return len(self._rows.req_rows) or len(self._num_pad or ())

    def _select_rows(self, idx: list[int]) -> None:
        if self.returned_by_generate:
            # the released cache a patched generate() returned: the rows of the tokens it recorded move, so that a
            # later call passed it continues the rows stock's cache would hold (one that recorded no tokens, after
            # beams, only counts its rows)
            n = self._num_rows()
            bad = [i for i in idx if not -n <= i < n]
            if bad:
                raise ValueError(f"row indices {bad} are out of range for a cache of {n} rows")
            if self.held_tokens is not None:
                self.held_tokens = self.held_tokens.rows(idx)
            self.returned_rows = len(idx)
            return
        stopped = self._unfinished_step()
        if stopped is not None:  # (the rows would move with columns some layers lack; stock's next forward fails)
            raise ValueError(f"cannot reorder or select the rows of this PagedCache: the previous forward {stopped}")
        self._step, self._pending_known = None, None
        n_old = len(self._rows.req_rows)
        before = self._num_pad, self._prompt_ids, self._prompt_pads, self.prefix_hit_tokens
        if self._num_pad is not None:
            n = len(self._num_pad)
            bad = [i for i in idx if not -n <= i < n]
            if bad:
                raise ValueError(f"row indices {bad} are out of range for a cache of {n} rows")
            if self._prompt_ids is not None and len(self._prompt_ids) == n:
                self._prompt_ids = [self._prompt_ids[i] for i in idx]
            self._num_pad = [self._num_pad[i] for i in idx]
            if n_old == 0 or not self._first_step_planned:
                # (a cache pre-filled from the prefix cache holds rows before its first step: its prompt's padding
                # and hits, which that step is checked against, follow the rows)
                if self._prompt_pads is not None and len(self._prompt_pads) == n:
                    self._prompt_pads = [self._prompt_pads[i] for i in idx]
                if len(self.prefix_hit_tokens) == n:
                    self.prefix_hit_tokens = [self.prefix_hit_tokens[i] for i in idx]
        if n_old == 0:
            return
        with self.pool.books():
            try:
                self._reassign_rows(idx)
            except BaseException:  # no request rows for the new ones (CacheFullError): the cache is left as it was
                self._num_pad, self._prompt_ids, self._prompt_pads, self.prefix_hit_tokens = before
                raise

    def _reassign_rows(self, idx: list[int]) -> None:
        rows, pool = self._rows, self.pool
        n_old = len(rows.req_rows)
        pool.make_room_for_rows(len(idx) - n_old)
        rows.drop_reserved()
        old_rows = rows.req_rows
        try:
            extra = pool.req_to_token.alloc(len(idx) - n_old) if len(idx) > n_old else []
        except CacheFullError as e:
            raise CacheFullError(
                e.needed, e.free, unit=e.unit,
                detail=f"growing {n_old} rows to {len(idx)} (beams or num_return_sequences), "
                       f"max_reqs={pool.req_to_token.max_reqs}",
            ) from None
        new_rows = (old_rows + extra)[: len(idx)]
        width = max(max(self.seq_lens, default=0), 1)
        try:
            pool.req_to_token.copy_rows([old_rows[i] for i in idx], new_rows, width)
        except BaseException:
            pool.req_to_token.free(extra)  # rows not yet recorded: nothing else would return them
            raise
        new_pages = [list(rows.pages[i]) for i in idx]
        old_pages = rows.pages
        pool.allocator.incref([p for pages in new_pages for p in pages])
        rows.req_rows, rows.pages, rows.known = new_rows, new_pages, [rows.known[i] for i in idx]
        rows.reserved = [[] for _ in idx]
        pool.allocator.decref([p for pages in old_pages for p in pages])
        pool.req_to_token.free(old_rows[len(idx):])

    def crop(self, max_length: int) -> None:
        """Drop the last ``-max_length`` columns (a count <= 0). A positive value keeps that many columns where the
        installed transformers' ``DynamicCache.crop`` still takes one (before 5.18, deprecated there). On the
        released cache a patched ``generate()`` returned, the columns dropped are those of the tokens it recorded
        (:meth:`get_seq_length`), so that a later call passed it continues from fewer, as on stock's cache.

        Raises:
            ValueError: a positive value on transformers 5.18 or later, as ``DynamicCache.crop`` raises.
        """
        max_length = as_int("crop(max_length)", max_length)
        if max_length > 0 and _POSITIVE_CROP_REFUSED:
            raise ValueError(f"crop({max_length}): a positive value (the length to keep) is not supported by "
                             "transformers 5.18 and later; pass minus the number of columns to drop, as "
                             "DynamicCache.crop takes it")
        if self.returned_by_generate:
            if self.stock_cache is not None:
                self.stock_cache.crop(max_length)
            if self.held_tokens is not None:
                keep = _columns_kept(self.held_tokens[0].shape[1], max_length)
                self.held_tokens = self.held_tokens.columns(keep)
            self.returned_len = _columns_kept(self.returned_len, max_length)
            return
        keep = self.logical_len + max_length if max_length <= 0 else min(max_length, self.logical_len)
        if keep >= self.logical_len:  # nothing dropped: an unfinished step stays so (its columns are still there)
            return
        self._step, self._pending_known = None, None
        keep = max(keep, 0)
        self.logical_len = keep
        with self.pool.books():
            self._drop_columns(keep)

    def _drop_columns(self, keep: int) -> None:
        rows, pool, ps = self._rows, self.pool, self.pool.page_size
        rows.drop_reserved()
        if self._num_pad is not None:
            # a row cut back into its left padding: the columns after ``keep`` are free for tokens again (what the
            # next mask says of them is read then, as for a row with nothing stored yet)
            self._num_pad = [min(p, keep) for p in self._num_pad]
        for r, pages in enumerate(rows.pages):
            n = max(0, keep - self._num_pad[r])
            drop = pages[-(-n // ps):]
            if drop:
                del pages[-(-n // ps):]
                pool.allocator.decref(drop)
            pool.req_to_token.clear_from(rows.req_rows[r], n)
            rows.known[r] = min(rows.known[r], n)

    def reset(self) -> None:
        """Empty the cache (pages go back to the pool); it can be used again."""
        self.release()

    def release(self) -> None:
        """Return every page and request row to the pool. Safe to call more than once."""
        self._rows.release()
        self.logical_len = 0
        self._num_pad = None
        self._prompt_ids = None
        self._prompt_pads = None  # a reused cache learns the next prompt's padding afresh
        self._first_step_planned = False
        self._pending_known = None
        self._step = None
        self._step_layers = set()
        self._pending_q = 0
        self._grad_step = None

    def _hold_pool_weakly(self, pool: PagePool | None = None) -> None:
        """Release this cache and keep its pool only by a weak reference from now on: a patched ``generate()``
        does so for the cache it returns (it holds no K/V), so that outputs a caller keeps do not keep a deleted
        model's pool (its K/V memory) alive. ``cache.pool`` reads the pool while it lives; afterwards it raises
        ``AttributeError`` (``hasattr(cache, "pool")`` is False), and ``layer_kv()`` still gives the empty K/V.
        ``pool``: the pool to hold from now on (that of the call a returned cache was passed to), else its own."""
        self.release()
        pool = self.pool if pool is None else pool
        self._empty_kv = {which: [t.new_zeros(0, t.shape[1], 0, t.shape[2]) for t in getattr(pool.storage, which)]
                          for which in ("k", "v")}
        self._finalizer.detach()
        self._pool_ref = weakref.ref(pool)
        self._rows.pool = None
        self.__dict__.pop("pool", None)

    def __getattr__(self, name: str):
        # (reached only for attributes the instance lacks: ``pool`` of a cache that holds it weakly)
        ref = self.__dict__.get("_pool_ref") if name == "pool" else None
        pool = ref() if ref is not None else None
        if pool is None:
            gone = (": its PagePool is gone (the model whose patched generate() returned this cache was unpatched, "
                    "or deleted); the cache holds no K/V: a patched model's generate() still takes it, and an "
                    "unpatched model's generate() computes the same tokens without it from the whole sequence so "
                    "far") if ref else ""
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{gone}")
        return pool

    def __deepcopy__(self, memo: dict) -> "PagedCache":
        """``copy.deepcopy(cache)`` (transformers' recipe for reusing a prompt's cache in several calls): a new
        cache on the same pool whose rows share this cache's pages (ref counts; either cache copies a shared page
        before it first writes into it), not a copy of the pool.

        Raises:
            CacheFullError: the pool has too few free request rows for the copy.
            ValueError: the last forward stopped midway (some layers stored its K/V, others not): ``crop()`` it first.
        """
        if "pool" not in self.__dict__:
            # the released cache a patched generate() returned, which holds its pool weakly (the pool may be gone):
            # so does its copy, which holds what it records (tokens, lengths, a stock cache) copied
            twin = object.__new__(PagedCache)
            memo[id(self)] = twin
            for name, value in self.__dict__.items():
                if name not in ("_rows", "_finalizer"):
                    twin.__dict__[name] = copy.deepcopy(value, memo)
            twin._rows = _Rows(None)
            twin._finalizer = weakref.finalize(twin, _release_when_collected, twin._rows)
            return twin
        stopped = self._unfinished_step()
        if stopped is not None:  # (the copy would hold columns some layers lack, and not know it)
            raise ValueError(f"cannot copy this PagedCache: the previous forward {stopped}")
        twin = PagedCache(self.pool, prefix_cache=self._wants_prefix_cache,
                          reserve_new_tokens=self.reserve_new_tokens)
        twin._rows.insert_on_release = self._rows.insert_on_release
        memo[id(self)] = twin
        if self.returned_by_generate:  # the released cache a patched generate() returned: so is its copy
            twin.made_by_generate = twin.returned_by_generate = True
            twin.held_tokens = self.held_tokens
            twin.stock_cache = copy.deepcopy(self.stock_cache, memo)
            twin.returned_len, twin.returned_rows = self.returned_len, self.returned_rows
        for name in ("stock_attention", "verifies_candidates", "rows_as_fed"):
            if name in self.__dict__:
                setattr(twin, name, self.__dict__[name])
        twin.logical_len, twin._first_step_planned = self.logical_len, self._first_step_planned
        # (and what computed them: a copy of a cache whose prefixes the prefix cache dropped since, the model
        # and weights unchanged, goes on as the cache does)
        twin.prefix_hit_tokens, twin._hit_model_key = list(self.prefix_hit_tokens), self._hit_model_key
        twin._num_pad = None if self._num_pad is None else list(self._num_pad)
        twin._prompt_pads = None if self._prompt_pads is None else list(self._prompt_pads)
        twin._prompt_ids = None if self._prompt_ids is None else [list(ids) for ids in self._prompt_ids]
        twin._prompt_width = self._prompt_width
        rows, pool = self._rows, self.pool
        if rows.req_rows:
            with pool.books():
                pool.make_room_for_rows(len(rows.req_rows))
                new_rows = pool.req_to_token.alloc(len(rows.req_rows))
                pool.req_to_token.copy_rows(rows.req_rows, new_rows, max(max(self.seq_lens, default=0), 1))
                twin._rows.req_rows, twin._rows.epoch = new_rows, rows.epoch
                twin._rows.pages = [list(pages) for pages in rows.pages]
                for pages in twin._rows.pages:
                    pool.allocator.incref(pages)
                twin._rows.known = list(rows.known)
                twin._rows.reusable = rows.reusable
                twin._rows.reserved = [[] for _ in new_rows]
        return twin

    def __copy__(self) -> "PagedCache":
        """``copy.copy(cache)``: as :meth:`__deepcopy__` (a cache of its own whose rows share this one's pages);
        two caches sharing one set of rows would free them twice."""
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol):
        """``pickle`` / ``torch.save`` (of a ``generate()`` output, say): a cache holding no K/V (the released one a
        patched ``generate()`` returns) is stored as an empty ``DynamicCache``, what a fresh call starts from.

        Raises:
            TypeError: the cache holds K/V: they live in its pool's storage, which is not pickled.
        """
        if self.is_initialized:
            raise TypeError(
                f"cannot pickle a PagedCache holding {len(self._rows.req_rows)} rows: its K/V live in a PagePool's "
                "storage; release it first, or save the K/V of `cache.layers` (or the prefix cache with "
                "pool.save_prefix_cache)"
            )
        from transformers import DynamicCache

        return DynamicCache, ()

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PagedLayer:
    """One layer of a :class:`PagedCache`, read-only, in the shape of a ``DynamicCache`` layer: ``keys`` and
    ``values`` are [B, num_kv_heads, logical_len, head_dim] copies gathered from the pool (padding columns zero;
    see :meth:`PagedCache.layer_kv`), so writes into them change nothing. Writing goes through
    ``PagedCache.update``; crop, reset and row selection through the cache, for every layer at once.

    Raises:
        AttributeError: assigning ``keys``/``values``, or a ``DynamicCache`` layer's method (``crop``, ``reset``,
            ``lazy_initialization``, ...), naming what to call instead.
        NotImplementedError: ``offload()`` / ``prefetch()``: the K/V stay in the pool.
    """

    def __init__(self, cache: PagedCache, layer_idx: int):
        self._cache, self.layer_idx = cache, layer_idx

    @property
    def keys(self) -> torch.Tensor:
        return self._cache._gathered(self.layer_idx, "k")

    @keys.setter
    def keys(self, value) -> None:
        raise AttributeError(_READ_ONLY_LAYER.format(what="its keys cannot be assigned"))

    @property
    def values(self) -> torch.Tensor:
        return self._cache._gathered(self.layer_idx, "v")

    @values.setter
    def values(self, value) -> None:
        raise AttributeError(_READ_ONLY_LAYER.format(what="its values cannot be assigned"))

    def offload(self) -> None:
        raise NotImplementedError(_NO_OFFLOAD)

    def prefetch(self) -> None:
        raise NotImplementedError(_NO_OFFLOAD)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_cache", "layer_idx"):
            raise AttributeError(name)
        raise AttributeError(_READ_ONLY_LAYER.format(what=f"it has no {name!r}")
                             + "; crop(), reset(), reorder_cache() and batch_select_indices() are the cache's")

    @property
    def is_initialized(self) -> bool:
        return self._cache.is_initialized

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def __repr__(self) -> str:
        return f"PagedLayer(layer_idx={self.layer_idx}, seq_length={self.get_seq_length()})"


_READ_ONLY_LAYER = ("a PagedCache layer is a read-only view of K/V gathered from the pool, so {what}: write "
                    "through cache.update(keys, values, layer_idx), and change the rows or columns of every layer at "
                    "once through the cache")
_NO_OFFLOAD = ("a PagedCache's K/V live in its PagePool, one tensor per layer shared by every cache of the pool, so "
               "they are not offloaded layer by layer; build the pool with fewer max_tokens, or use transformers' "
               "DynamicCache(offloading=True) for offloading")


def _positions_per_prompt_row(position_ids, n: int, q_len: int) -> list[list[int]] | None:
    """A step's ``position_ids`` [n * group or 1, q_len] as one list per prompt row (the first of each group of rows
    expanded per prompt by samples or beams; one row of positions stands for every row), or None for another shape
    (M-RoPE's 3-D positions, say). A host read."""
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != q_len
            or (position_ids.shape[0] != 1 and position_ids.shape[0] % n)):
        return None
    rows = position_ids[:: max(position_ids.shape[0] // n, 1)].tolist()
    return rows * n if len(rows) == 1 else rows


def _grouped(t: torch.Tensor | None, group: int) -> bool:
    """Whether the rows of ``t`` come in runs of ``group`` identical rows (``repeat_interleave`` of a batch)."""
    if t is None:
        return True
    if t.shape[0] % group:
        return False
    runs = t.reshape(t.shape[0] // group, group, -1)
    return bool((runs == runs[:, :1]).all())


def _padding_from_positions(positions: list[int]) -> int:
    """Left-padding columns of a first-step row, read from its position ids: the row ends in ``0, 1, ..., n - 1``
    after ``q - n`` columns of one repeated value (``generate()`` gives padding position 1; ``cumsum - 1``
    conventions give 0 or -1). Any other row (positions that restart inside it, as for packed documents), and a row
    of zeros only (one real token, left or right of its padding), is taken as all real tokens."""
    q, last = len(positions), int(positions[-1])
    pad = q - (last + 1)
    if pad <= 0 or positions[pad:] != list(range(last + 1)) or len(set(positions[:pad])) != 1:
        return 0
    if last == 0 and positions[0] == 0:
        # all zeros: one token after padding, or (a right-padded row, against generate()'s contract) one token
        # before it, which the positions cannot tell apart; every column is stored, which serves both
        return 0
    return pad


def _columns_kept(length: int, max_length: int) -> int:
    """The columns of ``length`` that ``crop(max_length)`` keeps: minus a count to drop (<= 0), or, positive, the
    length to keep."""
    return max(length + max_length, 0) if max_length <= 0 else min(max_length, length)


def _checked_update_args(key_states, value_states, layer_idx) -> int:
    """``layer_idx`` as an int (an int subclass, an integer scalar of numpy or torch); or the error
    :meth:`PagedCache.update` gives arguments it cannot store."""
    for name, value in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"PagedCache.update: {name} must be a torch.Tensor, got {type(value).__name__}")
    try:
        index = operator.index(layer_idx)
    except TypeError:
        index = None
    if isinstance(layer_idx, bool) or index is None:
        raise TypeError(f"PagedCache.update: layer_idx must be an int, got {layer_idx!r}")
    if key_states.dim() != 4:
        raise ValueError(f"PagedCache.update: key_states must be [batch, num_kv_heads, q_len, head_dim], got shape "
                         f"{tuple(key_states.shape)}")
    if key_states.shape != value_states.shape:
        raise ValueError(f"PagedCache.update: key_states {tuple(key_states.shape)} and value_states "
                         f"{tuple(value_states.shape)} must have the same shape")
    return index


def check_rows_have_tokens(attention_mask: torch.Tensor) -> None:
    """Refuse a [B, L] 0/1 mask with a row of zeros: such a row has no token to attend to (stock's attention then
    attends over no key) and nothing a paged cache could store.

    Raises:
        ValueError: naming the rows.
    """
    empty = empty_rows(attention_mask)
    if empty:
        raise ValueError(f"attention_mask rows {empty} have no tokens (all zeros); every row needs one")


def empty_rows(attention_mask: torch.Tensor) -> list[int]:
    """The rows of a [B, L] 0/1 mask (L > 0) that are all zeros."""
    if attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return []
    return (attention_mask == 0).all(-1).nonzero().flatten().tolist()


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
            "use tokenizer.padding_side = 'left'. Without an attention_mask, generate() masks every pad_token_id "
            "in the prompt: a pad token inside a prompt makes the same hole, so pass the attention_mask"
        )
    return pads.tolist()


def _broadcast_rows(pads: list[int], B: int) -> list[int]:
    """The padding of a one-row mask given for a batch of ``B`` rows (generate() broadcasts it), else ``pads``."""
    return pads * B if len(pads) == 1 and B > 1 else pads


def cache_kwarg(model) -> str:
    """The ``generate()`` / ``forward()`` keyword that takes a cache on this transformers version.

    ``"cache"`` on transformers 5.24 and later (where ``past_key_values=`` still works, with a FutureWarning),
    ``"past_key_values"`` before. Use it as ``model.generate(**inputs, **{cache_kwarg(model): cache})``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    import inspect

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cache_kwarg() takes a transformers model (a torch.nn.Module), got {type(model).__name__}")
    model = underlying_model(model)  # (a torch.compile wrapper's forward takes *args, **kwargs)
    get_base_model = getattr(model, "get_base_model", None)  # a peft wrapper's forward takes **kwargs
    base = get_base_model() if callable(get_base_model) else None
    target = base if isinstance(base, torch.nn.Module) else model
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def underlying_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``) holds, else ``model``: the wrapper forwards
    ``generate`` and other attributes to it, so patching the wrapper itself would patch half of each."""
    inner = getattr(model, "_modules", {}).get("_orig_mod")  # OptimizedModule holds it as a submodule
    return inner if isinstance(inner, torch.nn.Module) else model


def _consecutive(pages: list[int]) -> bool:
    """Whether ``pages`` is a non-empty run of consecutive page ids, ascending."""
    return bool(pages) and pages[-1] - pages[0] == len(pages) - 1 and pages == list(range(pages[0], pages[-1] + 1))
