"""PagePool: the KV memory that caches borrow pages from, shared across ``generate()`` calls."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import itertools
import logging
import numbers
import threading
import types
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from .allocator import PageAllocator
from .config import (KVSpec, PagePoolConfig, as_count, as_flag, as_int, class_defines, page_bytes_by_device,
                     rope_depends_on_length)
from .distributed import RankGroup, agree, kv_heads_per_rank, rank_group
from .errors import CacheFullError
from .interrupts import interrupts_deferred
from .prefix_cache import PrefixCache
from .req_to_token import ReqToTokenPool
from .storage import TRASH_PAGE, KVStorage

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 32_768
DEFAULT_MAX_REQS = 128
EVICTION_BATCH_DIVISOR = 256  # an eviction frees at least num_pages // 256 cached pages (see PagePool._make_free)


class PagePool:
    """A paged KV pool: per-layer K/V storage, a ref-counted page allocator and a ``req_to_token`` table.

    Layout and vocabulary follow vLLM's PagedAttention (Kwon et al., SOSP 2023) and SGLang's memory pools: a token
    lives in a *slot* ``page_id * page_size + offset``; a request row maps its token index to slots.

    Args:
        config: the model's ``PretrainedConfig`` (the text decoder's geometry is read from it).
        max_tokens: token capacity; the pool gets ``max_tokens // page_size`` usable pages.
        memory_fraction: alternatively, size the pool to this fraction (0, 1] of the memory free on each device
            it spans (GPU: ``torch.cuda.mem_get_info``; CPU: available RAM): each device gets at most that
            fraction of its own free memory for the layers stored on it (their pages, the trash page included,
            and on the first layer's device the ``req_to_token`` table), and the device with the least room sets
            the page count. Exclusive with ``max_tokens``. With neither, ``max_tokens`` defaults to 32768.
        page_size: token slots per page (>= 1).
        max_seq_len: longest row in tokens (padding excluded); defaults to the model's
            ``max_position_embeddings``, capped by the pool's capacity. The ``req_to_token`` table is
            ``[max_reqs + 1, min(max_seq_len, capacity)]`` int32.
        max_reqs: sequences alive at once across all caches on this pool (default 128).
        device: one device for every layer, or a sequence with one device per layer. Defaults to CPU.
        dtype: K/V dtype; defaults to the config's dtype, else float32.
        prefix_cache: keep the full pages of finished sequences and reuse them for later prompts that start with
            the same tokens (default True); see :mod:`astrai_hf.prefix_cache`.
        num_kv_heads: KV heads stored per layer; defaults to the config's. Under tensor parallelism, the heads
            this rank holds (``from_model`` reads them from the model).
        head_dim: K/V head size; defaults to the config's ``head_dim``, else ``hidden_size // num_attention_heads``
            (``from_model`` reads it from the attention modules: some families ignore a config's ``head_dim``).
        process_group: the tensor-parallel ``torch.distributed`` group whose ranks hold the other heads of the
            same sequences (``from_model`` finds it). Pages sized by ``memory_fraction`` are then the minimum over
            the ranks, so every rank has the same pages, and errors are raised on all ranks together (see
            :mod:`astrai_hf.distributed`).

    Raises:
        ValueError: a size is out of range or names what cannot be. ``TypeError``: a value of the wrong type
            (``config`` not a ``PretrainedConfig``, ``process_group`` not a ``ProcessGroup``, ``dtype`` not a
            floating dtype).
        NotImplementedError: the config is of a model whose cache a pool cannot hold (:func:`unsupported_config`:
            encoder-decoder, hybrid layers, multi-head latent attention).
    """

    def __init__(
        self,
        config,
        *,
        max_tokens: int | None = None,
        memory_fraction: float | None = None,
        page_size: int = 16,
        max_seq_len: int | None = None,
        max_reqs: int | None = None,
        device: str | torch.device | Sequence[str | torch.device] | None = None,
        dtype: torch.dtype | None = None,
        prefix_cache: bool = True,
        num_kv_heads: int | None = None,
        process_group=None,
        head_dim: int | None = None,
    ):
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"PagePool needs the model's transformers PretrainedConfig (model.config), got "
                            f"{type(config).__name__}; for a model, use PagePool.from_model(model, ...)")
        if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                            f"{type(process_group).__name__}")
        reason = unsupported_config(config)
        if reason is not None:
            raise NotImplementedError(f"{type(config).__name__}: {reason}; a PagePool cannot hold its cache")
        spec = KVSpec.from_config(config)
        # integer scalars of numpy / torch are accepted as sizes
        page_size = as_int("page_size", page_size)
        max_tokens = None if max_tokens is None else as_int("max_tokens", max_tokens)
        max_seq_len = None if max_seq_len is None else as_int("max_seq_len", max_seq_len)
        max_reqs = None if max_reqs is None else as_int("max_reqs", max_reqs)
        if num_kv_heads is not None:
            spec = dataclasses.replace(spec, num_kv_heads=as_count("num_kv_heads", num_kv_heads, 1))
        if head_dim is not None:
            spec = dataclasses.replace(spec, head_dim=as_count("head_dim", head_dim, 1))
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        dtype = _resolve_dtype(config) if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        layer_devices = _resolve_devices(device, spec.num_layers)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        longest = max_seq_len if max_seq_len is not None else getattr(text, "max_position_embeddings", None)
        # (sizes out of range are refused below, by PagePoolConfig)
        table = (max(max_reqs if max_reqs is not None else DEFAULT_MAX_REQS, 0) + 1, max(longest or 0, 0))
        num_usable = _size_pages(spec, page_size, dtype, layer_devices, max_tokens, memory_fraction, table)
        self.ranks: RankGroup | None = RankGroup(process_group, layer_devices[0]) if process_group is not None else None
        if self.ranks is not None and memory_fraction is not None:
            (num_usable,) = self.ranks.min([num_usable])  # free memory differs per rank; page tables must not
        capacity = num_usable * page_size
        if max_seq_len is None:
            max_seq_len = min(longest or capacity, capacity)
        if max_reqs is None:
            max_reqs = DEFAULT_MAX_REQS
        # a RoPE whose frequencies follow the forward's length: no prefix reuse for a cache of this config's model
        self.rope_by_length = rope_depends_on_length(config)
        self.config = PagePoolConfig(
            spec=spec,
            page_size=page_size,
            num_pages=num_usable + 1,
            max_seq_len=max_seq_len,
            max_reqs=max_reqs,
            dtype=dtype,
            layer_devices=layer_devices,
        )
        self.allocator = PageAllocator(self.config.num_pages, first_page=TRASH_PAGE + 1)
        self.device_types = tuple(dict.fromkeys(d.type for d in layer_devices))  # ("cuda",), ("cuda", "cpu"), ...
        # Plain tensors even when the pool is made under torch.inference_mode(): inference tensors could not be
        # written by a later generate() outside that mode.
        devices = ", ".join(sorted({str(d) for d in layer_devices}))
        with torch.inference_mode(False):
            need = self.config.num_pages * spec.bytes_per_token(dtype) * page_size
            with _short_of_memory(
                    f"cannot allocate the pool's K/V: {self.config.num_pages - 1} pages of {page_size} tokens "
                    f"(max_tokens={capacity}) take {need / 2**30:.1f} GiB in {dtype} on {devices}; pass a smaller "
                    "max_tokens, or memory_fraction"):
                self.storage = KVStorage(self.config)
            # a row never holds more tokens than the pool has slots (its slots are distinct): a larger max_seq_len
            # still bounds prompts (ValueError), a row past the capacity fails with CacheFullError, and the
            # req_to_token table has no columns no row could fill
            width = min(max_seq_len, capacity)
            with _short_of_memory(
                    f"cannot allocate the pool's req_to_token table: max_reqs={max_reqs} rows of {width} slots take "
                    f"{(max_reqs + 1) * width * 8 / 2**30:.1f} GiB (two int32 tables) on {layer_devices[0]}; pass a smaller max_reqs"):
                self.req_to_token = ReqToTokenPool(max_reqs, width, layer_devices[0])
        self.prefix_cache = PrefixCache(self.allocator, page_size) if as_flag("prefix_cache", prefix_cache) else None
        self.counters = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0}
        # calls of the models patched onto this pool, and patch() onto it, take turns (see patch._one_call)
        self.call_lock = threading.RLock()
        # the books (allocator, request rows, prefix cache, reservations) change only under books(): caches of one
        # pool plan, copy and release from several threads (an unpatched model's, a finaliser run by gc)
        self.books_lock = threading.RLock()
        self.books_depth = 0  # books() blocks entered and not left (by the thread holding books_lock)
        self._books_owner: int | None = None  # the thread in the outermost books() block (it defers Ctrl-C)
        self._released_later: list = []  # page holders of caches collected while the books were busy
        self._model_ref = None
        self._model_fingerprint: str | None = None
        self._weights_version: _WeightsVersion | None = None
        self._fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (version, digest)
        # the page holders of live caches that hold reserved pages (room for tokens not yet written)
        self._reservations: weakref.WeakSet = weakref.WeakSet()

    @contextlib.contextmanager
    def books(self) -> Iterator[None]:
        """Hold the pool's books (page allocator, ``req_to_token`` rows, prefix cache, reservations) for a change
        that must look atomic: other threads wait for the block (a reentrant lock), and Ctrl-C waits until the
        books are consistent again (:func:`~astrai_hf.interrupts.interrupts_deferred`). A cache that the garbage
        collector finalises meanwhile, in this thread or another, does not wait or cut in: its rows are returned
        when the outermost block is entered or left (:meth:`release_later`)."""
        with self.books_lock:
            me = threading.get_ident()
            if self._books_owner == me:  # nested in this thread's outermost block, which defers Ctrl-C already
                self.books_depth += 1
                try:
                    yield
                finally:
                    self.books_depth -= 1
                return
            with interrupts_deferred():
                self._books_owner = me
                try:
                    if not self.books_depth:
                        self._release_collected()
                    self.books_depth += 1
                    try:
                        yield
                    finally:
                        self.books_depth -= 1
                        if not self.books_depth:
                            self._release_collected()
                finally:
                    self._books_owner = None

    def release_later(self, holder) -> None:
        """Take the page holder of a cache the garbage collector finalised while the books were busy (see
        ``books()``); its pages and rows return when the outermost block that held them ends, or when the next
        one begins, or right after :meth:`release_garbage_caches` collects."""
        self._released_later.append(holder)  # (list.append is atomic: no lock needed, none taken)

    def _release_collected(self) -> None:
        if not self._released_later:
            return
        self.books_depth += 1  # (the releases' own books() blocks do not come back here)
        try:
            while self._released_later:
                self._released_later.pop().release()
        finally:
            self.books_depth -= 1

    def release_garbage_caches(self) -> bool:
        """Run the garbage collector, so that caches nobody can reach any more but a reference cycle keeps (an
        exception kept in a local, a cache in a notebook's dropped objects) give back their pages and request rows
        before an allocation gives up. Called only when the pool is short, before ``CacheFullError``.

        Returns:
            whether free pages or free request rows grew.
        """
        before = (self.allocator.num_free, self.req_to_token.num_free,
                  self.prefix_cache.num_cached_only if self.prefix_cache is not None else 0)
        gc.collect()
        with self.books():  # (finalisers run inside this thread's books leave their rows to it)
            self._release_collected()
        after = (self.allocator.num_free, self.req_to_token.num_free,
                 self.prefix_cache.num_cached_only if self.prefix_cache is not None else 0)
        if after != before:
            logger.debug("KV pool short: garbage collection released pages and rows (free pages, free rows, cached "
                         "pages) %s -> %s", before, after)
        return after != before

    def make_room_for_rows(self, num: int) -> None:
        """Before ``num`` request rows are taken: when fewer are free, release the caches that are garbage
        (:meth:`release_garbage_caches`). The allocation itself raises ``CacheFullError`` if that is not enough."""
        if num > self.req_to_token.num_free:
            self.release_garbage_caches()

    @classmethod
    def from_model(cls, model: torch.nn.Module, **kwargs) -> "PagePool":
        """Build a pool for ``model``: geometry from its config, dtype and per-layer devices from its attention
        modules. A model split with ``device_map`` keeps each layer's K/V on the device the layer runs on (for an
        offloaded layer, accelerate's execution device). Under tensor parallelism (``tp_plan``) the pool holds the
        KV heads of this rank and agrees with the other ranks (see ``process_group``); call it on every rank.

        Args:
            model: a transformers causal LM.
            **kwargs: as for :class:`PagePool` (``device``, ``dtype`` and ``process_group`` override what is read
                from the model; ``num_kv_heads`` and ``head_dim``, where given, must be the model's).

        Raises:
            NotImplementedError: the model's cache is not a K/V cache of one head size (see
                :func:`unsupported_model`).
            ValueError: as for :class:`PagePool`, or the model's KV heads do not split into whole heads per
                tensor-parallel rank, or ``num_kv_heads`` or ``head_dim`` is given and is not the model's.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"PagePool.from_model takes a transformers model (a torch.nn.Module), got "
                            f"{type(model).__name__}; for a config, use PagePool(config, ...)")
        reason = unsupported_model(model)
        if reason is not None:
            raise NotImplementedError(f"{type(model).__name__}: {reason}; a PagePool cannot hold its cache")
        layers = attention_modules(model)
        if "device" not in kwargs and layers:
            kwargs["device"] = [_module_device(m) for m in layers]
            meta = [m.layer_idx for m, d in zip(layers, kwargs["device"]) if d.type == "meta" and _hook_device(m) is None]
            if meta:
                raise ValueError(
                    f"{type(model).__name__}: the attention of layers {meta} has its weights on the meta device and no "
                    "accelerate hook says where it runs, so the pool cannot tell where to keep their K/V; load the "
                    "weights (or dispatch the model with a device_map), or pass device= to the pool"
                )
        if "dtype" not in kwargs and layers:
            by_dtype = _layers_by_dtype(layers)
            if len(by_dtype) > 1:
                raise TypeError(_mixed_dtypes(model, by_dtype))
            kwargs["dtype"] = next(iter(by_dtype), None) or _activation_dtype(model)
        spec = model_kv_spec(model, layers)
        for name, value, what in (("num_kv_heads", spec.num_kv_heads, "KV heads per layer"),
                                  ("head_dim", spec.head_dim, "as the size of a K/V head")):
            if kwargs.get(name) is not None:
                given = as_count(name, kwargs[name], 1)
                if given != value:
                    where = " on this rank" if name == "num_kv_heads" and rank_group(layers) is not None else ""
                    raise ValueError(f"{name}={given} given, but {type(model).__name__}'s attention stores {value} "
                                     f"{what}{where}; leave {name} out and from_model reads it")
            kwargs[name] = value
        if "process_group" not in kwargs:
            ranks = rank_group(layers)
            kwargs["process_group"] = ranks.group if ranks is not None else None
        pool = cls(model.config, **kwargs)
        pool.bind_model(model)
        return pool

    # ------------------------------------------------------------------ properties
    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_layers(self) -> int:
        return self.config.spec.num_layers

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    # ------------------------------------------------------------------ checks
    def check_model(self, model: torch.nn.Module) -> None:
        """Check that ``model`` can store its K/V here.

        Raises:
            ValueError: layer count, KV heads (this rank's, under tensor parallelism), head_dim or a layer's device
                differ.
            TypeError: the model computes K/V in another dtype.
        """
        spec, mine = model_kv_spec(model), self.config.spec
        for name in ("num_layers", "num_kv_heads", "head_dim", "kv_source"):
            if getattr(spec, name) != getattr(mine, name):
                raise ValueError(
                    f"this PagePool was built for a model with {name}={getattr(mine, name)}, "
                    f"but {type(model).__name__} has {name}={getattr(spec, name)}; build the pool with "
                    "PagePool.from_model(model)"
                )
        modules = attention_modules(model)
        for module in modules:
            idx = module.layer_idx
            dev, dt = _module_device(module), _module_dtype(module)
            if dt is not None and dt != self.dtype:
                by_dtype = _layers_by_dtype(modules)
                raise TypeError(_mixed_dtypes(model, by_dtype) if len(by_dtype) > 1 else (
                    f"the model computes K/V in {dt}, but the pool stores {self.dtype}; build the pool with "
                    "PagePool.from_model(model) after the model's dtype is set"))
            if dev != self.config.layer_devices[idx]:
                raise ValueError(
                    f"layer {idx} of the model is on {dev}, but this PagePool keeps its K/V on "
                    f"{self.config.layer_devices[idx]}"
                )

    def fits_placement(self, modules: list[torch.nn.Module], model: torch.nn.Module | None = None) -> bool:
        """Whether the attention modules ``modules`` (see :func:`attention_modules`) of ``model`` still compute in
        this pool's dtype and on its layers' devices (a model moved with ``.to()`` after its pool was built does
        not), and each has a layer of the pool (a layer appended since has none). A module with no floating weights
        is taken to compute in the model's embeddings' dtype, as :meth:`from_model` takes it (where ``model`` is
        given; else it fits any)."""
        devices = self.config.layer_devices
        dtypes = [_module_dtype(m) for m in modules]
        fed = _activation_dtype(model) if model is not None and None in dtypes else None
        return all(
            m.layer_idx < len(devices) and (dtype or fed) in (None, self.dtype)
            and _module_device(m) == devices[m.layer_idx]
            for m, dtype in zip(modules, dtypes)
        )

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, int | dict[str, int]]:
        """Counters of the pool: ints, and one dict of ints.

        Returns:
            - ``num_pages``: usable pages; ``num_free_pages + num_used_pages + num_cached_pages == num_pages``.
            - ``num_free_pages``: pages nobody holds.
            - ``num_used_pages``: pages held by live caches (0 after every ``generate()`` call returns).
            - ``num_cached_pages``: pages held only by the prefix cache: reusable, and evicted (least recently used
              first) when an allocation needs room. Eviction takes leaves: a page whose cached continuation a live
              cache still holds (a ``copy.deepcopy`` of a cache, say) waits until that cache lets go.
            - ``prefix_cache_pages``: pages the prefix cache indexes, including ones a live cache also holds.
            - ``prefix_query_tokens``: prompt tokens looked up in the prefix cache so far.
            - ``prefix_hit_tokens``: of those, tokens whose K/V was reused instead of computed.
            - ``evictions``: pages evicted from the prefix cache so far.
            - ``kv_bytes_used`` / ``kv_bytes_cached`` / ``kv_bytes_total``: bytes (K and V, all layers) of the used
              pages, of the cached-only pages, of the pool's ``num_pages`` (its storage holds one page more, the
              trash page that padded rows of a decode graph write to).
            - ``kv_bytes_by_device``: ``{device: bytes}``, the whole pool's bytes on each device it spans (a model
              split with ``device_map`` keeps each layer's K/V on that layer's device); the values sum to
              ``kv_bytes_total``. Under tensor parallelism these are this rank's bytes (its share of the heads).
            - ``page_size``, ``num_reqs_used`` (request rows held), ``max_reqs``.
        """
        with self.books():  # (one moment's counts, which add up)
            return self._stats()

    def _stats(self) -> dict[str, int | dict[str, int]]:
        cached = self.prefix_cache.num_cached_only if self.prefix_cache is not None else 0
        used = self.allocator.num_used - cached
        per_page = self.config.bytes_per_page
        return {
            "num_pages": self.allocator.num_usable,
            "num_free_pages": self.allocator.num_free,
            "num_used_pages": used,
            "num_cached_pages": cached,
            "prefix_cache_pages": len(self.prefix_cache) if self.prefix_cache is not None else 0,
            **self.counters,
            "evictions": self.prefix_cache.evictions if self.prefix_cache is not None else 0,
            "kv_bytes_used": used * per_page,
            "kv_bytes_cached": cached * per_page,
            "kv_bytes_total": self.allocator.num_usable * per_page,
            "kv_bytes_by_device": {
                str(d): self.allocator.num_usable * b for d, b in self.config.bytes_per_page_by_device.items()
            },
            "page_size": self.page_size,
            "num_reqs_used": self.config.max_reqs - self.req_to_token.num_free,
            "max_reqs": self.config.max_reqs,
        }

    # ------------------------------------------------------------------ pages
    def reserve(self, num_pages: int, collect_garbage: bool = True) -> None:
        """Make ``num_pages`` pages free: first by taking back the pages live caches reserved for tokens they have
        not written yet (see ``PagedCache(reserve_new_tokens=...)``; their rows then grow page by page), then by
        evicting cached-only pages (LRU, tail first): at least ``num_pages // 256`` of the pool's pages at once
        where the cache holds that many, since an eviction walks every cached page.

        Args:
            num_pages: pages wanted free.
            collect_garbage: before raising, run the garbage collector once (:meth:`release_garbage_caches`, a
                full collection) and try again.

        Raises:
            CacheFullError: even after evicting every cached-only page fewer than ``num_pages`` are free. Nothing
                is evicted then, unless cached pages whose continuation a live cache holds (which eviction, taking
                leaves, cannot free) were counted on: the exact count is taken only then, as it walks the tree.
                Caches that are garbage but not yet collected are released first (:meth:`release_garbage_caches`).
        """
        if num_pages <= 0:  # (a decode step whose rows have room: most steps)
            return
        with self.books():
            error = self._make_free(num_pages)
            if error is not None and collect_garbage and self.release_garbage_caches():
                error = self._make_free(num_pages)
            if error is not None:
                try:
                    raise error
                finally:
                    error = None  # (held by the traceback's frame, it would make a cycle keeping the pool)

    def _make_free(self, num_pages: int) -> CacheFullError | None:
        """:meth:`reserve`'s steps; the error to raise when they are not enough."""
        free = self.allocator.num_free
        if num_pages <= free:
            return None
        if self._reservations:
            for holder in list(self._reservations):
                holder.drop_reserved()
            logger.debug("KV pool pressure: %d pages wanted, %d free; took back %d reserved pages",
                         num_pages, free, self.allocator.num_free - free)
            free = self.allocator.num_free
            if num_pages <= free:
                return None
        cached = self.prefix_cache.num_cached_only if self.prefix_cache is not None else 0  # >= what can be evicted
        if num_pages > free + cached:
            return CacheFullError(num_pages, free, self.prefix_cache.num_evictable if cached else 0)
        # an eviction walks every cached page (and the count above too): evicting at least a 256th of the pool at
        # once, least recently used first, leaves free pages for the next steps' allocations, so that a pool full
        # of cached prefixes does not walk them at every page a call takes
        batch = max(num_pages - free, self.allocator.num_usable // EVICTION_BATCH_DIVISOR)
        logger.debug("KV pool pressure: %d pages wanted, %d free; evicting up to %d cached prefix pages",
                     num_pages, free, batch)
        self.prefix_cache.evict(batch)
        if self.allocator.num_free < num_pages:
            return CacheFullError(num_pages, self.allocator.num_free, self.prefix_cache.num_evictable)
        return None

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the pages dropped from the index. The digests of the models' weights
        are taken again too: call it after writes into ``param.data``, which no check sees."""
        dropped = self._drop_prefixes()
        self._fingerprints.clear()
        model = self.model
        if model is not None:
            self._model_fingerprint = self._fingerprint(model)
            self._weights_version = self._fingerprints[model][0]
        return dropped

    def _drop_prefixes(self) -> int:
        with self.books():
            return self.prefix_cache.clear() if self.prefix_cache is not None else 0

    # ------------------------------------------------------------------ the model the K/V belong to
    def bind_model(self, model: torch.nn.Module) -> None:
        """Record the model whose K/V this pool holds (done by ``from_model`` and ``patch``).

        Cached prefixes are only valid for the weights that computed them: binding a model whose weights, buffers
        or config (RoPE, windows, ...; see :func:`astrai_hf.persist.config_fingerprint`) differ from the previously
        bound model's clears the prefix cache, and so does one whose module code, hooks or peft adapter state
        differ (see :class:`_WeightsVersion`).

        Binding a tensor-parallel model makes the pool agree with the model's other ranks (a collective: call it on
        every rank).

        Raises:
            ValueError: on every rank, when the ranks' pools differ in pages, page size, ``max_seq_len``,
                ``max_reqs`` or prefix caching (their page tables could not stay the same).
        """
        current = self._model_ref() if self._model_ref is not None else None
        if current is model:
            self.drop_if_rewritten(model)  # (patch() again: a write into param.data since is seen here)
            return

        ranks = rank_group(attention_modules(model))
        if ranks is not None:
            geometry = {
                "num_pages": self.config.num_pages,
                "page_size": self.page_size,
                "max_seq_len": self.max_seq_len,
                "max_reqs": self.config.max_reqs,
                "prefix_cache": self.prefix_cache is not None,
            }
            ranks.check_equal("the PagePool", geometry, "every rank must build its pool with the same settings")
        self.ranks = ranks

        digest = self._fingerprint(model)
        # the same weights may still compute otherwise: another adapter state (a peft copy with its adapter
        # disabled), hooks, module code
        if self._model_fingerprint is not None and self.held_model_key() != (
                digest, self._fingerprints[model][0].behaviour):
            dropped = self._drop_prefixes()
            logger.info("PagePool bound to a model with other weights or behaviour: dropped %d cached prefix pages",
                        dropped)
        self._model_ref, self._model_fingerprint = weakref.ref(model), digest
        self._weights_version = self._fingerprints[model][0]

    def check_weights(self, model: torch.nn.Module) -> None:
        """Bind ``model`` if the pool holds another model's K/V, and drop the cached prefixes if the bound model's
        weights changed since they were computed: in place (an optimizer step, ``load_state_dict``, any in-place op
        on a parameter) or replaced (``load_state_dict(assign=True)``, ``.to(dtype)``, ``param.data = ...``).
        Called by a patched ``generate()`` before it looks a prompt up, and by :meth:`save_prefix_cache`.

        Buffers count as weights, and so do the model's forward hooks and peft adapter state (steering, ablations,
        ``disable_adapter()``): a hook added or removed, or an adapter switched, drops the cached prefixes too.
        In-place changes are seen through each tensor's version counter, so in-place writes into ``param.data``
        (which bypass it) are not; call :meth:`clear_prefix_cache` after those.
        """
        if self.model is not model:
            self.bind_model(model)
            return
        if self._weights_version is not None and self._weights_version.matches(model):
            return
        if self._weights_version is not None:
            dropped = self._drop_prefixes()
            logger.info("the model's weights, hooks, adapters or module code changed: dropped %d cached prefix pages",
                        dropped)
            self._model_fingerprint = self._fingerprint(model)
            self._weights_version = self._fingerprints[model][0]
            return
        self._weights_version = _WeightsVersion(model)

    def computes_as_checked(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is the bound model and computes as it did at the last :meth:`check_weights` (the same
        :class:`_WeightsVersion`: a few milliseconds for a model of 30 layers). A forward of the caller's own reads
        it where it stores prompt tokens: a change made after the cache's lookup and undone before its release (a
        hook for one forward) is seen by no later check."""
        version = self._weights_version
        return self.model is model and version is not None and version.matches(model)

    def drop_if_rewritten(self, model: torch.nn.Module, weights: str | None = None) -> bool:
        """Compare the bound ``model``'s weights with the digest of the last check, by their contents: writes into
        ``param.data`` (peft's ``merge_and_unload()`` and ``hotswap_adapter`` write so) move no version counter, so
        :meth:`check_weights` does not see them. Where they differ, drop the cached prefixes and take the digest
        again. One pass over the weights, taken only while prefixes are cached; done by ``patch()`` of a model this
        pool is bound to, and by :meth:`save_prefix_cache`. ``weights``: the model's
        :func:`~astrai_hf.persist.weights_fingerprint`, where the caller has taken it already.

        Returns:
            True when the prefixes were dropped.
        """
        from .persist import weights_fingerprint

        if (self.prefix_cache is None or not len(self.prefix_cache) or self._model_fingerprint is None
                or model is not self.model):
            return False
        if (weights_fingerprint(model) if weights is None else weights) == self._model_fingerprint.split(".", 1)[0]:
            return False
        dropped = self.clear_prefix_cache()
        logger.warning("the weights of the %s changed since the pool last checked them, in a way no check sees (a "
                       "write into param.data): dropped %d cached prefix pages computed by the old weights",
                       type(model).__name__, dropped)
        return True

    def _fingerprint(self, model: torch.nn.Module) -> str:
        """:func:`~astrai_hf.persist.model_fingerprint` of ``model``; its weights digest (one pass over the
        weights) is computed again only when they changed since the last time, so two models taking turns on one
        pool (a model and its assistant) pay it once each."""
        from .persist import config_fingerprint, weights_fingerprint

        memo = self._fingerprints.get(model)
        if memo is None or not memo[0].matches(model):
            memo = self._fingerprints[model] = (_WeightsVersion(model), weights_fingerprint(model))
        return f"{memo[1]}.{config_fingerprint(model)}"

    @property
    def weights_stamp(self) -> object | None:
        """A token that stays the same object while :meth:`check_weights` sees the bound model unchanged, and is
        another one after it saw a change (or bound another model); None before the first check. A holder of
        something computed from the model (a captured graph) compares it to learn, at no cost, when to look
        again."""
        return self._weights_version

    def held_model_key(self) -> tuple | None:
        """What the cached prefixes were computed by: the bound model's fingerprint and behaviour when they were
        last checked (None before a model is bound). Two moments with equal keys hold K/V of the same computation."""
        if self._model_fingerprint is None or self._weights_version is None:
            return None
        return self._model_fingerprint, self._weights_version.behaviour

    @property
    def model(self) -> torch.nn.Module | None:
        """The bound model, if it is still alive."""
        return self._model_ref() if self._model_ref is not None else None

    def save_prefix_cache(self, path: str | Path, model: torch.nn.Module | None = None) -> int:
        """Write every cached prefix page to a safetensors file (K/V per layer plus an index and a fingerprint of
        the model in the header). See :func:`astrai_hf.persist.save_prefix_cache`.

        Returns:
            pages written.
        """
        from .persist import save_prefix_cache

        with self.books():
            return save_prefix_cache(self, path, model)

    def load_prefix_cache(self, path: str | Path, model: torch.nn.Module | None = None) -> int:
        """Load pages written by :meth:`save_prefix_cache` into this pool's prefix cache.
        See :func:`astrai_hf.persist.load_prefix_cache`.

        Under tensor parallelism each rank saves and loads its own file (its heads; the file's fingerprint holds
        the rank's shard of the weights). The ranks then agree: an error on one rank is raised on all, and when
        they loaded different page counts every rank clears its prefix cache and raises ``ValueError``, since
        ranks that reuse different prefixes would feed the model different columns.

        Returns:
            pages loaded.
        """
        from .persist import load_prefix_cache

        loaded, failed = 0, None
        try:
            with self.books():
                loaded = load_prefix_cache(self, path, model)
        except Exception as e:
            failed = e
        try:
            agree(self.ranks, failed)
        finally:
            failed = None  # (held by the traceback's frame, it would make a cycle)
        if self.ranks is not None:
            try:
                self.ranks.check_equal(
                    "the number of prefix pages loaded", {"pages": loaded},
                    "every rank cleared its prefix cache; load each rank's own file into pools with the same room",
                )
            except ValueError:
                self.clear_prefix_cache()
                raise
        return loaded

    def __reduce_ex__(self, protocol):
        """A pool is neither pickled nor deep-copied (its storage is the K/V memory its caches share).

        Raises:
            TypeError: always.
        """
        raise TypeError("a PagePool cannot be pickled or copied: share the one pool, build another with "
                        "PagePool.from_model(model), or save its cached prefixes with pool.save_prefix_cache(path)")

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PagePool({self.config.spec.model_type or 'model'}: {s['num_pages']} pages x {self.page_size} tokens, "
            f"{s['num_used_pages']} used, {self.dtype}, max_seq_len={self.max_seq_len}, max_reqs={self.config.max_reqs})"
        )


def attention_modules(model: torch.nn.Module, every_copy: bool = False) -> list[torch.nn.Module]:
    """The self-attention modules of ``model``'s text decoder that own a KV cache layer, ordered by ``layer_idx``.
    Vision and audio towers of a multimodal model (their attention modules may carry a ``layer_idx`` too) are left
    out: the decoder is ``model.get_decoder()`` where transformers finds one. With ``every_copy``, every module of a
    ``layer_idx`` (peft's ``modules_to_save`` keeps the original next to the copy that runs), else the first."""
    found = _attention_by_layer_idx(model)
    return [m for i in sorted(found) for m in (found[i] if every_copy else found[i][:1])]


def attention_modules_in_place(model: torch.nn.Module) -> tuple[list[torch.nn.Module], bool]:
    """``attention_modules(model, every_copy=True)``, and whether the modules come in another order than their
    ``layer_idx`` in the model (layers reordered without renumbering) or one of them in two places (a layer
    repeated in the list), in one walk of the model."""
    repeated: list = []
    found = _attention_by_layer_idx(model, repeated)
    order = list(found)
    return [m for i in sorted(found) for m in found[i]], order != sorted(order) or bool(repeated)


def _attention_by_layer_idx(model: torch.nn.Module, repeated: list | None = None) -> dict[int, list]:
    """The modules :func:`attention_modules` finds, by ``layer_idx``, in the order the model holds them, each once;
    ``repeated``, where given, gets each module met again in another place."""
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except Exception:  # transformers raises for models it has no rule for
            decoder = None
        if isinstance(decoder, torch.nn.Module):
            root = decoder
    found: dict[int, list] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:  # every module in the order named_modules(remove_duplicate=False) gives, without building names
        module = stack.pop()
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))
        # (from the instance's dict where nothing else can give it: a module's getattr of a missing name raises
        # inside; a class's attribute, property or __getattr__ of its own is read as getattr reads it)
        cls = type(module)
        if class_defines(cls, "layer_idx") or cls.__getattr__ is not _MODULE_GETATTR:
            idx = getattr(module, "layer_idx", None)
        else:
            idx = vars(module).get("layer_idx")
        if not isinstance(idx, int):
            continue
        if _self_attention_class(type(module)):
            if id(module) in seen:
                if repeated is not None:
                    repeated.append(module)
                continue
            seen.add(id(module))
            found.setdefault(idx, []).append(module)
    return found


_MODULE_GETATTR = torch.nn.Module.__getattr__
_SELF_ATTENTION_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> bool


def _self_attention_class(cls: type) -> bool:
    """Whether modules of ``cls`` are self-attention: a class of the name (a subclass of yours is named as it
    likes, so its bases count), not cross-attention."""
    known = _SELF_ATTENTION_CLASSES.get(cls)
    if known is None:
        known = _SELF_ATTENTION_CLASSES[cls] = (any("Attention" in k.__name__ for k in cls.__mro__)
                                                and "Cross" not in cls.__name__)
    return known


_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # of config.layer_types


@contextlib.contextmanager
def _short_of_memory(message: str) -> Iterator[None]:
    """Re-raise an allocation that ran out of memory with ``message`` (and the allocator's first line)."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if isinstance(e, NotImplementedError) or not ("alloc" in str(e) or "out of memory" in str(e)
                                                     or isinstance(e, MemoryError)):
            raise  # not a shortage of memory (a device backend this build lacks)
        raise type(e)(f"{message} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e


def unsupported_model(model: torch.nn.Module) -> str | None:
    """Why a pool cannot hold ``model``'s cache, or None when it can.

    Refused: encoder-decoder models and cross-attention (K/V of another sequence); layers without self-attention
    (hybrids of attention with convolution, state-space or linear-attention layers, whose state is no K/V cache);
    models that keep a cache class of their own; K and V of different head sizes (multi-head latent attention).
    """
    config = model.config
    text = _text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        return _ENCODER_DECODER
    cross = sorted({type(m).__name__ for m in model.modules()
                    if getattr(m, "is_cross_attention", False) is True or "Cross" in type(m).__name__})
    if cross or any(hasattr(m, "encoder_attn") for m in model.modules()):
        return f"its layers have cross-attention ({', '.join(cross) or 'encoder_attn'})"
    varying = _per_layer_geometry(text)
    if varying is not None:
        return varying
    supports_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_cache is not None and not supports_cache():
        return "it keeps a cache class of its own instead of transformers' Cache"
    types = getattr(text, "layer_types", None) or []
    other = sorted({t for t in types if t not in _ATTENTION_LAYER_TYPES})
    layers = getattr(text, "num_hidden_layers", None)
    found = sorted(m.layer_idx for m in attention_modules(model))
    if (found and isinstance(layers, int) and found == list(range(layers)) and other
            and not any(w in k.lower() for k in other for w in _STATE_KINDS)):
        # every layer has a self-attention module, and the config names a kind of its own for some of them
        return (f"its config.layer_types name layers of a kind paged attention does not serve "
                f"({', '.join(other)}): their cache holds more than each token's K/V (an indexer's keys, "
                "compressed blocks)")
    attention = {id(m) for m in attention_modules(model, every_copy=True)}
    layer_list = _attention_layer_list(model, attention)
    repeated = _repeated_attention(layer_list, attention)
    if repeated is not None:
        return repeated
    present = len(layer_list) if layer_list is not None else None
    if found and not other and isinstance(layers, int) and found != list(range(layers)) and present:
        where = f"{present} layers hold self-attention modules of layer_idx {found}"
        if present != layers:
            return (f"config.num_hidden_layers is {layers} but {where} (layers added, removed or reordered "
                    f"without updating the config?); set config.num_hidden_layers = {present} and each attention "
                    f"module's layer_idx to its place (0 to {present - 1})")
        return (f"its {where}, not 0 to {present - 1} (layers reordered or replaced without renumbering?); set each "
                "attention module's layer_idx to its place")
    moved = _moved_across_layer_types(layer_list, types)
    if moved is not None:
        return moved
    if found and (other or (isinstance(layers, int) and found != list(range(layers)))):
        kinds = f" ({', '.join(other)} in config.layer_types)" if other else ""
        return (f"a hybrid model: self-attention in layers {found} of {layers}; the other layers{kinds} keep a "
                "state that is not a K/V cache")
    return _state_layers(text) or _kv_geometry(text)


def _attention_layer_list(model: torch.nn.Module, attention: set[int]) -> torch.nn.ModuleList | None:
    """``model``'s list of layers when each of them has self-attention (a model whose layers were removed, added or
    reordered by hand: a hybrid's list holds layers without it too), else None. ``attention``: the ids of the
    modules ``attention_modules(model, every_copy=True)`` gives."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(
                any(id(m) in attention for m in layer.modules()) for layer in module):
            return module
    return None


def _repeated_attention(layers: torch.nn.ModuleList | None, attention: set[int]) -> str | None:
    """Why a model whose list of layers holds one attention module in two places (a layer repeated by reference,
    as layer-repeat experiments build) cannot be served, or None: both places would store their K/V as the one
    ``layer_idx`` the module carries (stock's cache breaks on it too). ``layers``: the model's
    :func:`_attention_layer_list`; ``attention``: the ids of its attention modules."""
    if layers is None:
        return None
    first: dict[int, int] = {}
    for place, layer in enumerate(layers):
        for m in layer.modules():
            if id(m) in attention and first.setdefault(id(m), place) != place:
                return (f"its layers {first[id(m)]} and {place} hold one attention module (a layer repeated in the "
                        "list by reference), whose K/V both would store as layer_idx "
                        f"{m.layer_idx}; give each place a copy of its own (copy.deepcopy) and set each attention "
                        "module's layer_idx to its place")
    return None


def _moved_across_layer_types(layers: torch.nn.ModuleList | None, types: list) -> str | None:
    """Why a model whose layers (its :func:`_attention_layer_list`) were reordered without renumbering cannot be
    served, or None: stock applies the mask of the kind ``config.layer_types`` gives a layer's place (sliding or
    full), and paged attention the window of its module's ``layer_idx``; they differ where a layer moved to a place
    of the other kind."""
    if not types or layers is None or len(layers) != len(types):
        return None
    for place, layer in enumerate(layers):
        for m in attention_modules(layer):
            idx = m.layer_idx
            if idx != place and isinstance(idx, int) and 0 <= idx < len(types) and types[idx] != types[place]:
                return (f"its layer {place} holds the attention module of layer_idx {idx}, a "
                        f"{types[idx]} layer at a place config.layer_types makes {types[place]} (layers reordered "
                        "without renumbering?); set each attention module's layer_idx to its place")
    return None


def unsupported_config(config) -> str | None:
    """Why a pool cannot hold the cache of a model of ``config`` (a transformers ``PretrainedConfig``), or None:
    what :func:`unsupported_model` refuses that the config alone tells (encoder-decoder, layers of another kind
    than attention, layers of different K/V geometry, multi-head latent attention)."""
    text = _text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        return _ENCODER_DECODER
    return _cross_attention(text) or _per_layer_geometry(text) or _state_layers(text) or _kv_geometry(text)


def _cross_attention(text) -> str | None:
    """Cross-attention layers the config tells of (Mllama's ``cross_attention_layers``, ``add_cross_attention``;
    TrOCR's causal LM always has them)."""
    layers = getattr(text, "cross_attention_layers", None)
    if isinstance(layers, (list, tuple)) and layers:
        return f"its layers {list(layers)} have cross-attention (cross_attention_layers in its config)"
    if getattr(text, "add_cross_attention", False) is True:
        return "its layers have cross-attention (add_cross_attention=True in its config)"
    if getattr(text, "model_type", None) == "trocr":
        return "its layers have cross-attention (TrOCR's decoder attends to an image encoder's states)"
    return None


_ENCODER_DECODER = "an encoder-decoder model (its decoder attends to the encoder's states)"
# the fields that list each layer's kind, and the kinds that keep a state that is no K/V cache
_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types")
_STATE_KINDS = ("mamba", "conv", "linear", "recurrent", "hybrid", "ssm", "rwkv", "deltanet", "compress")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _state_layers(text) -> str | None:
    """Layers that keep a recurrent state (state-space, convolution, linear attention), read from the config."""
    for field in _LAYER_KIND_FIELDS:
        try:
            kinds = getattr(text, field, None)
        except Exception:  # a property of the config class that needs fields this config lacks
            kinds = None
        if isinstance(kinds, (list, tuple)):
            other = sorted({k for k in kinds if isinstance(k, str) and any(w in k.lower() for w in _STATE_KINDS)})
            if other:
                return (f"its config.{field} name {', '.join(other)} layers, which keep a state that is not a "
                        "per-token K/V cache (a hybrid model's state-space, convolution, recurrent or "
                        "linear-attention layers, or compressed blocks)")
    ssm = sorted(k for k in vars(text) if k.startswith(("mamba_", "ssm_")))
    if ssm:
        return f"a hybrid model: state-space layers next to attention ({', '.join(ssm[:3])} in its config)"
    return None


def _kv_geometry(text) -> str | None:
    """K/V that one pool geometry cannot store: a latent vector (multi-head latent attention), or K and V of
    different head sizes."""
    v_dim = getattr(text, "v_head_dim", None)
    k_dim = getattr(text, "qk_head_dim", None) or getattr(text, "head_dim", None)
    rank = getattr(text, "kv_lora_rank", None)
    if rank is not None:
        return f"it compresses K/V into a latent vector (kv_lora_rank={rank}: multi-head latent attention)"
    if v_dim is not None and k_dim is not None and v_dim != k_dim:
        return f"K and V have different head sizes ({k_dim} and {v_dim})"
    return None


_GEOMETRY_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "qk_head_dim", "v_head_dim",
                    "kv_lora_rank")


def _per_layer_geometry(text) -> str | None:
    """Why the layers of ``text`` (a text config) cannot share one pool geometry, or None: a per-layer config
    (transformers' heterogeneous configs, Gemma 4 with ``global_head_dim != head_dim``) refuses a global read of a
    field that differs between layers."""
    for name in _GEOMETRY_FIELDS:
        try:
            getattr(text, name, None)
        except Exception as e:
            if "per-layer" not in str(e) and "PerLayer" not in type(e).__name__:
                raise
            return (f"its layers differ in {name} (a per-layer config: {type(e).__name__}); a pool stores one K/V "
                    "geometry for all layers")
    return None


def model_kv_spec(model: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> KVSpec:
    """The KV geometry ``model`` produces on this process: its config's, with the KV heads this rank holds under
    tensor parallelism.

    Raises:
        ValueError: the config lacks the geometry, or the heads do not split into whole heads per rank.
    """
    spec = KVSpec.from_config(model.config)
    layers = attention_modules(model) if layers is None else layers
    heads = kv_heads_per_rank(model, layers, spec.num_kv_heads)
    if heads != spec.num_kv_heads:
        spec = dataclasses.replace(spec, num_kv_heads=heads)
    # a config may name a head_dim its family ignores (GPT-NeoX, OPT, GPT-2 divide hidden_size by the heads): the
    # head size the attention modules compute with, where they all say one, is what their K/V have
    sizes = {_head_size(m) for m in layers}
    if len(sizes) == 1 and (size := sizes.pop()) is not None and size != spec.head_dim:
        spec = dataclasses.replace(spec, head_dim=size)
    return spec


def _head_size(module: torch.nn.Module) -> int | None:
    """The head size an attention module says it computes with (``head_dim``, or GPT-NeoX's ``head_size``)."""
    for name in ("head_dim", "head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def accelerate_hooks(module: torch.nn.Module) -> list:
    """The accelerate hooks attached to ``module`` itself (a ``SequentialHook`` unpacked), in order."""
    hook = getattr(module, "_hf_hook", None)
    return list(getattr(hook, "hooks", None) or ([hook] if hook is not None else []))


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device of the first accelerate hook on ``module`` or its submodules, or None."""
    for m in module.modules():
        for h in accelerate_hooks(m):
            device = getattr(h, "execution_device", None)
            if device is not None:
                return torch.device(device)
    return None


def _module_device(module: torch.nn.Module) -> torch.device:
    """Where the module computes: accelerate's execution device when a ``device_map`` hook is attached to it or,
    failing that, to one of its submodules (an offloaded layer keeps its weights on ``meta`` and runs elsewhere;
    ``cpu_offload`` and a map that names the projections hook those), else where its parameters are."""
    device = _hook_device(module)
    if device is not None:
        return device
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    for tensor in tensors:
        if not tensor.is_meta:
            return tensor.device
    if tensors:
        return tensors[0].device  # meta: no data, and nothing says where it would run (refused by from_model)
    # no parameters at all: torch's dynamically quantized Linear layers keep packed weights, which run on the CPU
    return torch.device("cpu")


def _layers_by_dtype(modules: list[torch.nn.Module]) -> dict[torch.dtype, list[int]]:
    """The ``layer_idx`` of the attention modules ``modules`` by the dtype each computes K/V in, in order of first
    appearance (one with no floating weights, which computes in the dtype it is fed, left out)."""
    layers: dict[torch.dtype, list[int]] = {}
    for module in modules:
        dtype = _module_dtype(module)
        if dtype is not None:
            layers.setdefault(dtype, []).append(module.layer_idx)
    return layers


def _mixed_dtypes(model: torch.nn.Module, layers: dict[torch.dtype, list[int]]) -> str:
    """Why a pool cannot hold the K/V of ``model``, whose attention layers compute in several dtypes (``layers``,
    from :func:`_layers_by_dtype`; a layer kept in float32 in a bfloat16 model), naming the layers of each."""
    each = "; ".join(f"layers {idx} in {dtype}" for dtype, idx in layers.items())
    return (f"{type(model).__name__}'s attention layers compute K/V in several dtypes ({each}), and a PagePool holds "
            "one; cast them to one dtype (model.to(dtype)) to run it paged")


def _module_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype an attention module computes K/V in: that of its first floating parameter; None where it has none
    (weight-only quantized projections, int8 weights with scales kept in buffers: they compute in the dtype they
    are fed)."""
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def _activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model`` computes in where its attention layers have no floating weights: its input embeddings',
    else its config's (float32 where it names none)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # (a model that does not say where they are)
        embeddings = None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
        return weight.dtype
    return _resolve_dtype(model.config)


def _resolve_dtype(config) -> torch.dtype:
    # (`torch_dtype` only where a config has no `dtype`: reading it logs a deprecation on transformers 5)
    dtype = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(dtype, str) and hasattr(torch, dtype):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _resolve_devices(device, num_layers: int) -> tuple[torch.device, ...]:
    if device is None:
        return (torch.device("cpu"),) * num_layers
    if isinstance(device, (str, torch.device, int)):
        return (as_device(device),) * num_layers
    devices = tuple(as_device(d) for d in device)
    if len(devices) != num_layers:
        raise ValueError(f"device lists {len(devices)} devices, expected one per layer ({num_layers})")
    return devices


def as_device(device) -> torch.device:
    """``device`` (a ``torch.device``, a string such as ``"cuda:1"``, or an index) as tensors on it report theirs:
    ``"cpu"`` without an index, an accelerator with its current index filled in.

    Raises:
        ValueError: ``device`` is not a device torch knows here, or names a CUDA device this process cannot see.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device here: {e}") from e
    # as tensors report it (torch.device("cuda") != torch.device("cuda:0"), and CPU tensors carry no index), so that
    # a layer's K/V compare equal to the device the pool keeps them on
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"device {str(device)!r}: this process sees {count} CUDA devices")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.index is None and device.type != "meta":
        backend = getattr(torch, device.type, None)
        try:
            index = backend.current_device()
        except Exception:  # a backend without the notion (mps): its tensors report index 0
            index = 0
        device = torch.device(device.type, index if isinstance(index, int) else 0)
    return device


def check_holds_a_page(max_tokens: int, page_size: int) -> None:
    """Raise ValueError when ``max_tokens`` (a pool's capacity in token slots) is less than one page of
    ``page_size`` slots."""
    if max_tokens < page_size:
        raise ValueError(f"max_tokens={max_tokens} is smaller than one page (page_size={page_size})")


def _size_pages(spec, page_size, dtype, layer_devices, max_tokens, memory_fraction, table=(1, None)) -> int:
    """Usable pages for ``max_tokens``, or for ``memory_fraction`` of each device's free memory: there the budget
    holds every page the storage allocates (the trash page too) and, on the first layer's device, the two int32
    ``req_to_token`` tables of ``table = (rows, longest row or 0 where unknown)`` (no wider than the capacity)."""
    if max_tokens is not None and memory_fraction is not None:
        raise ValueError(f"pass max_tokens ({max_tokens}) or memory_fraction ({memory_fraction}), not both")
    if memory_fraction is not None:
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, numbers.Real):
            raise TypeError(f"memory_fraction must be a number in (0, 1], got {memory_fraction!r}")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        memory_fraction = float(memory_fraction)
        bytes_by_device = page_bytes_by_device(spec, page_size, dtype, layer_devices)
        rows, longest = table
        per_token = rows * 2 * 4  # (the slots and the token ids, int32)

        def fits(device, page_bytes) -> int:
            budget = int(_free_bytes(device) * memory_fraction) - page_bytes  # (the trash page)
            if device != layer_devices[0]:
                return budget // page_bytes
            # a table as wide as the capacity, or as the longest row where one is known
            wide = budget // (page_bytes + per_token * page_size)
            narrow = (budget - per_token * longest) // page_bytes if longest else 0
            return max(wide, narrow)

        device, pages = min(((d, fits(d, b)) for d, b in bytes_by_device.items()), key=lambda item: item[1])
        if pages < 1:
            held = (f" and the req_to_token table ({rows * 8} bytes per token of its width)"
                    if device == layer_devices[0] else "")
            raise ValueError(
                f"memory_fraction={memory_fraction} of the free memory on {device} does not hold two pages (one "
                f"usable, one trash page: {bytes_by_device[device]} bytes each there){held}; pass a larger "
                "memory_fraction, or max_tokens")
        return pages
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    check_holds_a_page(max_tokens, page_size)
    pages = max_tokens // page_size
    if (pages + 1) * page_size > 2**31 - 1:  # the req_to_token table holds slots (the trash page's too) as int32
        raise ValueError(f"max_tokens={max_tokens} makes {(pages + 1) * page_size} token slots, more than the "
                         f"req_to_token table's int32 entries address ({2**31 - 1})")
    return pages


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


class ModelLayout:
    """What a model's computation is made of, besides its tensors' values: what a CUDA graph of its forward holds
    fixed until captured again.

    - the storage of each parameter and buffer, held by weak reference (a new one: ``load_state_dict(assign=True)``,
      ``.to(dtype)``, ``param.data = ...``, ``resize_token_embeddings()``, a module assigned anew), and how it is
      viewed (dtype, shape, strides, offset: ``w.data = w.data.t()``);
    - the packed weights of torch's quantized modules, by identity;
    - each module, by identity (a submodule swapped for another, even one of the same class and values:
      ``act_fn = nn.Softplus(beta=8)``), and its code and settings: its class, a ``forward`` replaced on the class
      or the instance, a float attribute or ``sliding_window`` changed (``scaling``);
    - the forward hooks and pre-hooks on its modules and the global ones (activation steering, ablations, probes);
    - the adapter state of peft tuner layers (``disable_adapter()``, ``set_adapter()``, merges, scales);
    - the config fields that change what the layers compute (:func:`~astrai_hf.persist.config_fingerprint`:
      a ``sliding_window`` or RoPE setting edited on a loaded model).

    Values written in place (an optimizer step, ``load_state_dict``) leave it as it is. Tensors offloaded to disk
    or CPU by a ``device_map`` are not watched, nor is what a hook reads from its own Python state (a hook object
    whose attributes change keeps its id: a graph keeps what it read at the capture). A check walks every module
    and tensor (a few milliseconds for a model of 30 layers).
    """

    def __init__(self, model: torch.nn.Module, tensors: list[torch.Tensor] | None = None):
        tensors = _local_tensors(model) if tensors is None else tensors
        self.storages = [weakref.ref(_storage_of(t)) for t in tensors]
        self.views = [_view_of(t) for t in tensors]
        self.packed = [weakref.ref(obj) for obj in packed_params(model).values()]
        self.modules = [weakref.ref(m) for m in model.modules()]
        self.behaviour = _behaviour(model)
        self.config = _config_digest(model)

    def matches(self, model: torch.nn.Module, tensors: list[torch.Tensor] | None = None) -> bool:
        """Whether ``model`` is still made as it was when this was taken."""
        tensors = _local_tensors(model) if tensors is None else tensors
        return (
            _same_objects(self.storages, map(_storage_of, tensors))
            and [_view_of(t) for t in tensors] == self.views
            and _same_objects(self.packed, packed_params(model).values())
            and _same_objects(self.modules, model.modules())
            and _behaviour(model) == self.behaviour
            and _config_digest(model) == self.config
        )


class _WeightsVersion(ModelLayout):
    """Whether a model computes as it did before, seen from outside its code: its :class:`ModelLayout`, and the
    values of its parameters and buffers (RoPE frequencies, scales), seen through the sum of their version counters
    (it grows with every in-place change, an optimizer step or ``load_state_dict``) and of the ``torch.optim``
    steps over them (a fused optimizer bumps no counter).

    Inference tensors (a model made under ``torch.inference_mode()``) keep no counter: their sums are compared
    instead, a read of them per call. Writes into ``param.data`` in place bypass the counters.
    """

    def __init__(self, model: torch.nn.Module):
        _watch_optimizer_steps()
        tensors = _local_tensors(model)
        super().__init__(model, tensors)
        self.version = _version_sum(tensors) + _optimizer_steps_of(model)
        self.sums = _inference_sums(tensors)

    def matches(self, model: torch.nn.Module, tensors: list[torch.Tensor] | None = None) -> bool:
        tensors = _local_tensors(model) if tensors is None else tensors
        return (
            _version_sum(tensors) + _optimizer_steps_of(model) == self.version
            and super().matches(model, tensors)
            and _inference_sums(tensors) == self.sums
        )


def _same_objects(refs: list, objects) -> bool:
    """Whether ``objects`` are, in order, the objects ``refs`` (weak references) point to."""
    objects = list(objects)
    return len(objects) == len(refs) and all(ref() is obj for ref, obj in zip(refs, objects))


def _values_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a sparse tensor's values (it has no storage of its own)."""
    if t.layout == torch.strided:
        return t
    return t._values() if t.layout == torch.sparse_coo else t.values()


def _view_of(t: torch.Tensor) -> tuple:
    """How ``t`` reads its storage: dtype, shape, strides and offset (``w.data = w.data.t()`` keeps the storage)."""
    t = _values_of(t)
    return t.dtype, tuple(t.shape), t.stride(), t.storage_offset()


def _storage_of(t: torch.Tensor):
    """The storage holding ``t``'s values."""
    return _values_of(t).untyped_storage()


def packed_params(model: torch.nn.Module) -> dict[str, object]:
    """The packed weights of torch's quantized modules (``quantize_dynamic``'s Linear and Embedding), by the name of
    the module holding them: they are neither parameters nor buffers, and ``set_weight_bias`` packs a new object."""
    found = {}
    for name, m in model.named_modules():  # the holder (LinearPackedParams) keeps the object as an attribute
        obj = m.__dict__.get("_packed_params")
        if isinstance(obj, torch.ScriptObject):
            found[name] = obj
    return found


def _inference_sums(tensors: list[torch.Tensor]) -> list[float]:
    """Weighted float64 sums of each inference tensor (a model built under ``torch.inference_mode()``): they keep
    no version counter, and ``load_state_dict`` or an edit inside that mode changes them in place. Read as a matrix
    (first dimension by the rest), each tensor gives its row sums and column sums, each weighted by its index, so
    values moved (rows or heads swapped, a permuted checkpoint loaded) change them as values changed do. Two
    reductions per tensor, two reads of the weights per call (for such models only), and one copy of the sums to
    the host per device."""
    by_device: dict[torch.device, list] = {}
    for t in tensors:
        if t.is_inference() and not t.is_quantized and not t.is_complex() and t.numel():
            by_device.setdefault(t.device, []).extend(_placed_sums(_values_of(t.detach())))
    return [x for sums in by_device.values() for x in torch.stack(sums).cpu().tolist()]


def _placed_sums(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """0-d float64 tensors: the sum of ``t`` (not empty), and its row and column sums (``t`` read as
    ``[len(t), -1]``) each weighted by its index."""
    if t.dim() == 0:
        return (t.to(torch.float64),)
    matrix = t.reshape(t.shape[0], -1)

    def placed(sums: torch.Tensor) -> torch.Tensor:
        return torch.dot(sums, torch.arange(1, len(sums) + 1, dtype=torch.float64, device=sums.device))

    rows = matrix.sum(1, dtype=torch.float64)
    return rows.sum(), placed(rows), placed(matrix.sum(0, dtype=torch.float64))


def _config_digest(model: torch.nn.Module) -> str:
    """The config's digest between calls, leaving out ``num_hidden_layers``: assisted decoding with early exit
    lowers it around each draft (whose K/V no prefix keeps), and a forward over fewer layers marks no token of
    its rows as stored, so no prefix computed by it is ever cached."""
    from .persist import config_fingerprint

    return config_fingerprint(model, ignore=frozenset({"num_hidden_layers"}))


def _hook_ids(hooks: dict) -> tuple:
    """The ids of the hooks in a module's hook dict that change what the model computes, leaving out
    :data:`_RECORDING_HOOKS` (transformers installs its output-capturing hooks for good on the first forward that
    asks for hidden states or attentions) and peft's (they hand one call's per-row arguments on: calls with
    those skip the prefix cache)."""
    return tuple(k for k, fn in hooks.items() if not _hook_origin(fn).startswith((*_RECORDING_HOOKS, "peft.")))


# hooks that see a forward's inputs or outputs only to record them, or to mark them as needing gradients
# (transformers' output capture, enable_input_require_grads, its underflow/overflow debugger), or that act on
# weights (torch's weight_norm and spectral_norm): each position of a forward's outputs is what it would be in
# any other shape of the same prompt. Others (NEFTune's noise scaled by the forward's length, peft's per-row
# task_ids and adapter_names) are shown the prompt as stock shows it.
_RECORDING_HOOKS = ("transformers.utils.output_capturing", "transformers.modeling_utils", "transformers.debug_utils",
                    "torch.nn.utils.")


def holds_tensor(value, depth: int = 4) -> bool:
    """Whether ``value`` is a tensor, or a dict, list or tuple (a ``ModelOutput`` too) holding one within ``depth``
    levels. A Cache holds tensors but is none of those."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(holds_tensor(v, depth - 1) for v in value)


def _hook_origin(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__module__", None) or ""


def has_caller_hooks(model: torch.nn.Module) -> bool:
    """Whether forward hooks or pre-hooks of the caller's run in ``model``'s forward: on its modules, or torch's
    global module hooks (activation steering, probes, ablations, activation patching). Such a hook may read or
    write a position or a row by its index in the forward's tensors (``out[:, 0]``, ``out[:, -1]``, a strength
    per sample) or record every position it is shown, so a forward of hooks sees the prompt in stock's shape:
    whole (no prefix-cache hit beyond the columns of a cache an earlier call returned), as the padded rectangle
    (not packed), each row computed (samples and beams of one prompt too). Left out: the hooks of
    :data:`_RECORDING_HOOKS`' modules."""
    from torch.nn.modules import module as nn_module

    def any_of(*dicts) -> bool:
        return any(not _hook_origin(fn).startswith(_RECORDING_HOOKS) for d in dicts for fn in list(d.values()))

    if any_of(nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks):
        return True
    return any((m._forward_hooks or m._forward_pre_hooks) and any_of(m._forward_hooks, m._forward_pre_hooks)
               for m in model.modules())


# int (or None) attributes that change what a layer computes, watched though ints are not in general
_WATCHED_SETTINGS = ("sliding_window", "attention_chunk_size")


def _code_and_settings(m: torch.nn.Module) -> tuple:
    """A module's code and settings: its class and the class's ``forward``, a ``forward`` set on the instance
    (astrai-hf's own wrapper left out), its public float attributes (``scaling``, ``attention_scaling``,
    ``variance_epsilon``, soft-caps) and its ``sliding_window``. Other flags and counters (bools, ints: ``gradient_checkpointing``, a flag a layer
    sets on its first forward, a call counter) are left out: they change between calls without changing what the
    model computes, and each change would empty the prefix cache."""
    cls = type(m)
    own = m.__dict__.get("forward")
    if getattr(own, "astrai_hf_wrapper", False) and isinstance(own, types.FunctionType):  # (a wrapper of another's
        own = getattr(own, "astrai_hf_replaces", None)  # copies the attributes) the instance forward it wraps, or None
    settings = tuple((k, v) for k, v in list(m.__dict__.items())  # (a copy: another thread may patch it)
                     if (type(v) is float and not k.startswith("_")) or k in _WATCHED_SETTINGS)
    return cls, getattr(cls, "forward", None), own, settings


def _behaviour(model: torch.nn.Module) -> tuple:
    """What changes a model's outputs besides its tensors: each module's code and settings (its class, a
    ``forward`` replaced on the class or the instance, a submodule swapped, a float attribute changed), the ids
    of the forward hooks on its modules and of the global module hooks (transformers' own left out), and each
    peft tuner layer's adapter state."""
    from torch.nn.modules import module as nn_module

    state = [_hook_ids(nn_module._global_forward_hooks), _hook_ids(nn_module._global_forward_pre_hooks)]
    for i, m in enumerate(model.modules()):
        state.append(_code_and_settings(m))
        if m._forward_hooks or m._forward_pre_hooks:
            hooks = (_hook_ids(m._forward_hooks), _hook_ids(m._forward_pre_hooks))
            if any(hooks):
                state.append((i, *hooks))
        adapters = _adapter_state(m)
        if adapters is not None:
            state.append((i, *adapters))
    return tuple(state)


def _adapter_state(m: torch.nn.Module) -> tuple | None:
    """A peft tuner layer's adapter state (adapters disabled, those active, those merged, the scaling), None for
    other modules."""
    cls = type(m)
    if not (isinstance(getattr(cls, "active_adapters", None), property)
            and isinstance(getattr(cls, "disable_adapters", None), property)):  # not a peft BaseTunerLayer
        return None
    return (bool(m.disable_adapters), tuple(m.active_adapters), tuple(getattr(m, "merged_adapters", ())),
            repr(getattr(m, "scaling", None)))


def portable_behaviour(model: torch.nn.Module) -> list:
    """:func:`_behaviour` in terms another process can compare (a saved prefix cache's fingerprint): each
    module's class and the ``forward`` set on it, as ``module.qualname`` with a digest of the code of a forward
    not defined in its class's body (a lambda, a closure, a partial: their code, constants, closure values and
    arguments); its float settings by ``repr``, and for torch's own modules (activations, say) its int and str
    settings too (``nn.Softplus(beta=8)``, ``nn.GELU(approximate="tanh")``); the hooks :func:`_hook_ids` keeps,
    by name and code; each peft tuner layer's adapter state. Wrappers that leave a forward's values as they are
    (accelerate's device-placement hooks, ``torch.compile``) count as the forward they wrap, so a file saved from
    a model dispatched by a ``device_map`` or compiled loads into the plain model."""
    from torch.nn.modules import module as nn_module

    state: list = [_hook_names(nn_module._global_forward_hooks), _hook_names(nn_module._global_forward_pre_hooks)]
    for i, m in enumerate(model.modules()):
        cls, cls_forward, own, settings = _code_and_settings(m)
        if cls.__module__.startswith("torch.nn."):  # (their ints and strs are settings, never counters)
            settings = tuple((k, v) for k, v in list(m.__dict__.items())
                             if type(v) in (float, int, str) and not k.startswith("_"))
        own, device_hooks = _unwrapped(m, own)
        state.append([i, _portable_name(cls), _forward_name(cls, cls_forward), _forward_name(cls, own),
                      [[k, repr(v)] for k, v in settings], device_hooks])
        hooks = (_hook_names(m._forward_hooks), _hook_names(m._forward_pre_hooks))
        if any(hooks):
            state.append([i, *hooks])
        adapters = _adapter_state(m)
        if adapters is not None:
            state.append((i, *adapters))  # (JSON writes a tuple as a list)
    return state


# accelerate's hooks that move a module's inputs, weights and outputs between devices and change no value
_DEVICE_HOOKS = frozenset({"ModelHook", "AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook", "LayerwiseCastingHook"})


def _unwrapped(m: torch.nn.Module, own) -> tuple:
    """The forward set on ``m``'s instance under ``torch.compile`` (which keeps it in ``__wrapped__``) and
    accelerate's device hooks (``_old_forward``), None where that is the class's own ``forward``; and the names of
    accelerate hooks on ``m`` other than device placement (a ``ModelHook`` of the caller's that edits outputs)."""
    other_hooks: list[str] = []
    for _ in range(8):
        if isinstance(own, types.MethodType) and own.__self__ is m and own.__func__ is getattr(type(m), "forward", None):
            return None, other_hooks  # (checked before unwrapping: the class's forward may be under no_grad itself)
        fn = own.func if isinstance(own, functools.partial) else own
        defined_in = getattr(fn, "__globals__", {}).get("__name__", "")
        if isinstance(own, functools.partial) and defined_in == "accelerate.hooks":
            hook = m.__dict__.get("_hf_hook")
            for h in getattr(hook, "hooks", None) or (hook,):  # (a SequentialHook holds several)
                if type(h).__name__ not in _DEVICE_HOOKS or not type(h).__module__.startswith("accelerate."):
                    other_hooks.append(f"{_portable_name(h)}:{_settings_text(h)}")
            inner = m.__dict__.get("_old_forward")
        elif defined_in == "torch._dynamo.eval_frame":
            inner = getattr(own, "__wrapped__", None)
        else:
            break
        if inner is None:
            break
        own = inner
    return own, other_hooks


def _settings_text(obj) -> str:
    """The plain values an object holds (numbers, strings, and tuples of them), as text."""
    values = getattr(obj, "__dict__", {})
    return repr(sorted((k, v) for k, v in values.items() if _plain(v)))


def _plain(v) -> bool:
    return v is None or type(v) in (bool, int, float, str) or (type(v) is tuple and all(_plain(x) for x in v))


def _code_digest(fn) -> str:
    """A digest of what a function computes from its arguments: its bytecode, constants (nested functions' code
    too) and names, the plain values of its closure (by type where not plain), and a partial's arguments."""
    h = hashlib.blake2b(digest_size=8)
    while isinstance(fn, functools.partial):
        h.update(repr([a if _plain(a) else type(a).__qualname__ for a in fn.args]).encode())
        h.update(repr(sorted((k, v if _plain(v) else type(v).__qualname__) for k, v in fn.keywords.items())).encode())
        fn = fn.func
    fn = getattr(fn, "__func__", fn)

    def add_code(code) -> None:
        h.update(code.co_code)
        h.update(repr(code.co_names).encode())
        for c in code.co_consts:
            add_code(c) if isinstance(c, types.CodeType) else h.update(repr(c).encode())

    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    add_code(code)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
        h.update((repr(value) if _plain(value) else type(value).__qualname__).encode())
    return h.hexdigest()


def _forward_name(cls: type, fn) -> str:
    """:func:`_portable_name` of a module's forward, with :func:`_code_digest` where it is not a function defined
    in the body of a class of ``cls``'s MRO (transformers' and torch's own keep their names alone: a file loads
    under another release of them)."""
    name = _portable_name(fn)
    inner = getattr(fn, "__func__", fn)
    if fn is None or (isinstance(inner, types.FunctionType) and any(
            vars(c).get(inner.__name__) is inner and c.__module__ == inner.__module__
            and inner.__qualname__ == f"{c.__qualname__}.{inner.__name__}" for c in cls.__mro__)):
        return name
    return f"{name}#{_code_digest(fn)}"


def _portable_name(obj) -> str:
    """``module.qualname`` of a class or function (a bound method's function, a partial's ``func``), the class
    name of another callable object; empty for None."""
    if obj is None:
        return ""
    if isinstance(obj, functools.partial):
        return f"partial({_portable_name(obj.func)})"
    obj = getattr(obj, "__func__", obj)
    if not isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        obj = type(obj)
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def _hook_names(hooks: dict) -> list[str]:
    """The names and code digests of the hooks :func:`_hook_ids` keeps, in order (a hook object by its class and
    plain settings)."""
    kept = set(_hook_ids(hooks))
    return [f"{_portable_name(fn)}#{_code_digest(fn) or _settings_text(fn)}" for k, fn in list(hooks.items())
            if k in kept]


# optimizer steps per parameter: a fused optimizer (AdamW(fused=True), transformers' Trainer default
# adamw_torch_fused) writes the parameters without bumping their version counters
# (keyed by id(): a tensor's == is elementwise, which weak-key dicts call; an entry goes when its tensor does)
_OPTIMIZER_STEPS: dict[int, int] = {}
_STEP_HOOK = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:  # torch's optimizers leave a parameter without a gradient as it is
                continue
            n = _OPTIMIZER_STEPS.get(id(p))
            if n is None:
                weakref.finalize(p, _OPTIMIZER_STEPS.pop, id(p), None)
                n = 0
            _OPTIMIZER_STEPS[id(p)] = n + 1


def _watch_optimizer_steps() -> None:
    """Count every optimizer step per parameter from now on (a global post-step hook of ``torch.optim``, installed
    once)."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK = register_optimizer_step_post_hook(_count_optimizer_step)


def _optimizer_steps_of(model: torch.nn.Module) -> int:
    if not _OPTIMIZER_STEPS:
        return 0
    return sum(_OPTIMIZER_STEPS.get(id(p), 0) for p in model.parameters())


def _version_sum(params: list[torch.Tensor]) -> int:
    # inference tensors (a model built under torch.inference_mode()) keep no version counter, and cannot be
    # changed in place outside that mode
    return sum(p._version for p in params if not p.is_inference())


def _local_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shard of each parameter and buffer (DTensor), leaving out those offloaded by a ``device_map``
    (``meta`` between forwards: accelerate loads a fresh tensor for every forward, so their storages never stay)."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in (*model.parameters(), *model.buffers()))
    return [t for t in local if not t.is_meta]
