"""patch(model) / unpatch(model): route a model's generate() through a PagePool with paged attention."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import logging
import numbers
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import attention, packing
from .cache import (PATCH_STATE_ATTR, HeldTokens, PagedCache, autocast_on, cache_kwarg, check_rows_have_tokens,
                    empty_rows, forget_rope_deltas, left_padding, underlying_model)
from .config import (OWN_ATTENTION, KVSpec, as_count, as_flag, class_attr, class_defines,
                     rope_depends_on_length)
from .distributed import agree
from .errors import CacheFullError
from .graphs import CaptureRefused, DecodeGraphRunner
from .interrupts import interrupts_deferred
from .metadata import StepMetadata
from .pool import PagePool, attention_modules, attention_modules_in_place, holds_tensor, unsupported_model

_STATE_ATTR = PATCH_STATE_ATTR
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PatchState:
    """What a patched model carries: its default pool, the step being run, and what to restore on unpatch."""

    pool: PagePool
    cache_kwarg: str
    attn_configs: list
    saved_attrs: dict = field(default_factory=dict)
    install_token: object = None  # new per _install(): wrappers of an earlier install (or after unpatch) pass through
    # the forward and generate _install() put on the model, held weakly (they close over this state)
    wrappers: dict = field(default_factory=dict)
    family_undo: list = field(default_factory=list)
    step: StepMetadata | None = None
    step_pool: PagePool | None = None
    # the pools checked against the model, held weakly (an id() could name a later pool at a freed one's address)
    checked_pools: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    packable: bool = False
    pack_prefill: bool = False
    prefill_chunk_tokens: int | None = None
    cuda_graphs: bool = False
    graphs_given: bool | None = None  # patch()'s cuda_graphs as given (None: the default, for where the model is)
    rope_by_length: bool = False  # RoPE frequencies depend on the forward's length: no prefix reuse, no chunks
    embeds_token_types: bool = True  # token types (zeros too) enter the embeddings: no prefix reuse with them
    runners: dict = field(default_factory=dict)  # id(pool) -> DecodeGraphRunner
    # modules whose forward changes in training mode or checks for padding (watched_modules), listed at each call
    watched: WatchedModules = field(default_factory=lambda: WatchedModules([], [], []))
    # id(attention module) -> the sliding window its config gives, where the module's own attribute disagrees
    windows: dict = field(default_factory=dict)
    # id(attention module) -> (weak reference to the module holding its list of layers, the layer's place there),
    # found again when the modules change (see _mask_places)
    mask_places: dict | None = None
    # the sizing patch() built the default pool with (None: the caller gave the pool); such a pool is rebuilt when
    # the model is moved to another dtype or device
    own_pool_kwargs: dict | None = None
    module_refs: list = field(default_factory=list)  # weak references to the attention modules
    model_ref: object = None  # a weak reference to the patched model
    forward: object = None  # the model's own forward, which the patched one wraps (holding the model weakly)
    generating: int = 0  # patched generate() calls under way (nested: peft's generate calls the base model's)
    continuous_batching: int = 0  # generate(cache_implementation="paged") calls under way (they hold the lock)
    # one paged generate() / forward at a time per model: calls from several threads run one after another
    lock: threading.RLock = field(default_factory=threading.RLock)

    # Nothing here holds the model or its modules strongly: the model and its modules hold this state, and a
    # cycle through them would be freed only by the garbage collector, keeping the pool's K/V memory until then.
    @property
    def modules(self) -> list:
        """The attention modules."""
        return [m for m in (ref() for ref in self.module_refs) if m is not None]


@contextlib.contextmanager
def _one_call(state: PatchState, pool: PagePool | None = None, *also) -> Iterator[None]:
    """A call of a patched model: one at a time per model (its lock) and per pool (the pool's lock, which
    :func:`patch` takes too): a call of another model on the same pool between two steps, or a model patched onto
    it, would rebind the pool and clear its prefix cache under this call. Models on pools of their own never wait
    for each other, so calls that wait on another thread's call of another model (a worker thread, a streamer's
    consumer) do not hang. ``also``: further (state, pool) pairs the call will use (an assistant model's), whose
    locks are taken with these, in the order of :func:`_call_locks`."""
    with contextlib.ExitStack() as stack:
        while True:
            locks, own = _call_locks(state, pool, *also)
            for lock in locks:
                stack.enter_context(lock)
            if all(s.pool is p for s, p in own):
                break
            # patch() swapped a model's pool while this call waited: the lock taken is the old pool's
            stack.close()
        yield


def _call_locks(*items) -> tuple[list, list]:
    """The locks a call takes (``items``: patch states, each followed by the pool its call uses or None for its
    own), in one order for every thread (by id), so that calls taking several, a generate() and its assistant's,
    never wait on each other in a cycle; and the (state, pool) pairs read from a state, which the caller checks
    once it holds the locks."""
    locks, own = {}, []
    for state, pool in zip(items[::2], items[1::2]):
        if pool is None:
            pool = state.pool
            own.append((state, pool))
        locks[id(state.lock)] = state.lock
        locks[id(pool.call_lock)] = pool.call_lock
    return [locks[k] for k in sorted(locks)], own


def patch(
    model: torch.nn.Module,
    pool: PagePool | None = None,
    *,
    pack_prefill: bool = True,
    prefill_chunk_tokens: int | None = None,
    cuda_graphs: bool | None = None,
    **pool_kwargs,
) -> torch.nn.Module:
    """Route ``model.generate()`` and forwards with a :class:`PagedCache` through paged attention over a pool.

    After the call ``model.generate(...)`` without a cache argument uses a fresh ``PagedCache`` on
    ``get_pool(model)`` and returns its pages when it finishes. Forwards with any other cache (or none) run the
    model's own attention, unchanged. Patching a patched model again applies this call's settings (its defaults
    included) and swaps the pool when one is given or sized; :func:`patched` restores the earlier settings on
    exit. A ``torch.compile`` wrapper is patched through to the model it wraps. A pool ``patch()`` builds itself
    follows the model: when the model is later moved to another dtype or device (``model.to(...)``), the next
    ``generate()`` builds a new one with the same sizing. A pool you pass is kept; a moved model then fails with
    an error naming the mismatch.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``.
        pool: the pool to use; default ``PagePool.from_model(model, **pool_kwargs)``.
        pack_prefill: run a left-padded prefill on its real tokens only, packed into one sequence (see
            :mod:`astrai_hf.packing`), for the model families in ``astrai_hf.patches.PACKED_PREFILL``; other
            families, and forwards that ask for hidden states or attentions of every position, run the padded
            rectangle. Same tokens either way.
        prefill_chunk_tokens: feed a prefill in pieces of at most this many (real) tokens, so a long prompt never
            needs activations for all its tokens at once; None (default) feeds it whole. Uses the packed path, so
            it applies to the families in ``PACKED_PREFILL`` (elsewhere use transformers' own
            ``generate(..., prefill_chunk_size=...)``, which a PagedCache supports too).
        cuda_graphs: run decode steps through a :class:`~astrai_hf.graphs.DecodeGraphRunner` (one CUDA graph per
            batch-size bucket over a fixed-address workspace). Default: on when the whole model is on one CUDA device
            and not tensor parallel (layers over several devices, or a tensor-parallel plan, decode eagerly). True
            on a CPU runs the runner's eager stand-in (the same static-buffer path without graphs; for tests).
        **pool_kwargs: sizing for the default pool (``max_tokens``, ``page_size``, ...).

    Returns:
        ``model`` itself.

    Raises:
        NotImplementedError: the architecture's attention bypasses ``AttentionInterface`` (e.g. Falcon) or has
            no attention modules with a ``layer_idx``; or it has a feature paged attention does not compute
            (encoder-decoder, cross-attention, hybrid layers, a cache class of its own, multi-head latent attention,
            attention sinks, KV sharing its config does not describe; see :func:`unsupported_feature`); or chunked
            attention (Llama 4) with a
            pool whose ``max_seq_len`` exceeds the chunk.
        ValueError / TypeError: ``pool`` is not a PagePool or does not fit the model; a flag is not a bool.
        TypeError: ``model`` is not a ``torch.nn.Module``, or has no ``generate()`` (a bare decoder such as
            ``LlamaModel``). A failed ``patch()`` leaves the model as it was.
    """
    if prefill_chunk_tokens is not None:
        prefill_chunk_tokens = as_count("prefill_chunk_tokens", prefill_chunk_tokens, 1)
    pack_prefill = as_flag("pack_prefill", pack_prefill)
    if cuda_graphs is not None:
        cuda_graphs = as_flag("cuda_graphs", cuda_graphs)
    if pool is not None and not isinstance(pool, PagePool):
        raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}: {pool!r}")
    _check_pool_kwargs(pool_kwargs)
    _warn_untested_transformers()
    given, model = model, underlying_model(_as_module("patch()", model))
    state = getattr(model, _STATE_ATTR, None)
    if state is None and not callable(getattr(model, "generate", None)):
        raise TypeError(
            f"{type(model).__name__} has no generate(): patch() takes a model with a language-modelling head (e.g. "
            "AutoModelForCausalLM), whose generate() it routes through the pool. For a bare decoder, pass a "
            "PagedCache to its forward yourself"
        )
    if state is None and getattr(model, "config", None) is None:
        raise TypeError(
            f"{type(model).__name__} has no config: patch() takes a transformers model (e.g. AutoModelForCausalLM); "
            "for a module of your own that wraps one, patch the model it wraps"
        )
    if pool is not None and pool_kwargs:
        raise ValueError(f"pass either a pool or pool sizing arguments, not both (got {sorted(pool_kwargs)})")
    if state is not None:
        own_pool_kwargs = None
        if pool is None and pool_kwargs:
            pool, own_pool_kwargs = PagePool.from_model(model, **pool_kwargs), dict(pool_kwargs)
        _repatch(model, state, pool, own_pool_kwargs, pack_prefill, prefill_chunk_tokens, cuda_graphs)
        return given
    modules = attention_modules(model, every_copy=True)
    if not modules:
        raise NotImplementedError(
            f"{type(model).__name__}: found no self-attention modules with a layer_idx; astrai-hf cannot patch it"
        )
    _check_attention_modules(model, modules)
    own_pool_kwargs, chosen = None, pool is not None or bool(pool_kwargs)
    if pool is None:
        pool = PagePool.from_model(model, **pool_kwargs)
        own_pool_kwargs = dict(pool_kwargs)
    with pool.call_lock:  # a call under way on this pool (another model's) finishes first
        with _INSTALL_LOCK:
            state = getattr(model, _STATE_ATTR, None)
            if state is None:
                _check_not_shared(model, modules)  # (under the lock: another thread's patch of this model is seen)
                _patch_onto(model, pool, modules, pack_prefill, prefill_chunk_tokens, cuda_graphs, own_pool_kwargs)
                return given
    # another thread's patch() of this model installed first: this call applies its settings to that patch, and
    # its pool only when one was given or sized (a plain patch() of a patched model keeps the pool)
    _repatch(model, state, pool if chosen else None, own_pool_kwargs, pack_prefill, prefill_chunk_tokens, cuda_graphs)
    return given


# held while patch() installs its wrappers on a model or unpatch() takes them off (never while waiting for a call):
# two threads patching one model at once install once, and the second applies its settings to that patch
_INSTALL_LOCK = threading.RLock()

# the transformers releases the test suite runs on (README, Supported models and versions); pyproject.toml pins them
TESTED_TRANSFORMERS = ("5.17", "5.25")


@functools.cache  # (once per process)
def _warn_untested_transformers() -> None:
    """Log a warning when the installed transformers is not one the suite tests (installed past the pin, say with
    ``--no-deps``): outputs equal to stock's are checked on the tested releases only (5.25, for one, wrapped the
    attention classes' ``__init__`` and routed Falcon's attention anew, both of which astrai-hf reads)."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__).release[:2]
    low, high = (Version(v).release[:2] for v in TESTED_TRANSFORMERS)
    if not low <= installed <= high:
        logger.warning("transformers %s is outside the releases astrai-hf is tested with (%s to %s): outputs may "
                       "differ from stock transformers'", transformers.__version__, *TESTED_TRANSFORMERS)


def _check_pool_kwargs(pool_kwargs: dict) -> None:
    """Raise TypeError naming an argument of patch() that is none of its own or of the pool's sizing."""
    sizing = [n for n in inspect.signature(PagePool.__init__).parameters if n not in ("self", "config")]
    unknown = sorted(set(pool_kwargs) - set(sizing))
    if unknown:
        raise TypeError(f"patch() got an unexpected keyword argument {unknown[0]!r}; it takes pack_prefill, "
                        f"prefill_chunk_tokens, cuda_graphs and the pool's {', '.join(sizing)}")


def _repatch(model, state: PatchState, pool: PagePool | None, own_pool_kwargs: dict | None, pack_prefill: bool,
             prefill_chunk_tokens: int | None, cuda_graphs: bool | None) -> None:
    """:func:`patch` of a patched model: this call's settings, and ``pool`` when one is given or sized
    (``own_pool_kwargs``: the sizing of a pool patch() built, else None)."""
    if pool is not None:
        with _one_call(state, pool):  # a call under way on this model or pool finishes first
            pool.check_model(model)
            _check_chunked_attention(model, pool)
            _check_window_in_mask(model, pool)
            pool.bind_model(model)
            state.pool = pool
            state.own_pool_kwargs = own_pool_kwargs
    state.pack_prefill = pack_prefill
    state.prefill_chunk_tokens = prefill_chunk_tokens
    state.cuda_graphs, state.graphs_given = _wants_graphs(model, cuda_graphs), cuda_graphs


def _patch_onto(model, pool: PagePool, modules: list, pack_prefill: bool, prefill_chunk_tokens: int | None,
                cuda_graphs: bool | None, own_pool_kwargs: dict | None) -> None:
    """:func:`patch` of an unpatched model once its pool is chosen (under the pool's lock)."""
    pool.check_model(model)
    _check_chunked_attention(model, pool)
    _check_window_in_mask(model, pool)
    pool.bind_model(model)
    attention.register()

    state = PatchState(
        pool=pool,
        cache_kwarg=cache_kwarg(model),
        attn_configs=[],
        packable=_packable(model),
        pack_prefill=pack_prefill,
        prefill_chunk_tokens=prefill_chunk_tokens,
        cuda_graphs=_wants_graphs(model, cuda_graphs),
        graphs_given=cuda_graphs,
        rope_by_length=rope_depends_on_length(model),
        embeds_token_types=embeds_token_types(model),
        own_pool_kwargs=own_pool_kwargs,
    )
    state.checked_pools.add(pool)
    state.watched = watched_modules(model)
    _install(model, state, modules)
    logger.info("patched %s: %r, packed prefill %s", type(model).__name__, pool,
                "on" if state.packable and pack_prefill else "off")


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the model behaves exactly as before it was patched. A no-op on an unpatched model.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    given, model = model, underlying_model(_as_module("unpatch()", model))
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        _scrub_orphaned_modules(model)
        get_base_model = getattr(model, "get_base_model", None)  # a peft wrapper of a model patched before it
        base = get_base_model() if callable(get_base_model) else None
        if isinstance(base, torch.nn.Module) and base is not model and _STATE_ATTR in base.__dict__:
            unpatch(base)
        return given
    hook = model.__dict__.get("__deepcopy__")
    if isinstance(hook, _OnInstance) and hook.ref() is not model:
        raise ValueError(
            f"unpatch() of a shallow copy (copy.copy) of a patched {type(model).__name__}: it shares the patched "
            "modules of the model it was copied from, which would be left half patched; unpatch that model (or "
            "make the copy with copy.deepcopy, which patches a copy of its own)"
        )
    with _one_call(state), _INSTALL_LOCK:  # a call under way on another thread finishes first
        if model.__dict__.get(_STATE_ATTR) is not state:
            return given  # another thread's unpatch() took it off meanwhile
        _uninstall(model, state)
    _close_runners(state)
    logger.info("unpatched %s", type(model).__name__)
    return given


def _scrub_orphaned_modules(model: torch.nn.Module) -> None:
    """Take astrai-hf's attributes off modules of ``model`` whose patched model is gone (modules handed on by
    peft's ``merge_and_unload()``, say); modules of a model still patched keep theirs."""
    for m in model.modules():
        ref = m.__dict__.get(_STATE_ATTR)
        if isinstance(ref, weakref.ref) and ref() is None:
            del m.__dict__[_STATE_ATTR]
            if isinstance(m.__dict__.get("__reduce_ex__"), _OnInstance):
                del m.__dict__["__reduce_ex__"]


def _as_module(caller: str, model) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller} takes a transformers model (a torch.nn.Module), got {type(model).__name__}: "
                        f"{model!r:.80}")
    return model


_INSTALLED = ("forward", "generate", "__deepcopy__", "__reduce_ex__")  # instance attributes patch() sets on the model


def _install(model: torch.nn.Module, state: PatchState, modules) -> None:
    """Put ``state``'s wrappers on ``model``: forward, generate, the family patches, and a ``__deepcopy__`` (with
    Ctrl-C held back: a model is left patched or unpatched, never half of each)."""
    with interrupts_deferred():
        _install_now(model, state, modules)


def _install_now(model: torch.nn.Module, state: PatchState, modules) -> None:
    state.saved_attrs = {name: model.__dict__[name] for name in _INSTALLED if name in model.__dict__}
    from . import patches  # per-family attention-forward patches, shipped as astrai_hf.patches

    state.family_undo = []
    try:
        state.family_undo = patches.apply(model, modules)
        _attach_modules(model, state, modules)
        state.install_token = object()
        state.model_ref = weakref.ref(model)
        replaces = model.__dict__.get("forward")
        model.forward = _wrap_forward(model, model.forward, state)
        model.forward.astrai_hf_replaces = replaces  # accelerate's forward on the instance, say (or None)
        model.generate = _wrap_generate(model, model.generate, state)
        state.wrappers = {"forward": weakref.ref(model.forward), "generate": weakref.ref(model.generate)}
        model.__deepcopy__ = _OnInstance(_deepcopy_patched, model, state)
        model.__reduce_ex__ = _OnInstance(_reduce_unpatched, model, state)
        setattr(model, _STATE_ATTR, state)
    except BaseException:
        _uninstall(model, state)  # nothing half-installed is left on the model
        raise


class _OnInstance:
    """``fn(obj, *extra, *args)`` as a callable to set on ``obj`` itself, holding ``obj`` by a weak reference: a
    strong one would make the cycle obj -> its ``__dict__`` -> the callable -> obj, which only the garbage collector
    frees (and with a patched model, the pool's K/V memory with it)."""

    __slots__ = ("fn", "ref", "extra")

    def __init__(self, fn, obj, *extra):
        self.fn, self.ref, self.extra = fn, weakref.ref(obj), extra

    def __call__(self, *args):
        return self.fn(_alive(self.ref), *self.extra, *args)


def _assistant_patch(kwargs: dict) -> tuple | None:
    """The patch state of a ``generate()`` call's ``assistant_model`` and its install token (the token changes when
    it is unpatched or patched again), or None for a call without a patched assistant."""
    assistant = kwargs.get("assistant_model")
    state = getattr(underlying_model(assistant), _STATE_ATTR, None) if isinstance(assistant, torch.nn.Module) else None
    return None if state is None else (state, state.install_token)


def _current_method(model_ref, name: str, original):
    """The model's method ``name`` as it is now, for a call whose wrapper (made over ``original`` with
    ``functools.wraps``) was unpatched while it waited: another patch's wrapper, or the model's own method;
    ``original`` where the model still holds that wrapper. (The wrapper is not passed: a function holding itself
    in its closure would be a reference cycle, keeping the model's pool until the garbage collector runs.)"""
    method = getattr(_alive(model_ref), name)
    return original if getattr(method, "__wrapped__", None) is original else method


def _alive(ref):
    """The object behind the weak reference ``ref``.

    Raises:
        ReferenceError: it has been freed: a method saved from a patched model, a shallow copy of it, or a call
            chained on a model no variable holds outlived the model (patch() holds the model weakly, so that
            deleting it frees its pool at once).
    """
    obj = ref()
    if obj is None:
        raise ReferenceError(
            "the model astrai-hf patched has been freed: patch() does not keep the model alive (deleting it frees "
            "its pool at once), so a method saved from it (model.generate, model.forward), a shallow copy.copy() "
            "of it, or a call on a model no variable holds (astrai_hf.patch(load()).generate(...), "
            "copy.deepcopy(model).generate(...)) finds it gone; keep a reference to the patched model while you "
            "use it"
        )
    return obj


def _weakly_bound(method, owner):
    """``method`` as a function reaching ``owner`` through a weak reference when it is a method bound to
    ``owner`` (else ``method`` itself); its signature is the bound method's (``generate()`` reads the forward's)."""
    if getattr(method, "__self__", None) is not owner:
        return method
    func, ref = method.__func__, weakref.ref(owner)

    @functools.wraps(func)
    def call(*args, **kwargs):
        return func(_alive(ref), *args, **kwargs)

    call.__signature__ = inspect.signature(method)
    return call


def _reduce_unpatched(obj: torch.nn.Module, state: PatchState | None, protocol: int):
    """``__reduce_ex__`` of a patched model or attention module, which ``pickle`` / ``torch.save`` and ``copy``
    look up on the instance: for pickling (and a deep copy of a lone module) the object as it is unpatched (the wrappers close
    over the live pool, which is no part of the model). A model loaded from it is an unpatched model; patch it
    again. ``copy.copy`` gets the instance as it is: a shallow copy shares the patched modules, so it is patched
    with them."""
    reduced = object.__reduce_ex__(obj, protocol)
    caller = sys._getframe(2)  # (1 is _OnInstance.__call__)
    if caller.f_globals.get("__name__") == "copy" and caller.f_code.co_name == "copy":
        return reduced
    if len(reduced) > 2 and isinstance(reduced[2], dict):
        kept = {k: v for k, v in reduced[2].items() if k not in _INSTALLED and k != _STATE_ATTR}
        if state is not None:
            kept.update(state.saved_attrs)
        reduced = (*reduced[:2], kept, *reduced[3:])
    return reduced


def _uninstall(model: torch.nn.Module, state: PatchState) -> None:
    """Take everything :func:`_install` put on ``model`` off again (``state`` itself is left as it is), with Ctrl-C
    held back (a model half unpatched would keep hooks that patch it again when copied)."""
    with interrupts_deferred():
        _uninstall_now(model, state)


def _uninstall_now(model: torch.nn.Module, state: PatchState) -> None:
    model.__dict__.pop(_STATE_ATTR, None)
    state.install_token = None
    for name in _INSTALLED:
        current = model.__dict__.get(name)
        if name in state.wrappers and current is not None and current is not state.wrappers[name]():
            # replaced after patch() (an accelerate hook added, or removed with the forward it had put there): that
            # one stays; a wrapper of ours it calls passes through from now on
            continue
        if name in state.saved_attrs:
            setattr(model, name, state.saved_attrs[name])
        else:
            model.__dict__.pop(name, None)
    for m in model.modules():
        ref = m.__dict__.get(_STATE_ATTR)
        if isinstance(ref, weakref.ref) and ref() not in (state, None):
            continue  # (another patched model's module, shared since: that model's patch stays)
        m.__dict__.pop(_STATE_ATTR, None)
        if isinstance(m.__dict__.get("__reduce_ex__"), _OnInstance):
            m.__dict__.pop("__reduce_ex__")
    for undo in reversed(state.family_undo):
        undo()
    state.family_undo = []


def _deepcopy_patched(model: torch.nn.Module, state: PatchState, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` of a patched model: a copy of the model as it is unpatched, then patched onto the same
    pool with the same settings. (The wrappers close over the original model: copied as they are, the copy's
    ``forward`` would run the original's weights.) The pool is shared, not copied.

    A wrapper that hands unknown attributes on to the model (peft's ``PeftModel``, ``torch.compile``'s module)
    finds this ``__deepcopy__`` too: the wrapper is then copied whole, and the copy of the model inside it
    patched."""
    import copy

    caller = sys._getframe(2)  # copy.deepcopy(x) looked the hook up on x (1 is _OnInstance.__call__)
    given = model
    if caller.f_globals.get("__name__") == "copy" and caller.f_code.co_name == "deepcopy":
        given = caller.f_locals.get("x", model)
    if given is not model and isinstance(getattr(given, "__dict__", {}).get("__deepcopy__"), _OnInstance):
        given = model  # a shallow copy.copy() of the model (its own hook, on its dict): a copy of the model
    with state.lock:
        _uninstall(model, state)
        try:
            copied = copy.deepcopy(given, memo)
        finally:
            _install(model, state, attention_modules(model))
    twin = memo.get(id(model), copied) if given is not model else copied
    if not isinstance(twin, torch.nn.Module) or _STATE_ATTR in twin.__dict__:
        return copied
    settings = dict(pack_prefill=state.pack_prefill, prefill_chunk_tokens=state.prefill_chunk_tokens,
                    cuda_graphs=state.graphs_given)
    own = state.own_pool_kwargs
    if own is not None and not state.pool.fits_placement(attention_modules(twin), twin):
        patch(twin, **settings, **own)  # the model moved since its pool was built: the copy gets a pool that fits
    else:
        patch(twin, state.pool, **settings)
        getattr(twin, _STATE_ATTR).own_pool_kwargs = own  # a copy moved elsewhere later gets its own pool
    return copied


@contextlib.contextmanager
def patched(model: torch.nn.Module, pool: PagePool | None = None, **kwargs) -> Iterator[torch.nn.Module]:
    """``with astrai_hf.patched(model): ...``: :func:`patch` for the block, :func:`unpatch` when it is left,
    also by an exception. A model that was already patched stays patched, with its earlier pool and settings, on
    exit.

    Args:
        model, pool, kwargs: as for :func:`patch`.

    Yields:
        the patched model.
    """
    state = getattr(underlying_model(model), _STATE_ATTR, None)
    previous = None
    if state is not None:
        previous = {name: getattr(state, name) for name in ("pool", "own_pool_kwargs", "pack_prefill",
                                                            "prefill_chunk_tokens", "cuda_graphs", "graphs_given")}
    patch(model, pool, **kwargs)
    try:
        yield model
    finally:
        if previous is not None:
            state.pool = previous.pop("pool")
            for name, value in previous.items():
                setattr(state, name, value)
        else:
            unpatch(model)


def get_pool(model: torch.nn.Module) -> PagePool:
    """The pool a patched model's ``generate()`` uses.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: the model is not patched.
    """
    state = getattr(underlying_model(_as_module("get_pool()", model)), _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call astrai_hf.patch(model) first")
    return state.pool


def is_patched(model) -> bool:
    """Whether ``model`` (or the model a ``torch.compile`` wrapper wraps) is patched. Anything else, a non-module
    included, is not: False, never an error (a question, unlike :func:`get_pool`)."""
    return isinstance(model, torch.nn.Module) and getattr(underlying_model(model), _STATE_ATTR, None) is not None


# KV sharing where every shared layer attends with as many queries as its source (Gemma 4 cuts the shared layers'
# hidden states down to the kept logits on transformers 5.24)
_KV_SHARING_FAMILIES = {"gemma3n", "gemma3n_text"}


def unsupported_feature(model: torch.nn.Module, modules: list[torch.nn.Module]) -> str | None:
    """Why paged attention cannot stand in for ``model``'s attention, or None when it can: the pool's own limits
    (:func:`~astrai_hf.pool.unsupported_model`), attention sinks, and layers that reuse another layer's K/V other
    than as ``num_kv_shared_layers`` describes (see :func:`~astrai_hf.config.kv_sharing_sources`)."""
    for cls in sorted({type(m) for m in modules}, key=lambda c: c.__name__):
        slot = kv_stored_under_other_layers(cls)
        if slot is not None:
            return (f"{cls.__name__} stores its K/V under cache layer `{slot}`: the model runs its attention modules "
                    "more than once per forward (recurrent loops or cycles through its layers), each pass under "
                    "other cache layers, which paged attention, one pool layer per attention module, does not serve")
    reason = unsupported_model(model)
    if reason is not None:
        return reason
    if bidirectional_config(model.config):
        return ("its config sets use_bidirectional_attention: the model attends both ways, which a cache of earlier "
                "tokens and paged attention, causal, do not serve")
    if _alibi(model.config):
        return ("its config asks for ALiBi, a position bias the model adds to the attention mask (Falcon-RW), which "
                "paged attention, masking by each row's length, does not apply")
    try:
        spec = KVSpec.from_config(model.config)
    except ValueError as e:
        return str(e)
    sources, model_type = spec.kv_source, spec.model_type
    for m in modules:
        if isinstance(getattr(m, "sinks", None), torch.Tensor):
            return f"{type(m).__name__} uses attention sinks (a learned extra logit per head)"
        if getattr(m, "is_causal", True) is False:
            return (f"{type(m).__name__} attends both ways (is_causal=False): an encoder's self-attention (an "
                    "encoder checkpoint loaded with is_decoder=True in its config generates causally), or a prefix "
                    "attended both ways by design, as PaliGemma attends its image and prompt")
        mask = own_attention_mask(type(m))
        if mask is not None:
            return (f"{type(m).__name__} hands the attention function a mask of its own making (`{mask}`, computed "
                    "in its forward: a learned bias per key, a top-k selection of keys), which paged attention, "
                    "masking by each row's length, cannot apply; a PagedCache without patch() serves it")
        rewritten = kv_rewritten_after_update(type(m))
        if rewritten is not None:
            return (f"{type(m).__name__} changes K/V between storing them in the cache and attending to them "
                    f"(`{rewritten}`), and paged attention reads the stored K/V; a PagedCache without patch() "
                    "serves it (stock attention over K/V gathered from the pool)")
        shared = bool(getattr(m, "is_kv_shared_layer", False))
        expected = getattr(m, "kv_shared_layer_index", None)  # transformers < 5.24 names the source layer
        source = sources[m.layer_idx] if sources else m.layer_idx
        if shared and model_type not in _KV_SHARING_FAMILIES:
            return (f"layer {m.layer_idx} reuses the K/V of an earlier layer (KV sharing), which astrai-hf serves "
                    f"for {', '.join(sorted(_KV_SHARING_FAMILIES))} only")
        if shared != (source != m.layer_idx) or (expected is not None and expected != source):
            return (f"layer {m.layer_idx} reuses the K/V of an earlier layer (KV sharing) in a way its config's "
                    "num_kv_shared_layers does not describe")
    return None


def bidirectional_config(config) -> bool:
    """Whether ``config`` (or its text config) sets ``use_bidirectional_attention`` (Gemma, Gemma 2 and 3, ...):
    the model then builds a mask attending both ways at every forward, whatever its attention modules were built
    with (the flag set after loading keeps their ``is_causal=True``)."""
    # (read from the instance dicts, where configs keep their fields: this runs at every forward, and a config's
    # attribute lookup costs microseconds; a multimodal model's language model reads its text config's)
    fields = vars(config)
    text = fields.get("text_config")
    return bool(fields.get("use_bidirectional_attention") or (
        text is not None and vars(text).get("use_bidirectional_attention")))


def _alibi(config) -> bool:
    """Whether ``config`` (or its MPT-style ``attn_config``) turns ALiBi on."""
    return any(bool(getattr(c, "alibi", False) if not isinstance(c, dict) else c.get("alibi"))
               for c in (config, getattr(config, "attn_config", None)) if c is not None)


@functools.cache
def kv_rewritten_after_update(cls: type) -> str | None:
    """The first statement of ``cls.forward`` that reassigns the key or value handed to the attention function
    after ``cache.update()`` stored them (DiffLlama splits V, JetMoe tiles K/V heads), or None; None too when the
    source cannot be read. Read from the source: the first ``<cache>.update(k, v, layer_idx, ...)`` call, each
    later ``attention_interface(module, q, k, v, ...)`` call, and any assignment to that ``k`` or ``v`` between
    the two (other than the one taking ``update()``'s result)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    stored = [n.end_lineno for n in ast.walk(tree) if _is_update(n)]
    if not stored:
        return None
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "attention_interface"):
            continue
        kv = {a.id for a in call.args[2:4] if isinstance(a, ast.Name)}
        for node in ast.walk(tree):
            if (isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and min(stored) < node.lineno < call.lineno
                    and not any(_is_update(n) for n in ast.walk(node))):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)} & kv:
                    return ast.unparse(node).splitlines()[0][:100]
    return None


@functools.cache
def kv_stored_under_other_layers(cls: type) -> str | None:
    """The layer index expression of ``cls.forward``'s ``<cache>.update(k, v, layer_idx, ...)`` call where it is
    computed from the module's ``layer_idx`` (``self.layer_idx + cycle_offset``: a module run once per loop of a
    recurrent model, storing each loop's K/V under cache layers of its own), or None; None too when the source
    cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if _is_update(node) and isinstance(node.args[2], ast.BinOp):
            return ast.unparse(node.args[2])[:80]
    return None


def _attention_calls(cls: type) -> list[tuple[ast.FunctionDef, list[ast.Call]]] | None:
    """The ``forward`` syntax trees along ``cls``'s MRO, down to the first one that calls
    ``attention_interface(...)`` (a subclass of the caller's whose forward calls ``super().forward(...)`` goes on
    to its parent), each with its calls of ``attention_interface`` and of ``super().forward``; None when a source
    cannot be read."""
    found = []
    for klass in cls.__mro__:
        forward = vars(klass).get("forward")
        if forward is None:
            continue
        if klass is torch.nn.Module:
            break
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
        except (OSError, TypeError, SyntaxError):
            return None
        fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
        if fn is None:
            return None
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and (
            (isinstance(n.func, ast.Name) and n.func.id == "attention_interface") or _is_super_forward(n))]
        found.append((fn, calls))
        if not any(_is_super_forward(c) for c in calls):
            break
    return found


def _is_super_forward(node: ast.AST) -> bool:
    """A ``super().forward(...)`` call."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "forward"
            and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super")


@functools.cache
def own_attention_mask(cls: type) -> str | None:
    """The mask expression ``cls.forward`` hands ``attention_interface(module, q, k, v, mask, ...)`` when it is not
    the mask the forward was given (one of its parameters, not given a value computed in the forward): a mask of
    the module's own making, such as Doge's key bias with top-k masking, or the top-k key selection of sparse
    attention with an indexer. None otherwise, or when the source cannot be read."""
    found = _attention_calls(cls)
    if found is None:
        return None
    for level, (fn, calls) in enumerate(found):
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        parent = found[level + 1][0] if level + 1 < len(found) else None
        parent_params = [a.arg for a in [*parent.args.posonlyargs, *parent.args.args]][1:] if parent else []
        # names given a value computed in the forward (taking another mask the forward was given, as GPT-2's
        # cross-attention takes encoder_attention_mask, is no mask of the module's own)
        assigned = {t.id for node in ast.walk(fn) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                    and not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                             and node.value.id in params)
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    for t in ast.walk(target) if isinstance(t, ast.Name)}
        if "attention_mask" in params and "attention_mask" not in assigned and _changes_in_place(
                fn, _aliases(fn, "attention_mask")):
            return "attention_mask, changed in place"
        for call in calls:
            handed = [k.value for k in call.keywords if k.arg is None]  # what the call gets as **mapping
            if handed and _writes_key(fn, handed, "attention_mask"):
                return "an attention_mask put into the **kwargs handed on"
            if _is_super_forward(call):  # the mask handed on to the parent's forward
                mask = next((k.value for k in call.keywords if k.arg == "attention_mask"), None)
                at = parent_params.index("attention_mask") if "attention_mask" in parent_params else None
                if mask is None and at is not None and len(call.args) > at:
                    mask = call.args[at]
            else:
                mask = call.args[4] if len(call.args) > 4 else next(
                    (k.value for k in call.keywords if k.arg == "attention_mask"), None)
            if mask is None or (isinstance(mask, ast.Constant) and mask.value is None):
                continue
            if not (isinstance(mask, ast.Name) and mask.id in params and mask.id not in assigned):
                return ast.unparse(mask)[:60]
    return None


def _writes_key(fn: ast.AST, handed: list[ast.expr], key: str) -> bool:
    """Whether ``fn`` puts ``key`` into a mapping it hands on as ``**handed``: a literal ``{**kwargs, key: m}`` or
    ``dict(kwargs, key=m)`` there, or, for a name handed on (and the names whose values flow into it: ``new =
    dict(kwargs)``), ``name[key] = ...``, ``name.update(...)`` / ``name.setdefault(...)`` naming it, ``name |=
    {key: ...}``, or such a literal assigned to it. ``key`` may be spelt through a name bound to it. Reads
    (``kwargs.get(key)``) and other dicts (a log record, a probe's) do not count."""
    spelt = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
             and node.value.value == key for t in node.targets if isinstance(t, ast.Name)}

    def is_key(node) -> bool:
        return (isinstance(node, ast.Constant) and node.value == key) or (isinstance(node, ast.Name) and node.id in spelt)

    def builds_key(expr) -> bool:  # a dict literal or dict(...) call with the key, anywhere in expr
        for node in ast.walk(expr):
            if isinstance(node, ast.Dict) and any(k is not None and is_key(k) for k in node.keys):
                return True
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
                    and any(k.arg == key for k in node.keywords)):
                return True
        return False

    if any(builds_key(expr) for expr in handed if not isinstance(expr, ast.Name)):
        return True
    names = {expr.id for expr in handed if isinstance(expr, ast.Name)}
    assigns = [n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value]
    while True:  # the names whose values flow into a name handed on
        more = {v.id for n in assigns for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name) and t.id in names for v in ast.walk(n.value) if isinstance(v, ast.Name)}
        if more <= names:
            break
        names |= more
    for node in assigns:
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id in names:
                if is_key(target.slice):
                    return True
            elif isinstance(target, ast.Name) and target.id in names and builds_key(node.value):
                return True
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id in names and node.func.attr in ("update", "setdefault", "__setitem__")):
            if any(k.arg == key for k in node.keywords) or any(is_key(n) for a in node.args for n in ast.walk(a)):
                return True
    return False


def _aliases(fn: ast.AST, name: str) -> set[str]:
    """``name`` and the names ``fn`` binds to it as it is (``m = attention_mask``)."""
    names = {name}
    while True:
        more = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                and node.value.id in names for t in node.targets if isinstance(t, ast.Name)}
        if more <= names:
            return names
        names |= more


def _changes_in_place(fn: ast.AST, names: set[str]) -> bool:
    """Whether ``fn`` writes into one of the tensors ``names`` in place: an in-place method
    (``mask.masked_fill_(...)``, ``mask.add_(...)``) or an item assignment (``mask[...] = ...``)."""
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id in names and node.func.attr.endswith("_") and not node.func.attr.startswith("_")):
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id in names:
                    return True
    return False


@functools.cache
def passes_sliding_window(cls: type) -> bool:
    """Whether ``cls.forward`` hands ``attention_interface`` a ``sliding_window=`` (True when the source cannot be
    read: nothing is known against it). Modules that do not leave a window of the config to the mask alone."""
    found = _attention_calls(cls)
    calls = [c for _, cs in found or () for c in cs if not _is_super_forward(c)]
    if not calls:
        return True
    return all(any(k.arg == "sliding_window" for k in call.keywords) for call in calls)


def _is_update(node: ast.AST) -> bool:
    """A ``<cache>.update(key, value, layer_idx, ...)`` call."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
            and len(node.args) >= 3)


def _check_chunked_attention(model: torch.nn.Module, pool: PagePool) -> None:
    """Chunked attention (each token sees only the keys of its own ``attention_chunk_size`` block, Llama 4) equals
    causal attention while no row is longer than a chunk, so it is served by a pool whose ``max_seq_len`` is at most
    the chunk size.

    Raises:
        NotImplementedError: the pool's rows may be longer than the model's attention chunk.
    """
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    chunk = getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None) or []
    if chunk is None or (types and "chunked_attention" not in types):
        return
    if pool.max_seq_len > chunk:
        raise NotImplementedError(
            f"{type(model).__name__} uses chunked attention (attention_chunk_size={chunk}), which paged attention "
            f"computes only for rows of at most {chunk} tokens, but the pool holds rows of up to "
            f"max_seq_len={pool.max_seq_len}; build it with PagePool.from_model(model, max_seq_len={chunk})"
        )


def _check_window_in_mask(model: torch.nn.Module, pool: PagePool) -> None:
    """A sliding window that the model applies through its mask alone (its attention modules pass no
    ``sliding_window=`` to the attention function: PhiMoE, Qwen2-MoE with ``use_sliding_window``) is not seen by
    paged attention, which masks by each row's length. It bites only on rows longer than the window, so a pool whose
    ``max_seq_len`` is at most the window serves such a model.

    Raises:
        NotImplementedError: the pool's rows may be longer than such a window.
    """
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if (not isinstance(window, int) or isinstance(window, bool) or window <= 0
            or getattr(text, "use_sliding_window", True) is False or pool.max_seq_len <= window):
        return
    silent = sorted({type(m).__name__ for m in attention_modules(model) if not passes_sliding_window(type(m))})
    if silent:
        raise NotImplementedError(
            f"{type(model).__name__} applies its sliding window (sliding_window={window}) through the attention mask "
            f"only ({', '.join(silent)} pass the attention function no sliding_window), which paged attention does "
            f"not read, and the pool holds rows of up to max_seq_len={pool.max_seq_len}; build it with "
            f"PagePool.from_model(model, max_seq_len={window}), or use a PagedCache without patch()"
        )


def _uses_attention_interface(cls: type) -> bool:
    """Whether ``cls`` computes attention through transformers' AttentionInterface: a method of the first class in
    its MRO that defines ``forward`` looks the function up there, or that ``forward`` calls ``super().forward(...)``
    (a subclass in a script or notebook of the caller's) and the next one does.

    The class's own methods are read, not its file: a file can hold an attention that looks the function up beside
    one that computes attention by hand (GIT's vision attention and its text self-attention)."""
    for klass in cls.__mro__:
        forward = vars(klass).get("forward")
        if forward is None:
            continue
        if klass is torch.nn.Module:
            return False
        if "ALL_ATTENTION_FUNCTIONS.get_interface(" in _method_sources(klass):
            return True
        try:
            if "super().forward(" not in inspect.getsource(forward):
                return False
        except (OSError, TypeError):
            return False
    return False


def _method_sources(klass: type) -> str:
    """The source of the functions ``klass`` defines itself (static and class methods included), those whose
    source can be read."""
    sources = []
    for value in vars(klass).values():
        fn = getattr(value, "__func__", value)
        if inspect.isfunction(fn):
            try:
                sources.append(inspect.getsource(fn))
            except (OSError, TypeError):
                pass
    return "\n".join(sources)


def _wants_graphs(model, cuda_graphs: bool | None) -> bool:
    """The ``cuda_graphs`` default: on for a model wholly on one CUDA device and not tensor parallel. Layers
    split over devices and collectives inside the forward are not captured; those models decode eagerly."""
    if cuda_graphs is not None:
        return bool(cuda_graphs)
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return False
    from .distributed import rank_group

    return rank_group(attention_modules(model)) is None


def _runner(model, state: PatchState, pool: PagePool):
    runner = state.runners.get(id(pool))
    if runner is not None and runner.pool is not pool:  # (a pool freed, another made at its address)
        state.runners.pop(id(pool)).close()
        runner = None
    warn_refusal = True
    if runner is not None and not runner.still_fits(model):
        # a graph holds the tensors and hooks of its capture; the pool's check_weights(), which a cache runs
        # before its first step, saw the model change since
        logger.info("%s changed since its decode graphs were captured (a parameter given a new tensor, a hook, an "
                    "adapter): capturing them again", type(model).__name__)
        old = state.runners.pop(id(pool))
        old.close()
        # (a model whose forward changes a buffer it reads, as longrope did before transformers 5.2x, changes at
        # every call; its refusals were warned of once)
        warn_refusal = old.warn_refusal and old.uncapturable is None
        runner = None
    if runner is None:
        runner = state.runners[id(pool)] = DecodeGraphRunner(model, state.forward, pool)
        runner.warn_refusal = warn_refusal
        # the runner holds its pool weakly: when a pool of the caller's is freed, its runner (workspace, graphs) goes
        weakref.finalize(pool, _forget_runner, weakref.ref(state), id(pool), weakref.ref(runner))
    return runner


def _forget_runner(state_ref, pool_id: int, runner_ref) -> None:
    state, runner = state_ref(), runner_ref()
    if state is not None and runner is not None and state.runners.get(pool_id) is runner:
        state.runners.pop(pool_id, None)
        runner.close()


def _packable(model) -> bool:
    from . import patches

    params = inspect.signature(model.forward).parameters
    model_type = getattr(model.config, "model_type", None)
    return model_type in patches.PACKED_PREFILL and "position_ids" in params and "logits_to_keep" in params


def _cache_keyword(kwargs: dict, name: str) -> str:
    """The keyword a call's cache is read from, as stock reads it: ``cache`` where it is passed and this
    transformers reads it (5.24 and later, whose ``generate()`` hands every forward ``cache=``, and whose renaming
    of the deprecated ``past_key_values=`` keeps ``cache`` where both are passed; or a model whose forward takes
    ``cache``: ``name``), else ``past_key_values`` (a ``cache=`` before 5.24 is no cache)."""
    return "cache" if "cache" in kwargs and (name == "cache" or _generate_passes_cache()) else "past_key_values"


@functools.cache  # (once per process)
def _generate_passes_cache() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 24)


def _find_cache(kwargs: dict, name: str):
    """The cache a call passes (None where none), read as stock reads it (see :func:`_cache_keyword`)."""
    return kwargs.get(_cache_keyword(kwargs, name))


def _with_cache(kwargs: dict, cache, name: str) -> dict:
    """``kwargs`` passing ``cache`` under the keyword the caller's was read from (a cache a patched call stands in
    for: stock's ``generate()`` then warns of a deprecated keyword as it would), else under ``name``."""
    keyword = _cache_keyword(kwargs, name)
    return {**kwargs, keyword if keyword in kwargs else name: cache}


def _wrap_forward(owner, forward, state: PatchState):
    # functools.wraps keeps the signature visible: generate() inspects it to decide whether to build
    # position_ids and logits_to_keep. The wrapper holds the model weakly (see PatchState).
    forward, model_ref = _weakly_bound(forward, owner), weakref.ref(owner)
    owner_name = type(owner).__name__

    token = state.install_token

    @functools.wraps(forward)
    def paged_forward(*args, **kwargs):
        if state.install_token is not token:  # unpatched, or patched again: kept only by a wrapper of another's
            return forward(*args, **kwargs)
        cache = _find_cache(kwargs, state.cache_kwarg)
        if state.continuous_batching and not isinstance(cache, PagedCache):
            # a forward of transformers' continuous batching on its worker thread, while the generate() that
            # started it holds the lock and waits for it: no paged step can be under way
            return forward(*args, **kwargs)
        if torch.compiler.is_compiling():  # this wrapper traced by torch.compile
            if not isinstance(cache, PagedCache):
                # a forward without a paged cache (a scoring forward of a compiled model): stock's, without the lock,
                # which a graph cannot hold (fullgraph=True had failed on it)
                return forward(*args, **kwargs)
            # the patched forward compiled: without fullgraph dynamo runs it outside its graph on this error; with
            # fullgraph the error reaches the caller, naming the fix
            raise NotImplementedError(_fullgraph_message(owner_name))
        with _one_call(state, cache.pool if isinstance(cache, PagedCache) else None):
            if state.install_token is token:
                try:
                    return _paged_forward(_alive(model_ref), cache, *args, **kwargs)
                except Exception as e:
                    if isinstance(cache, PagedCache) and _fullgraph_refused(e):
                        raise NotImplementedError(_fullgraph_message(owner_name)) from e
                    raise
        # unpatched (and maybe patched again) while this forward waited for the locks: the model's forward as it is
        return _current_method(model_ref, "forward", forward)(*args, **kwargs)

    def _paged_forward(model, cache, /, *args, **kwargs):  # (positional only: `cache=` is a forward kwarg)
        if not isinstance(cache, PagedCache) or kwargs.get("use_cache") is False or cache.stock_attention:
            return forward(*args, **kwargs)
        if cache.pool not in state.checked_pools:
            cache.pool.check_model(model)
            _check_chunked_attention(model, cache.pool)  # (patch() checked its own pool; this is the caller's)
            _check_window_in_mask(model, cache.pool)
            state.checked_pools.add(cache.pool)
        synced = False
        if cache.pool.model is not model or cache.checked_model != id(model):
            # another model shares the pool, or the weights changed: the cached prefixes are not ours, and a cache
            # pre-filled from them must not run
            if not cache.made_by_generate:  # (generate() synced them before it made its cache)
                _sync_modules(model, state)
                synced = True
            cache.pool.check_weights(model)
            cache.checked_model = id(model)
            cache.check_prefix_hits()
        if not cache.made_by_generate and not cache._first_step_planned and not synced:
            # a cache of the caller's starts: the config may have changed since the last call, and a module's dropout
            # or gradient checkpointing been switched on
            _sync_windows(model, state)
            state.watched = watched_modules(model)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        inputs = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if not cache.made_by_generate and cache._rows.reusable is not False:
            if input_ids is None and inputs is not None:
                # embeddings of the caller's (a soft prompt): their K/V are not those of the ids the cache was
                # built with
                cache._rows.reusable = False
            elif ((not cache._first_step_planned or (isinstance(inputs, torch.Tensor) and inputs.dim() >= 2
                                                      and inputs.shape[1] > 1))
                  and not cache.pool.computes_as_checked(model)):
                # a change since the cache's lookup (a hook for this forward, a module or parameter swapped in,
                # the config), undone before its release would go unseen by the next call's check: this
                # forward's K/V are no prefix for it
                cache._rows.reusable = False
        if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
            # (a first forward that falls back below stores through update(), which is not given the mask)
            cache.note_padding(kwargs.get("attention_mask"), *inputs.shape[:2])
        if kwargs.get("output_attentions") or (kwargs.get("output_attentions") is None
                                               and getattr(model.config, "output_attentions", False)):
            # attention weights asked for (a cache of the caller's; generate() marks its own stock_attention):
            # paged attention computes none, the model's own attention does, over K/V gathered from the pool
            cache._rows.reusable = False
            return forward(*args, **kwargs)
        if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] > 1 and bidirectional_config(
                model.config):
            # use_bidirectional_attention set since patch(): the model's own attention applies the mask it builds,
            # over the pool's K/V, and K/V that depend on later tokens are no prefix for another prompt (a step of
            # one token per row attends as a causal one does)
            cache._rows.reusable = False
            return forward(*args, **kwargs)
        if _custom_mask(kwargs, check_token_types=not cache.made_by_generate):
            # a mask of the caller's making (a 4D mask for packed documents or trees; Gemma 3's bidirectional image
            # spans from token_type_ids): the model's own attention applies it, over K/V gathered from the pool;
            # K/V computed under another mask are no prefix for a later prompt of the same ids
            cache._rows.reusable = False
            return forward(*args, **kwargs)
        if dropout_active(state.watched.dropout) or _own_attention(state) is not None:
            # training mode with dropout: the model's own attention applies its dropout (paged attention has none);
            # an attention function of the caller's (AttentionInterface.register) computes what it computes. Either
            # runs over K/V gathered from the pool, and its K/V are no prefix for a later prompt
            cache._rows.reusable = False
            return forward(*args, **kwargs)
        if checkpointing_drops_cache(state.watched.checkpointing):
            # gradient checkpointing in training mode: transformers hands the layers no cache, so the model runs as
            # stock does then, on the inputs alone, and stores nothing (paged attention would read unwritten slots)
            cache._rows.reusable = False
            return forward(*args, **kwargs)
        if _records_grad(model, args, kwargs):
            # a forward that autograd records (training, a loss, gradients of the inputs): the model's own attention
            # over K/V gathered from the pool, with this step's K/V live, so gradients flow as with a DynamicCache
            # (paged attention reads the pool, which is outside autograd)
            return forward(*args, **kwargs)
        B, q = inputs.shape[:2]
        # images, audio or their features (fed with a prompt, not to a decode step): K/V of placeholder ids that
        # the prefix cache cannot tell apart, nor the rows of a batch from each other
        images = q > 1 and bool(_other_forward_inputs(model, args, kwargs))
        if images:
            cache._rows.reusable = False
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        own_loop = not cache.made_by_generate and not state.generating  # a forward of the caller's own
        if own_loop and cache.mask_has_holes(mask, B, q):
            # a 0 in the mask after a row's first token (a finished row fed padding, a token masked out): paged
            # attention sees every stored token; the model's own attention applies the mask, over the pool's K/V
            cache._rows.reusable = False
            return forward(*args, **kwargs)
        step = cache.plan_step(
            B,
            q,
            # without a mask stock attention sees every column, padding included: positions that mark padding
            # locate it only when a mask masks it (generate() always passes one)
            position_ids=positions if mask is not None or not own_loop else None,
            attention_mask=mask,
            input_ids=input_ids,
            paged=True,
            given_positions=positions,
            defer_writes=state.cuda_graphs and not args,  # (the runner writes them; step.send() otherwise)
            rows_differ=images,
        )
        if not cache.made_by_generate and kwargs.get("position_ids") is not None:
            cache._note_positions(kwargs["position_ids"], step, B, q)  # (older releases pass layers no positions)
        cache._pending_q = q  # the model may ask get_seq_length() before any layer stores this step
        # peft adapters acting per row: generate() says so for its call; a loop of the caller's passes peft's per-row
        # arguments (a patched peft model), or peft hands them its LoRA layers (a base model patched first: looked
        # for at multi-token steps, a prefill, and kept for the loop's cache)
        as_fed = cache.rows_as_fed or (own_loop and (any(kwargs.get(n) is not None for n in _PEFT_PER_CALL_ROWS)
                                                     or (q > 1 and peft_adapters_by_row(model) is not None)))
        if as_fed and own_loop:
            cache.rows_as_fed = True  # (the loop's decode steps, one token per row, are not looked at again)
        try:
            if state.cuda_graphs and not args and not as_fed:  # (a bucket pads the rows)
                runner = _runner(model, state, cache.pool)
                if runner.can_run(step, kwargs, input_ids):
                    if runner.has_graph(B):  # a replay runs no attention code: nothing to switch
                        return runner.run(cache, step, kwargs, input_ids, state)
                    planned = cache._pending_known, cache._pending_q
                    try:
                        with paged_attention_on(state, step, cache.pool):  # (the capture, or the stand-in's forward)
                            return runner.run(cache, step, kwargs, input_ids, state)
                    except CaptureRefused:
                        # the capture's warm-up stored this step's K/V already; the eager step below stores the
                        # same again into the same slots, with the step planned as it was
                        cache._step, cache._step_layers = step, set()
                        cache._pending_known, cache._pending_q = planned
            step.send()  # the table writes a decode step planned for the runner left to it
            with paged_attention_on(state, step, cache.pool):
                chunk_tokens = None if state.rope_by_length or as_fed else state.prefill_chunk_tokens
                if state.packable and not args and not as_fed and packing.wants_packing(
                    model, kwargs, step, input_ids, drop_padding=state.pack_prefill, chunk_tokens=chunk_tokens,
                ):
                    return packing.packed_forward(forward, kwargs, cache, state, step, input_ids, chunk_tokens)
                out = forward(*args, **kwargs)
            if not cache.made_by_generate and kwargs.get("position_ids") is None and not cache.step_saw_positions:
                # a forward of the caller's without position_ids, on a release whose layers do not pass them to
                # update(): the model counted positions from the cache length, padding included
                start = step.logical_len - q
                cache._note_positions(torch.arange(start, start + q)[None], step, B, q)
            return out
        except BaseException:
            cache.crop(-q)  # roll the failed step back so the cache stays consistent
            raise
        finally:
            cache._pending_q = 0

    state.forward = forward
    paged_forward.astrai_hf_wrapper = True  # not a change of the model's code (see pool._code_and_settings)
    return paged_forward


_TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")  # nonzero: image/video spans some models attend both ways


def embeds_token_types(model: torch.nn.Module) -> bool:
    """Whether ``model`` adds an embedding of ``token_type_ids`` to its inputs (GPT-2, GPT-BigCode: then even zeros
    change the K/V), read from the source of the modules it is built of."""
    for cls in {type(m) for m in model.modules()}:
        if cls.__module__.startswith("torch."):
            continue
        module = sys.modules.get(cls.__module__)
        try:
            source = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):
            return True  # cannot tell: assume it does
        if "token_type_embeds" in source or "token_type_embeddings" in source:
            return True
    return False


def _custom_mask(kwargs: dict, check_token_types: bool = True) -> bool:
    """Whether a forward's attention is masked beyond causal-with-left-padding, which paged attention computes:
    an attention mask of more than 2 dimensions, or nonzero token types. Reading the token types is a host sync,
    so a patched ``generate()``, which sent calls with nonzero ones to stock already, skips it every step."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() > 2:
        return True
    return check_token_types and any(isinstance(kwargs.get(name), torch.Tensor) and bool(kwargs[name].any()) for name in _TOKEN_TYPES)


class WatchedModules(NamedTuple):
    """Modules of a model a paged forward looks at (:func:`watched_modules`).

    Attributes:
        dropout: every ``nn.Dropout`` (any kind) with ``p > 0`` and every module with a float attribute above 0
            whose name has ``dropout`` in it (a model without dropout, most checkpoints: none).
        checkpointing: every module with ``gradient_checkpointing`` set.
        mask_checks: weak references to every module with transformers' check for padding without an attention
            mask (``warn_if_padding_and_no_attention_mask``, a ``PreTrainedModel``'s, the model itself among them:
            weak, as the model holds its patch state), which a forward without a mask of astrai-hf's skips
            (:class:`astrai_hf.packing.padding_check_skipped`).
    """

    dropout: list
    checkpointing: list
    mask_checks: list


def watched_modules(model: torch.nn.Module) -> WatchedModules:
    """The modules of ``model`` whose forward changes in training mode, for :func:`dropout_active` and
    :func:`checkpointing_drops_cache` to read their ``training`` flags, and those that check their input ids for
    padding (one walk of the model, made once per call: reading every module's flag each forward would cost a
    walk a step)."""
    dropout, checkpointing, mask_checks = [], [], []
    for m in model.modules():
        cls, attrs = type(m), vars(m)
        if class_defines(cls, packing.PADDING_CHECK):
            mask_checks.append(weakref.ref(m))
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            if m.p > 0:
                dropout.append(m)
        elif "dropout" in " ".join(attrs) and any(  # (the names joined first: most modules have none)
                "dropout" in name and type(value) in (float, int) and value > 0 for name, value in attrs.items()):
            dropout.append(m)
        # (read from the instance, then its class: a module's getattr of a missing name raises inside, per module)
        if attrs.get("gradient_checkpointing", class_attr(cls, "gradient_checkpointing", False)) is True:
            checkpointing.append(m)
    return WatchedModules(dropout, checkpointing, mask_checks)


def dropout_active(modules) -> bool:
    """Whether one of ``modules`` (the ``dropout`` list of :func:`watched_modules`) is in training mode
    and drops out: an ``nn.Dropout`` with ``p > 0``, or a float attribute whose name has ``dropout`` in it
    (``attention_dropout``, ``self.dropout`` handed to ``F.dropout``) above 0. Each module's own flag counts: a
    layer put in training mode in a model in eval mode (``model.eval(); model.model.layers[0].train()``) drops out
    in stock's forward."""
    for m in modules:
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            if m.p > 0:
                return True
            continue
        for name, value in vars(m).items():
            if "dropout" in name and type(value) in (float, int) and value > 0:
                return True
    return False


def checkpointing_drops_cache(modules) -> bool:
    """Whether one of ``modules`` (the ``checkpointing`` list of :func:`watched_modules`) runs gradient
    checkpointing in a forward now (training mode after ``gradient_checkpointing_enable()``): transformers hands
    such a layer no cache (releases before 5.24 also without grad mode), so it neither stores its K/V nor reads
    any, and the model runs as without a cache."""
    for m in modules:
        if getattr(m, "gradient_checkpointing", False) is not True or not m.training:
            continue
        if getattr(m, "_can_checkpoint_with_cache", False) is True:
            continue
        if _checkpointing_needs_grad() and _is_checkpointing_layer(m) and not torch.is_grad_enabled():
            continue
        return True
    return False


def _is_checkpointing_layer(module: torch.nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return isinstance(module, GradientCheckpointingLayer)


@functools.cache
def _checkpointing_needs_grad() -> bool:
    """Whether transformers' ``GradientCheckpointingLayer`` checkpoints (and drops the cache) only in grad mode
    (5.24 does; 5.17 does in training mode alone). Read from its source; False when it cannot be read."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        return "is_grad_enabled" in inspect.getsource(GradientCheckpointingLayer.__call__)
    except (ImportError, OSError, TypeError):
        return False


def _records_grad(model, args: tuple, kwargs: dict) -> bool:
    """Whether autograd records this forward: grad mode on, and a parameter or a tensor input requires grad."""
    if not torch.is_grad_enabled():
        return False
    inputs = [*args, *kwargs.values()]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs) or any(
        p.requires_grad for p in model.parameters())


@contextlib.contextmanager
def paged_attention_on(state: PatchState, step, pool: PagePool) -> Iterator[None]:
    """Within the block, the patched model's attention modules run paged attention over ``pool`` for ``step``;
    their own attention implementation is restored on exit."""
    previous = [c._attn_implementation_internal for c in state.attn_configs]
    state.step, state.step_pool = step, pool
    for c, name in zip(state.attn_configs, previous):
        if name != attention.ATTENTION_NAME:  # (the outermost paged forward: what the config selects outside it)
            OWN_ATTENTION[id(c)] = name
        c._attn_implementation_internal = attention.ATTENTION_NAME
    try:
        yield
    finally:
        for c, name in zip(state.attn_configs, previous):
            c._attn_implementation_internal = name
            if name != attention.ATTENTION_NAME:
                OWN_ATTENTION.pop(id(c), None)
        state.step = state.step_pool = None


def capture_graphs(model: torch.nn.Module, pool: PagePool | None = None) -> dict[int, float]:
    """Capture the decode step of every batch-size bucket now, largest first, instead of lazily on each bucket's
    first decode step. The buckets share one CUDA memory pool: captured largest first, each smaller graph reuses
    the memory the larger ones took (as vLLM and SGLang do at start-up). Later ``generate()`` calls then never
    pay a capture.

    Args:
        model: a model patched with CUDA graphs on (``patch(model)`` on one CUDA device, or
            ``cuda_graphs=True``; on a CPU that is the eager stand-in, where "capture" only prepares a bucket).
        pool: the pool whose decode steps to capture; default ``get_pool(model)``.

    Returns:
        ``{bucket: seconds}`` for the buckets captured by this call, in capture order (already captured buckets
        are skipped; their times stay in the runner's ``capture_seconds``).

    Raises:
        ValueError: the model is not patched, or is patched with ``cuda_graphs=False``.
        TypeError: ``model`` is not a module, or ``pool`` not a PagePool.
    """
    model = underlying_model(_as_module("capture_graphs()", model))
    if pool is not None and not isinstance(pool, PagePool):
        raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}: {pool!r}")
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call astrai_hf.patch(model) first")
    with state.lock:
        _follow_model(model, state)  # (a model moved since patch(): its pool, and the cuda_graphs default, follow)
    if not state.cuda_graphs:
        raise ValueError(
            f"{type(model).__name__} is patched without CUDA graphs (cuda_graphs=False, the default for a model not "
            "on one CUDA device); patch(model, cuda_graphs=True) to capture (off CUDA that is an eager stand-in, "
            "which captures nothing)"
        )
    # a call of another model on the pool finishes first, as for a call of this one (binding the pool to this model
    # between two of its steps would clear the prefix cache under it)
    with _one_call(state, pool):
        pool = pool or state.pool
        if pool not in state.checked_pools:
            pool.check_model(model)
            state.checked_pools.add(pool)
        if pool.model is not model:
            pool.bind_model(model)
        runner = _runner(model, state, pool)
        cache = PagedCache(pool, prefix_cache=False)
        try:
            with paged_attention_on(state, None, pool):
                return runner.capture_all(cache, {cache_kwarg(model): cache, "use_cache": True, "return_dict": True,
                                                  "logits_to_keep": 1}, state)
        finally:
            cache.release()


def _wrap_generate(owner, generate, state: PatchState):
    generate, model_ref = _weakly_bound(generate, owner), weakref.ref(owner)
    owner_name = type(owner).__name__

    token = state.install_token

    @functools.wraps(generate)
    def paged_generate(*args, **kwargs):
        if state.install_token is not token:  # unpatched, or patched again: kept only by a wrapper of another's
            return generate(*args, **kwargs)
        if kwargs.get("cache_implementation") == "paged":
            # transformers' continuous batching (generate() hands the call to generate_batch()): stock, as
            # generate_batch() called directly is. It holds the locks as any call (it switches the model's attention
            # implementation, which a paged step of another thread's call swaps too); its forwards run on a worker
            # thread while this one waits, and pass (see _wrap_forward)
            logger.debug("generate(cache_implementation='paged'): transformers' continuous batching, not paged here")
            with _one_call(state):
                state.continuous_batching += 1
                try:
                    return generate(*args, **kwargs)
                finally:
                    state.continuous_batching -= 1
        given = _find_cache(kwargs, state.cache_kwarg)
        # (a cache an earlier patched call returned is released: its pool, held weakly, plays no part)
        theirs = given.pool if isinstance(given, PagedCache) and "pool" in vars(given) else None
        while True:
            assistant = _assistant_patch(kwargs)
            also = (assistant[0], None) if assistant is not None else ()
            with _one_call(state, theirs, *also):
                if state.install_token is not token:
                    break
                now = _assistant_patch(kwargs)
                if (now is None) != (assistant is None) or (now is not None and any(
                        a is not b for a, b in zip(now, assistant))):
                    # the assistant model was unpatched or patched again while this call waited: its locks
                    # are taken anew (holding the old patch's, its forwards would take the new one's)
                    continue
                state.generating += 1
                try:
                    return _paged_generate(_alive(model_ref), *args, **kwargs)
                except Exception as e:
                    if _fullgraph_refused(e):  # (the patched forward compiled whole: the refusal above, as dynamo words it)
                        raise NotImplementedError(_fullgraph_message(owner_name)) from e
                    raise
                finally:
                    state.generating -= 1
        # unpatched (and maybe patched again) while this call waited for the locks: the call is the model's
        # generate() as it is now, under that patch's locks (run on this one, its forwards would take the new
        # patch's lock while holding the pool's, against a thread taking the two the other way round)
        return _current_method(model_ref, "generate", generate)(*args, **kwargs)

    def _paged_generate(model, *args, **kwargs):
        args, kwargs = _without_empty_ids(args, kwargs)
        passed = _passed_generation_config(args, kwargs)
        config = _GenerationSettings(passed, model.generation_config)
        given = _find_cache(kwargs, state.cache_kwarg)
        if isinstance(given, PagedCache) and given.made_by_generate and not given.is_initialized:
            # the released cache an earlier patched call returned (transformers' multi-turn recipe passes
            # out.past_key_values back): empty, so this call runs as with no cache, and the prefix cache serves
            # what the earlier call computed
            held, returned = given.held_tokens, given
            # (the keyword stays, as None: stock's generate() still warns of a deprecated name for it)
            kwargs = {**kwargs, _cache_keyword(kwargs, state.cache_kwarg): None}
            given = None
            if returned.stock_cache is not None:  # continued stock once (below): stock's cache, continued again
                out = generate(*args, **_with_cache(kwargs, returned.stock_cache, state.cache_kwarg))
                return _continued_in(returned, None, out, state.cache_kwarg)
            by_row = peft_adapters_by_row(model, kwargs) is not None
            if by_row:
                # stock's cache holds the earlier tokens' K/V under the earlier call's adapters, which the tokens
                # computed again under this call's per-row adapters (or its aLoRA offsets) are not: the call
                # runs as without the cache (README, Prefix cache)
                logger.debug("peft adapters per row or position: the returned cache's tokens are not reused")
                out = _generate_with(model, None, args, kwargs, config, passed, returned, by_row)
                from transformers import Cache

                ran = getattr(out, state.cache_kwarg, None)
                if isinstance(ran, Cache) and ran is not returned:
                    # a call that ran stock (a hole in the mask): its cache holds the K/V later turns continue
                    returned.stock_cache = ran
                    return _continued_in(returned, None, out, state.cache_kwarg)
                return out
            holes = _mask_with_holes(args, kwargs, config)
            if holes is not None:
                # stock continues its cache, whose K/V attended the pad token an earlier call emitted, and masks it
                # only for the new columns (an assistant model's next round, a chat's next turn): neither a paged
                # cache (a hole) nor a run from scratch gives that, a stock cache of the earlier tokens does
                width = None
                if held is None:  # (beams: computed as with a fresh cache, as without a hole)
                    _refuse_hole_before_held_columns(holes, returned.returned_len)
                    width = _columns_after_held(None, args, kwargs, config, returned.returned_len)
                out = _continue_held_tokens_stock(model, state, held, generate, args, kwargs, config, returned)
                return out if width is None else _first_step_outputs_cut(out, width)
            if held is not None and _other_inputs(kwargs):
                # images (audio, ...): stock computes the columns after its cache's alone, on its cache of the
                # earlier call's tokens, whose placeholder ids (typed or generated) were fed no image then and take
                # none now; run from scratch they would (too many placeholders). Stock's cache, continued stock
                return _continue_held_tokens_stock(model, state, held, generate, args, kwargs, config, returned)
            if held is not None and (held.embeds is not None or _fed_embeds(kwargs)) and not _candidate_decoding(
                    kwargs, config):
                # columns computed from embeddings (no token id stands for them), or embeddings fed for columns the
                # cache holds: stock keeps that cache's K/V for its columns and computes only the later ones
                if _extends_held_columns(held, args, kwargs, config):
                    return _continue_held_tokens(model, state, held, args, kwargs, config, returned)
                if held.embeds is not None:  # (another batch or mask, beams, no cache: what stock does, on its cache)
                    return _continue_held_tokens_stock(model, state, held, generate, args, kwargs, config, returned)
            if held is not None and _continues_other_tokens(held, args, kwargs, config):
                return _continue_held_tokens(model, state, held, args, kwargs, config, returned)
            width = _columns_after_held(held, args, kwargs, config, returned.returned_len)
            out = _generate_with(model, given, args, kwargs, config, passed, returned, by_row)
            # (stock computes only the columns after its cache's: so many per-position outputs)
            return out if width is None else _first_step_outputs_cut(out, width)
        return _generate_with(model, given, args, kwargs, config, passed)

    # (not a part of _paged_generate calling it again: a closure calling itself is a reference cycle, which would
    # keep this state, and the pool's K/V memory, alive until the garbage collector runs)
    def _generate_with(model, given, args, kwargs, config, passed, returned=None, by_row=None):
        # (by_row: the call's peft_adapters_by_row found something, where the caller looked already: one walk)
        if by_row is None and isinstance(given, PagedCache):
            by_row = peft_adapters_by_row(model, kwargs) is not None
        if isinstance(given, PagedCache):  # (listed before the call's _sync_modules: a Dropout added since the last)
            state.watched = watched_modules(model)
        if isinstance(given, PagedCache) and (_own_attention(state) is not None or _skips_prefix_cache(
                given.pool, model, kwargs, config, state.rope_by_length, state.embeds_token_types, by_row)):
            # a call that cannot build on cached prefixes (candidate decoding crops and re-verifies from the prompt
            # on, outputs of every prompt position, an older release's chunked prefill, dropout, ...), or whose
            # attention is of the caller's own: a cache of the caller's that the prefix cache pre-filled starts
            # empty instead
            given.leave_prefix_cache()
            given.verifies_candidates = _candidate_decoding(kwargs, config)
        elif isinstance(given, PagedCache):
            given.rejoin_prefix_cache()  # (emptied since a call that left it)
        if isinstance(given, PagedCache):
            given.rows_as_fed = by_row
            _check_callers_cache(given, args, kwargs, config)
            if given.prefilled_from_prefix_cache:
                forget_rope_deltas(model)
        if given is not None or kwargs.get("use_cache", config.use_cache) is False:
            return generate(*args, **kwargs)
        if _peft_prompt_learning(model):
            # peft prompt / prefix tuning puts virtual tokens in front of every row, after the mask's padding (a
            # hole a paged cache cannot hold), or hands the model K/V of its own
            logger.debug("peft prompt learning: stock generate(), not paged")
            return generate(*args, **kwargs)
        if bidirectional_config(model.config):
            # set since patch() (which refuses it): the model attends both ways, so its K/V of a prefix depend on
            # what follows; stock generate() computes that
            logger.debug("use_bidirectional_attention set: stock generate(), not paged")
            return generate(*args, **kwargs)
        other = _other_inputs(kwargs)
        if other:
            # images, audio, video: their features enter through placeholder ids the prefix cache cannot tell
            # apart, and some models attend both ways within an image; such calls run stock generate()
            logger.debug("generate() with %s: stock generate(), not paged", ", ".join(other))
            return generate(*args, **kwargs)
        own = _own_attention(state)
        if own is not None:
            # an attention function of the caller's: paged attention cannot stand in for it
            logger.debug("attention implementation %r: stock generate(), not paged", own)
            return generate(*args, **kwargs)
        if _holes_in_mask_on_every_rank(state.pool, args, kwargs, config):
            # a zero after a one in a row's mask: right padding, a pad token masked inside the prompt (transformers
            # gives an assistant model's and early exit's drafts the mask input_ids != pad_token_id, or none, and
            # their prompts hold every token the target emitted, the pad token too). No paged cache can hold the
            # hole; stock attention applies it
            logger.debug("an attention mask with a hole inside a row: stock generate(), not paged")
            return generate(*args, **kwargs)
        implementation = _cache_implementation(kwargs, passed, model.generation_config)
        if implementation is not None:  # asked for in this call: that cache, not ours
            logger.debug("generate(cache_implementation=%r): stock generate(), not paged", implementation)
            return generate(*args, **kwargs)
        default = model.generation_config.cache_implementation
        if default not in (None, "hybrid") and "cache_implementation" not in kwargs:
            # the model's own default (a hub generation_config.json); a patched model generates with a PagedCache.
            # Unset for this call only (calls are serialised by the lock), so that no generation kwarg is added.
            logger.debug("ignoring generation_config.cache_implementation=%r: generating with a PagedCache", default)
            model.generation_config.cache_implementation = None
            try:
                return _run_paged(model, args, kwargs, config, returned, by_row)
            finally:
                model.generation_config.cache_implementation = default
        return _run_paged(model, args, kwargs, config, returned, by_row)

    def _run_paged(model, args, kwargs, config, returned=None, by_row=None):
        _follow_model(model, state)
        pool, cache, failed = state.pool, None, None
        try:
            # the cache checks the pool against the model before it looks the prompt up (another model's K/V, or
            # weights changed in place: no stale prefix hits), else the first forward does
            cache = _cache_for(pool, model, args, kwargs, config, state.rope_by_length, state.embeds_token_types,
                               by_row, returned.returned_len if returned is not None else 0)
        except Exception as e:
            failed = e
        try:
            agree(pool.ranks, failed)  # tensor parallel: one rank's bad input stops every rank here
        except BaseException:  # (a Ctrl-C too: the caller may keep the error, and with its traceback this cache)
            if cache is not None:
                cache.release()
            raise
        finally:
            failed = None  # (held by the traceback's frame, it would make a cycle keeping the model and its pool)
        try:
            if cache.prefilled_from_prefix_cache:
                forget_rope_deltas(model)
            out = generate(*args, **_with_cache(kwargs, cache, state.cache_kwarg))
            _note_held_tokens(cache, out, args, kwargs, config)
            return _continued_in(returned, cache, out, state.cache_kwarg)
        finally:
            try:
                _release_as_returned(cache)
            except BaseException:  # (see _release_as_returned)
                cache.release()
                raise

    return paged_generate


def _continue_held_tokens(model, state: PatchState, held: HeldTokens, args: tuple, kwargs: dict, config,
                          returned: PagedCache | None = None):
    """generate() on the cache an earlier call returned, where stock's cache holds K/V that the new prompt does not
    give again: a prompt whose first columns hold other tokens than that call's sequences (a chat template that
    tokenizes an answer otherwise), columns computed from ``inputs_embeds``, or a call fed ``inputs_embeds`` for
    those columns. Stock's cache still holds the earlier K/V and computes only the columns after them, so this call
    does too. A cache of its own is filled with the earlier call's columns (tokens from the prefix cache, the rest
    computed; from embeddings, all computed and kept out of the prefix cache), then handed to the patched
    generate() as a caller's cache; its pages go to the prefix cache when the call ends. (Module level, calling
    ``model.generate``: a closure calling the wrapper's own would make a reference cycle.)"""
    # (columns of embeddings, which no token id stands for: neither served nor offered by the prefix cache)
    cache = PagedCache(state.pool, held.ids, held.mask, prefix_cache=held.embeds is None, model=model)
    try:
        start = cache.get_seq_length()
        positions = (held.mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():  # (as generate() computes the K/V it keeps)
            model(**_held_inputs(model, held, start), attention_mask=held.mask, position_ids=positions[:, start:],
                  use_cache=True, logits_to_keep=1, **{state.cache_kwarg: cache})
        out = model.generate(*args, **_with_cache(kwargs, cache, state.cache_kwarg))
        _note_held_tokens(cache, out, args, kwargs, config, computed_from=held, model=model)
        return _continued_in(returned, cache, out, state.cache_kwarg)
    finally:
        try:
            _release_as_returned(cache)
        except BaseException:  # (see _release_as_returned)
            cache.release()
            raise


def _held_inputs(model, held: HeldTokens, start: int = 0, embeds: bool = False) -> dict:
    """The forward inputs that compute ``held``'s columns from ``start`` on: ``input_ids`` [B, L - start], or
    ``inputs_embeds`` [B, L - start, hidden] where it holds embeddings or ``embeds`` asks for them (those of its
    token ids looked up in the model's input embeddings, as ``generate()`` feeds them)."""
    if held.embeds is None and not embeds:
        return {"input_ids": held.ids[:, start:]}
    E = 0 if held.embeds is None else held.embeds.shape[1]
    table = model.get_input_embeddings()
    with torch.no_grad():
        rest = table(held.ids[:, E:].to(table.weight.device))
    if held.embeds is not None:
        rest = torch.cat([held.embeds.to(rest.device, rest.dtype), rest], dim=1)
    return {"inputs_embeds": rest[:, start:]}


def _continue_held_tokens_stock(model, state: PatchState, held: HeldTokens | None, generate, args: tuple,
                                kwargs: dict, config, returned: PagedCache | None = None):
    """Stock ``generate()`` on a ``DynamicCache`` holding the K/V of the columns the cache an earlier patched call
    returned held (``held``: their tokens, mask and embeddings; None where it recorded none: an empty cache),
    computed with that call's mask: what stock's own returned cache holds, for a call whose prompt has a hole in
    its mask (see :func:`_mask_with_holes`), or one given columns computed from embeddings that it does not simply
    extend (another batch or mask, beams)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if held is not None and held.ids.shape[1]:  # (cropped to nothing: stock's cache is empty, all are computed)
        positions = (held.mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():  # (as generate() computes the K/V it keeps)
            model(**_held_inputs(model, held), attention_mask=held.mask, position_ids=positions, use_cache=True,
                  logits_to_keep=1, **{state.cache_kwarg: cache})
    if _get(kwargs, config, "is_assistant") and hasattr(cache, "activate_past_recording"):
        # an assistant model's drafts are cropped after each round, which a sliding-window layer can only undo
        # when it records its past: stock's generate() turns that on in the assistant's cache it makes
        cache.activate_past_recording()
    out = generate(*args, **_with_cache(kwargs, cache, state.cache_kwarg))
    if returned is None:
        return out
    # the mask's hole is in this cache's K/V now, which no one forward over its tokens recomputes: the cache
    # passed in keeps it, and calls given that cache continue it (stock generate()), as stock's own cache
    returned.stock_cache = cache
    return _continued_in(returned, None, out, state.cache_kwarg)


def _release_as_returned(cache: PagedCache) -> None:
    """Release the cache a patched ``generate()`` ran on, keeping what a later call given it (or its row and crop
    operations) needs of stock's returned cache: its columns and rows (the tokens, see :func:`_note_held_tokens`,
    are kept already).

    A caller releases the cache again where this raises: a Ctrl-C that lands as the call ends, before the release
    holds interrupts back (it fires as this function is entered, outside anything it could catch), would leave the
    pages to the cache's finaliser, which the traceback a caller keeps (a notebook keeps the last one) puts off."""
    cache.returned_len, cache.returned_rows = _columns_and_rows(cache)
    cache._hold_pool_weakly()  # (released: outputs a caller keeps must not keep a deleted model's pool alive)
    cache.made_by_generate = cache.returned_by_generate = True


def _columns_and_rows(cache: PagedCache) -> tuple[int, int]:
    """The columns and rows a cache a patched ``generate()`` ran on holds as that call returns (those of stock's
    returned cache)."""
    return cache.logical_len, len(cache._rows.req_rows)


def _continued_in(returned: PagedCache | None, ran_on: PagedCache | None, out, cache_kwarg: str):
    """``out`` of a call given ``returned`` (the released cache an earlier patched call returned), which now
    records what ``ran_on``, the cache the call ran on, holds (its tokens and mask, columns and rows; None: the call
    ran on a stock cache, kept in ``returned.stock_cache``): handed back in place of that cache, as stock's
    ``generate()`` hands back the cache it was given, grown."""
    from transformers import Cache

    if returned is None:
        return out
    if ran_on is None:
        returned.held_tokens, returned.returned_len, returned.returned_rows = None, 0, 0
    else:
        returned.held_tokens = ran_on.held_tokens
        returned.returned_len, returned.returned_rows = _columns_and_rows(ran_on)
        returned._hold_pool_weakly(ran_on.pool)  # (the pool of the model that ran this turn, still live)
    if isinstance(getattr(out, cache_kwarg, None), Cache):
        setattr(out, cache_kwarg, returned)
    return out


def _refuse_hole_before_held_columns(mask: torch.Tensor, length: int) -> None:
    """For a call whose ``mask`` [B, T] has a hole, given the cache an earlier patched call returned that recorded
    no tokens (beams), which therefore runs on a fresh cache: refuse a mask that masks one of the
    first ``length`` columns (those stock's cache holds) before one of them it leaves unmasked. Stock's K/V of the
    later column attended the masked one; a fresh cache's do not. A hole after them (a row that finished early,
    padded to the end) changes none of their K/V.

    Raises:
        ValueError: naming the rows.
    """
    held = mask[:, :length].bool()
    hole = (held.long().cumsum(-1) > 0) & ~held  # a masked column after a row's first token
    rows = ((hole.long().cumsum(-1) > 0) & held).any(-1).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"attention_mask rows {rows} mask a column among the {length} the cache passed in holds, before one they "
            "leave unmasked: stock's cache holds K/V computed attending it, which the cache a patched generate() "
            "returned after beam search (it records no tokens) cannot give; pass the cache of a "
            "call of input_ids, or call without a cache"
        )


def _columns_after_held(held, args: tuple, kwargs: dict, config, length: int = 0) -> int | None:
    """For a call given the cache an earlier patched call returned and asking for hidden states or attentions of
    every position: the number of prompt columns after the ``L`` that cache held (stock's cache holds their K/V, so
    its first forward, and the per-position outputs of it, cover only the columns after them), else None. ``L`` is
    the columns of ``held`` (its tokens and mask), or ``length`` where it recorded none (beams)."""
    L = held.ids.shape[1] if held is not None else length
    if L == 0 or not (_get(kwargs, config, "output_hidden_states") or _get(kwargs, config, "output_attentions")):
        return None
    if _fed_embeds(kwargs):
        width = kwargs["inputs_embeds"].shape[1]  # [B, T, hidden]: stock's first forward is fed the columns after L
    else:
        prompt = _prompt_and_mask(args, kwargs, config)
        if prompt is None:
            return None
        width = prompt[0].shape[1]
    return width - L if width > L else None


def _first_step_outputs_cut(out, width: int):
    """``out`` (generate()'s output) with the first step's ``hidden_states`` ([B, T, hidden] per layer) and
    ``attentions`` ([B, heads, T, keys] per layer) cut to their last ``width`` query positions."""
    for name, axis in (("hidden_states", 1), ("attentions", 2)):
        steps = getattr(out, name, None)
        if not isinstance(steps, tuple) or not steps or not isinstance(steps[0], tuple):
            continue
        first = tuple(t.narrow(axis, t.shape[axis] - width, width) if isinstance(t, torch.Tensor)
                      and t.shape[axis] > width else t for t in steps[0])
        setattr(out, name, (first, *steps[1:]))
    return out


def _without_empty_ids(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A generate() call fed ``inputs_embeds`` [B, T, hidden] with ``input_ids`` of no columns [B, 0] as the call
    fed the embeddings alone (``generate()`` makes such ids itself for them; stock gives the same tokens either
    way), so that the empty ids are taken for no prompt of their own."""
    ids, embeds = _call_input_ids(args, kwargs), kwargs.get("inputs_embeds")
    if (not isinstance(embeds, torch.Tensor) or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1]
            or ids.shape[0] != embeds.shape[0]):  # (rows that differ: stock's error)
        return args, kwargs
    if args:
        return (None, *args[1:]), kwargs
    return args, {k: v for k, v in kwargs.items() if k not in ("inputs", "input_ids")}


def _call_input_ids(args: tuple, kwargs: dict):
    """The prompt a generate() call is given: its first positional argument, else ``inputs=`` or ``input_ids=``."""
    return args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))


def _prompt_and_mask(args: tuple, kwargs: dict, config):
    """A generate() call's ``input_ids`` [B, T] and its mask (the one passed, else the one generate() implies), or
    None when the call is fed otherwise (``inputs_embeds``)."""
    input_ids = _call_input_ids(args, kwargs)
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point()
            or kwargs.get("inputs_embeds") is not None):
        return None
    mask = kwargs.get("attention_mask")
    mask = _implied_mask(input_ids, kwargs, config) if mask is None else mask
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        return None
    return input_ids, mask


def _note_held_tokens(cache: PagedCache, out, args: tuple, kwargs: dict, config,
                      computed_from: HeldTokens | None = None, model=None) -> None:
    """Record on the cache a patched generate() made what a stock cache would hold after the call, a
    :class:`~astrai_hf.cache.HeldTokens` of ``L = cache.logical_len`` columns (the prompt, then ``sequences``' new
    tokens), for the calls given it later (:func:`_continue_held_tokens`). ``computed_from``: the columns its first
    ``L0`` columns were computed from, when not the prompt's (a call continuing an earlier one's; ``model`` looks up
    the embeddings of its tokens where this call fed embeddings). A call fed ``inputs_embeds`` records a copy of
    them (its ``sequences`` hold the new tokens alone unless ``input_ids`` came with them). Left unset for calls
    whose cache rows are not the returned sequences (beams); several samples per prompt are rows of their own, as
    in stock's cache. After candidate decoding the cache holds the accepted tokens but the last, as stock's does."""
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    fed = kwargs["inputs_embeds"] if _fed_embeds(kwargs) else None
    if fed is not None:
        mask = _embeds_mask(kwargs)
        prompt = _call_input_ids(args, kwargs)
        if not isinstance(prompt, torch.Tensor) or prompt.shape != fed.shape[:2]:
            prompt = None  # (sequences hold the new tokens alone: placeholders stand for the prompt's)
    else:
        prompt_and_mask = _prompt_and_mask(args, kwargs, config)
        prompt, mask = prompt_and_mask if prompt_and_mask is not None else (None, None)
    if sequences is None or mask is None or (_get(kwargs, config, "num_beams") or 1) != 1:
        return
    n = _get(kwargs, config, "num_return_sequences") or 1
    mask = mask.repeat_interleave(n, dim=0)  # one row per returned sequence
    B, T = mask.shape
    if prompt is None:  # (fed embeddings alone)
        placeholders = torch.zeros(B, T, dtype=sequences.dtype, device=sequences.device)
        sequences = torch.cat([placeholders, sequences], dim=1)
    L = cache.logical_len
    if sequences.shape[0] != B or not T <= L < sequences.shape[1] or cache.batch_size != B:
        return
    grown = torch.ones(B, L - T, dtype=mask.dtype, device=mask.device)
    tokens = sequences[:, :L].clone()
    embeds = computed_from.embeds if computed_from is not None else None
    if computed_from is not None:
        tokens[:, : computed_from.ids.shape[1]] = computed_from.ids.to(tokens.device)
    if fed is not None:
        fed = fed.detach().repeat_interleave(n, dim=0)
        L0 = 0 if computed_from is None else computed_from.ids.shape[1]
        if L0:  # the earlier columns' embeddings, then the ones fed after them: the first T columns' inputs
            before = _held_inputs(model, computed_from, embeds=True)["inputs_embeds"]
            embeds = torch.cat([before, fed[:, L0:].to(before.device, before.dtype)], dim=1)
        else:
            embeds = fed.clone()  # (a soft prompt trained further in place later: the cache holds what was computed)
    cache.held_tokens = HeldTokens(tokens, torch.cat([mask, grown], dim=1), embeds)


def _fed_embeds(kwargs: dict) -> bool:
    """Whether a generate() call is fed ``inputs_embeds`` [B, T, hidden]."""
    embeds = kwargs.get("inputs_embeds")
    return isinstance(embeds, torch.Tensor) and embeds.dim() == 3


def _embeds_mask(kwargs: dict):
    """The mask of a generate() call fed ``inputs_embeds`` [B, T, hidden]: the one passed, else the ones [B, T]
    generate() implies."""
    embeds, mask = kwargs["inputs_embeds"], kwargs.get("attention_mask")
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device) if mask is None else mask


def _extends_held_columns(held: HeldTokens, args: tuple, kwargs: dict, config) -> bool:
    """Whether a call given the cache an earlier patched call returned has a prompt (``input_ids`` or
    ``inputs_embeds``) that is longer than the columns that cache held, with the same rows and the same mask over
    them, and asks for one sequence per row (no beams, no samples per prompt, the cache used): a prompt that
    stock computes on top of that cache's K/V alone."""
    if _fed_embeds(kwargs):
        mask, width = _embeds_mask(kwargs), kwargs["inputs_embeds"].shape[:2]
    else:
        prompt = _prompt_and_mask(args, kwargs, config)
        if prompt is None:
            return False
        mask, width = prompt[1], prompt[0].shape
    if _candidate_decoding(kwargs, config) or kwargs.get("use_cache", config.use_cache) is False:
        return False
    if (_get(kwargs, config, "num_beams") or 1) != 1 or (_get(kwargs, config, "num_return_sequences") or 1) != 1:
        return False
    B, L = held.ids.shape
    if tuple(width) != (B, width[1]) or width[1] <= L or not isinstance(mask, torch.Tensor) or mask.shape != width:
        return False
    return torch.equal(mask[:, :L].to(held.mask.device).bool(), held.mask.bool())


def _continues_other_tokens(held: HeldTokens, args: tuple, kwargs: dict, config) -> bool:
    """Whether a call given the cache an earlier patched call returned has a prompt of ``input_ids`` that extends
    the columns that cache held (:func:`_extends_held_columns`) with other tokens at some unmasked column."""
    prompt = _prompt_and_mask(args, kwargs, config)
    if prompt is None or not _extends_held_columns(held, args, kwargs, config):
        return False
    L = held.ids.shape[1]
    return bool(((prompt[0][:, :L].to(held.ids.device) != held.ids) & held.mask.bool()).any())


# attention implementations paged attention stands in for: transformers' own (looked up in its registry, and
# "eager", the modeling file's own) and kernels from the hub ("org/repo" names); a function registered under another
# name is the caller's own attention
_STANDARD_ATTENTION = {"eager", attention.ATTENTION_NAME}


def _own_attention(state: PatchState) -> str | None:
    """The name of an attention implementation of the caller's (``AttentionInterface.register`` and
    ``set_attn_implementation``) that a patched model's config selects, or None."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for config in state.attn_configs:
        name = getattr(config, "_attn_implementation_internal", None)
        if not isinstance(name, str):
            continue
        base = name.split("|")[-1]  # "paged|sdpa": transformers' continuous batching over one of its own
        if base in _STANDARD_ATTENTION or "/" in base:
            continue
        fn = ALL_ATTENTION_FUNCTIONS[base] if base in ALL_ATTENTION_FUNCTIONS else None
        if fn is not None and not getattr(fn, "__module__", "").startswith("transformers."):
            return name
    return None


def _check_attention_modules(model, modules: list, when: str = "") -> None:
    """Raise NotImplementedError when paged attention cannot stand in for ``modules`` (``model``'s attention
    modules): one computes attention without transformers' AttentionInterface, or :func:`unsupported_feature`
    names a reason."""
    # (the model's feature first: a hybrid's linear-attention layers compute attention by hand too)
    reason = unsupported_feature(model, modules) or _dynamically_quantized(model)
    if reason is not None:
        raise NotImplementedError(f"{type(model).__name__}{when}: {reason}; astrai-hf cannot patch it (stock "
                                  "generate() and an unpatched model are unaffected)")
    for cls, module in sorted({type(m): m for m in modules}.items(), key=lambda item: item[0].__name__):
        if not _uses_attention_interface(cls) and not any(
                _uses_attention_interface(type(child)) for child in module.children()):
            # (a module that holds the layer_idx and hands attention to a child: DBRX's DbrxNormAttentionNorm)
            raise NotImplementedError(
                f"{cls.__name__} computes attention without transformers' AttentionInterface, so paged attention "
                f"cannot be routed into {type(model).__name__}{when}; use PagedCache without patch() instead"
            )


_DYNAMIC_QUANTIZATION = ("torch.ao.nn.quantized.dynamic", "torch.nn.quantized.dynamic")


def _dynamically_quantized(model) -> str | None:
    """Why a model with torch's dynamically quantized layers (``torch.ao.quantization.quantize_dynamic``) cannot be
    patched, or None: they scale each input tensor by its own range, so a row's output depends on every value in
    the batch, padding included, and a packed prefill or a prefix hit (other tensors) changes the tokens."""
    head = None
    for m in model.modules():
        if not type(m).__module__.startswith(_DYNAMIC_QUANTIZATION):
            continue
        if head is None:
            head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else False
        # the LM head sees the same rows as stock's (each row's last position); float16 "quantization" scales nothing
        if m is not head and getattr(getattr(m, "_packed_params", None), "dtype", None) != torch.float16:
            return (f"{type(m).__name__} (torch dynamic quantization) scales activations per tensor, so a row's "
                    "output depends on the whole batch, padding included, which packed prefill and the prefix cache "
                    "change")
    return None


def _check_not_shared(model, modules: list, state: PatchState | None = None, when: str = "") -> None:
    """Refuse attention ``modules`` of ``model`` that carry another patched model's state: a module shared by two
    models (a reference model sharing its first layers with the policy, a trunk assigned to two heads) runs paged
    attention under one patch, and a second patch would take it from the first, which then fails.

    Raises:
        NotImplementedError: naming the module; ``patch()`` leaves the model unpatched (the zero-code hook leaves it
            on stock ``generate()``).
    """
    for m in modules:
        ref = m.__dict__.get(_STATE_ATTR)
        other = ref() if isinstance(ref, weakref.ref) else None
        if other is None or other is state:
            continue
        owner = other.model_ref() if other.model_ref is not None else None
        if owner is not None and any(sub is model for sub in owner.modules()):
            # a wrapper of this model patched before it (peft's PeftModel): the wrapper's forward runs this model's,
            # whose own patch takes the modules over, as it did before modules were checked
            continue
        name = next((n for n, sub in model.named_modules() if sub is m), type(m).__name__)
        raise NotImplementedError(
            f"{type(model).__name__}{when}: its attention module {name!r} is shared with another patched model; a "
            "module runs paged attention for one patched model only, so astrai-hf cannot patch this one too (patch "
            "one of them, or give this one a copy of its own with copy.deepcopy)"
        )


def _attach_modules(model, state: PatchState, modules: list) -> None:
    """Make ``modules`` run paged attention under ``state``: each carries the state (and pickles unpatched), and
    the configs they read their attention implementation from are the ones a paged step switches."""
    for m in modules:
        # held weakly: a module that outlives the patched model (peft's merge_and_unload() hands back the base
        # model's modules) must not keep its pool alive
        setattr(m, _STATE_ATTR, weakref.ref(state))
        m.__reduce_ex__ = _OnInstance(_reduce_unpatched, m, None)
    configs = list({id(m.config): m.config for m in modules if hasattr(m, "config")}.values())
    state.attn_configs = configs or [model.config]
    state.module_refs = [weakref.ref(m) for m in modules]


def _sync_modules(model, state: PatchState) -> None:
    """Patch attention modules that joined the model since ``patch()`` (a layer deep-copied, swapped or added) as
    patch() patched the first ones; the settings that follow from the config are read again too (a RoPE switched
    to ``dynamic``).

    Raises:
        NotImplementedError: a new module is one ``patch()`` would have refused.
    """
    state.rope_by_length = rope_depends_on_length(model)
    state.watched = watched_modules(model)  # (a Dropout added, ...)
    quantized = _dynamically_quantized(model)  # (quantize_dynamic(..., inplace=True) after patch())
    if quantized is not None:
        raise NotImplementedError(f"{type(model).__name__} (it changed since patch()): {quantized}; unpatch it")
    modules, reordered = attention_modules_in_place(model)
    changed = [id(m) for m in modules] != [id(ref()) for ref in state.module_refs]
    if changed or reordered:  # (reordered: the same modules in other places, whose layer_idx may no longer give
        _check_attention_modules(model, modules, " (it changed since patch())")  # their kind of layer)
    if changed:
        _check_not_shared(model, modules, state, " (it changed since patch())")
        _attach_modules(model, state, modules)
        _close_runners(state)  # captured over the modules that left
        logger.info("%s: its attention modules changed since patch(); patched the new ones", type(model).__name__)
    if changed or reordered:
        state.mask_places = None
    _sync_windows(model, state, modules)


def _sync_windows(model, state: PatchState, modules=None) -> None:
    """Read again the sliding window each attention module's config gives (see :func:`_config_windows`)."""
    modules = state.modules if modules is None else modules
    if state.mask_places is None:
        state.mask_places = _mask_places(model, modules)
    windows = _config_windows(state.mask_places, modules)
    if windows != state.windows:
        _close_runners(state)  # captured with the windows of before
        state.windows = windows


def _close_runners(state: PatchState) -> None:
    for runner in list(state.runners.values()):  # (a pool freed meanwhile drops its runner from the dict)
        runner.close()
    state.runners.clear()


def _config_windows(places: dict, modules) -> dict[int, int | None]:
    """The sliding window of each attention module whose window no longer agrees with the config stock masks it
    by, by ``id(module)``: the window stock sdpa and eager attention apply through the mask the forward of the
    model holding the list of layers builds from its ``config.sliding_window`` (for the places its
    ``config.layer_types`` names ``sliding_attention``, or for every layer in a config without layer types), where

    - the module hands the attention function a window its ``__init__`` copied from its config (Qwen2, Gemma 2
      and 3, EXAONE 4, Qwen3-MoE, AFMoE, Laguna and their kin), and the config was edited since, or the attribute
      was set by hand, or the module keeps a config of its own (a layer deep-copied, or taken from another model);
    - the module reads ``sliding_window`` from its config at each forward (Mistral), and that config is one of its
      own that gives another window than the model's.

    ``places``: :func:`_mask_places` of the model."""
    windows = {}
    for m in modules:
        config, index = getattr(m, "config", None), getattr(m, "layer_idx", None)
        owner, index = places.get(id(m), (None, index))
        owner = owner() if owner is not None else None
        mask_config = vars(owner).get("config") if owner is not None else config
        if config is None or mask_config is None or not isinstance(index, int):
            continue
        copied = _window_copied_from_config(type(m))
        if copied is None:
            if mask_config is not config and _window_read_from_config(type(m)):
                window = getattr(mask_config, "sliding_window", None)
                if window != getattr(config, "sliding_window", None):
                    windows[id(m)] = window
            continue
        by_layer_type, flag = copied
        config = mask_config
        types = getattr(config, "layer_types", None)
        if by_layer_type != isinstance(types, (list, tuple)) or (by_layer_type and not 0 <= index < len(types)):
            continue  # (a window for every layer, in a config that has layer types: unknown ground)
        window = getattr(config, "sliding_window", None)
        if by_layer_type and types[index] != "sliding_attention":
            window = None
        passed = getattr(m, "sliding_window", None)
        if flag is not None and not getattr(m, flag, False):
            passed = None
        if window != passed:
            windows[id(m)] = window
    return windows


def _mask_places(model, modules) -> dict[int, tuple]:
    """``(owner, place)`` of each of the attention ``modules`` inside a list of ``model``'s layers, by
    ``id(module)``: a weak reference to the module holding the list (``layers``) and a ``config``, whose forward
    builds the masks from that config, and the layer's place in the list, which picks its kind from
    ``config.layer_types`` there (transformers' decoders). A layer deep-copied or taken from another model keeps a
    config of its own, which stock's masks do not read."""
    attention, places = {id(m) for m in modules}, {}
    for owner in model.modules():
        layers = owner._modules.get("layers")
        if not isinstance(layers, torch.nn.ModuleList) or vars(owner).get("config") is None:
            continue
        ref = weakref.ref(owner)
        for place, layer in enumerate(layers):
            for m in layer.modules():
                if id(m) in attention:
                    places.setdefault(id(m), (ref, place))
    return places


@functools.cache
def _window_read_from_config(cls: type) -> bool:
    """Whether ``cls``'s forward hands the attention function ``sliding_window=getattr(self.config,
    "sliding_window", ...)`` or ``self.config.sliding_window`` in every call (Mistral)."""
    found = _attention_calls(cls)
    calls = [c for _, cs in found or () for c in cs if not _is_super_forward(c)]

    def self_config(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name)
                and node.value.id == "self")

    args = [k.value for c in calls for k in c.keywords if k.arg == "sliding_window"]
    return bool(calls) and len(args) == len(calls) and all(_reads_window(a, self_config) for a in args)


def _reads_window(node, is_config) -> bool:
    """Whether ``node`` reads ``<config>.sliding_window`` or ``getattr(<config>, "sliding_window"[, default])``,
    ``<config>`` a node ``is_config`` accepts."""
    if isinstance(node, ast.Attribute):
        return node.attr == "sliding_window" and is_config(node.value)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "sliding_window")


def _own_init(cls: type):
    """The ``__init__`` written in the class that defines the nearest one in ``cls``'s MRO. A class decorator may
    have wrapped it in a function of its own without ``functools.wraps`` (``kernels``' ``use_kernelized_func``,
    which transformers applies to attention classes where that package is installed, as 5.25 installs it): that
    wrapper's closure holds the function it calls, its only one."""
    init = next((vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), None)
    for _ in range(8):  # (wrappers of wrappers)
        init = inspect.unwrap(init) if inspect.isfunction(init) else init
        if not inspect.isfunction(init) or init.__name__ == "__init__":
            break
        inner = [value for value in map(_cell_value, init.__closure__ or ()) if inspect.isfunction(value)]
        if len(inner) != 1:
            break
        init = inner[0]
    return init


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return None


@functools.cache
def _window_copied_from_config(cls: type) -> tuple[bool, str | None] | None:
    """How ``cls`` hands the attention function a window copied from the config in ``__init__``:
    ``(by_layer_type, flag)``, or None when it does not (it reads the config at each forward, or the source is
    unknown). ``__init__`` sets ``self.sliding_window`` once, from ``config.sliding_window``, and the forward passes

    - ``sliding_window=self.sliding_window``, set ``config.sliding_window if <"sliding_attention" layer> else
      None``, the test written there or as a flag set from it (AFMoE, Laguna): ``(True, None)``;
    - ``sliding_window=self.sliding_window if self.<flag> else None``, ``self.<flag>`` set from a
      ``"sliding_attention"`` test: ``(True, flag)``;
    - ``sliding_window=self.sliding_window``, set to the config's value for every layer: ``(False, None)``."""
    init = _own_init(cls)
    found = _attention_calls(cls)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return None
    if not found or not (calls := [c for _, cs in found for c in cs if not _is_super_forward(c)]):
        return None

    def self_attr(node, name=None) -> str | None:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and (name is None or node.attr == name)):
            return node.attr
        return None

    def config_window(node) -> bool:  # config.sliding_window, getattr(config, "sliding_window"[, default])
        return _reads_window(node, lambda owner: isinstance(owner, ast.Name) and owner.id == "config")

    def sliding_test(node) -> bool:
        return any(isinstance(c, ast.Constant) and c.value == "sliding_attention" for c in ast.walk(node))

    def if_else_none(node) -> bool:
        return isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.Constant) and node.orelse.value is None

    assigned: dict[str, list] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for target in n.targets:
                if self_attr(target):
                    assigned.setdefault(target.attr, []).append(n.value)
    sets = assigned.get("sliding_window", [])
    if len(sets) != 1:
        return None
    (value,) = sets
    args = [k.value for c in calls for k in c.keywords if k.arg == "sliding_window"]
    if len(args) != len(calls) or len({ast.dump(a) for a in args}) != 1:
        return None  # a call without the keyword, or calls that pass different windows
    arg = args[0]

    def sliding_flag(node) -> bool:  # self.<flag>, set once from a "sliding_attention" test
        flag = self_attr(node)
        return flag is not None and len(assigned.get(flag, [])) == 1 and sliding_test(assigned[flag][0])

    if self_attr(arg, "sliding_window"):
        if if_else_none(value) and config_window(value.body) and (sliding_test(value.test) or sliding_flag(value.test)):
            return True, None
        return (False, None) if config_window(value) else None
    if if_else_none(arg) and self_attr(arg.body, "sliding_window") and sliding_flag(arg.test) and config_window(value):
        return True, self_attr(arg.test)
    return None


def _fullgraph_message(name: str) -> str:
    return (f"{name}'s forward (or a module of it) is compiled with torch.compile(fullgraph=True), which cannot "
            "trace astrai-hf's paged attention (it runs Python over the pool's page tables at each step): compile "
            "without fullgraph=True, or astrai_hf.unpatch(model) to run stock")


def _fullgraph_refused(error: Exception) -> bool:
    """Whether ``error`` is torch.compile failing to trace astrai-hf's own code into one graph (``fullgraph=True``
    refuses every graph break; without it, dynamo runs such code outside its graphs)."""
    return type(error).__module__.startswith("torch._dynamo") and "astrai_hf" in str(error)


def _follow_model(model, state: PatchState) -> None:
    """Bring the patch up to the model as it is now, before a call: attention modules that joined it
    (:func:`_sync_modules`), and its pool, which patch() built, rebuilt where the model moved to another dtype or
    device or grew a layer; a pool of the caller's that no longer fits is refused, naming what differs."""
    _sync_modules(model, state)
    if not state.pool.fits_placement(state.modules, model):
        pinned = None if state.own_pool_kwargs is None else sorted({"dtype", "device"} & set(state.own_pool_kwargs))
        if pinned == []:
            _rebuild_pool(model, state)
        elif pinned is None:  # the caller's pool: name what no longer fits, before a step
            state.pool.check_model(model)
        else:  # a pool patch() built where the caller pinned its dtype or device: patch() again is the fix
            try:
                state.pool.check_model(model)
            except (TypeError, ValueError) as error:
                # what moved: the dtype (a TypeError) or a layer's device; else the model's shape (a layer added)
                moved = {"dtype": isinstance(error, TypeError), "device": "keeps its K/V on" in str(error)}
                given = ", ".join(f"{name}={state.own_pool_kwargs[name]!r}" for name in pinned)
                fix = ", ".join(f"{name}=<the model's {name} now>" if moved[name] else
                                f"{name}={state.own_pool_kwargs[name]!r}" for name in pinned)
                raise type(error)(
                    f"{str(error).split('; build the pool')[0]}; patch() built the pool with {given}, which it keeps "
                    f"where the model changes: call astrai_hf.patch(model, {fix}) again for a pool that fits, or "
                    "astrai_hf.unpatch(model) and patch it again without them"
                ) from None


def _rebuild_pool(model, state: PatchState) -> None:
    """Replace the default pool of a model moved to another dtype or device since ``patch()`` built it (its cached
    prefixes were computed by the model before the move)."""
    old = state.pool
    state.pool = PagePool.from_model(model, **state.own_pool_kwargs)
    state.checked_pools.add(state.pool)
    # CUDA graphs by default for a model now wholly on one CUDA device (patched on the CPU, then .to("cuda")), and
    # not for one moved off it
    state.cuda_graphs = _wants_graphs(model, state.graphs_given)
    runner = state.runners.pop(id(old), None)
    if runner is not None:
        runner.close()
    logger.info("%s moved to %s since patch(): built a new pool %r", type(model).__name__,
                state.pool.dtype, state.pool)


# tensors generate() takes besides the model's inputs (classifier-free guidance's negative prompt)
_TEXT_INPUTS = ("inputs", "input_ids", "attention_mask", "position_ids", "inputs_embeds",
                "negative_prompt_ids", "negative_prompt_attention_mask")


def _other_inputs(kwargs: dict) -> list[str]:
    """Names of the inputs of a ``generate()`` call beyond text: tensors (``pixel_values``, ``input_features``, ...,
    and token types that mark image spans), and containers of tensors (``mm_encoder_outputs={"image": features}``,
    image features computed beforehand), other than ``generate()``'s parameters and generation settings (an
    ``eos_token_id`` tensor, a logits processor list)."""
    return _not_text(kwargs.items(), _text_or_settings())


# what a forward of a text model is fed besides text and the cache: neither changes the K/V of a token id
_TEXT_FORWARD_INPUTS = frozenset({*_TEXT_INPUTS, "cache_position", "labels", "logits_to_keep", "num_logits_to_keep"})


def _other_forward_inputs(model, args: tuple, kwargs: dict) -> list[str]:
    """:func:`_other_inputs` of a forward's arguments (positional ones by the names of ``model``'s forward):
    tensors and containers of tensors a text model is not fed (``pixel_values``, image features, ...; token types
    marking image spans)."""
    given = dict(zip(_forward_parameters(type(model)), args)) if args else {}
    return _not_text((*given.items(), *kwargs.items()), _TEXT_FORWARD_INPUTS)


def _not_text(items, skip: frozenset[str]) -> list[str]:
    """The names of ``items`` (name, value) outside ``skip`` whose values are or hold tensors, token types all zero
    (plain text) left out."""
    names = []
    for name, value in items:
        if name in skip or not holds_tensor(value):
            continue
        if name in _TOKEN_TYPES and isinstance(value, torch.Tensor) and not bool(value.any()):
            continue  # all text
        names.append(name)
    return sorted(names)


@functools.cache
def _forward_parameters(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters that take positional arguments, ``self`` left out."""
    try:
        params = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)[1:]


@functools.cache
def _text_or_settings() -> frozenset[str]:
    """The names ``generate()`` takes that are text inputs, its own parameters or generation settings: the logits
    processors, stopping criteria and caches passed to it hold tensors that no forward is fed as an image."""
    from transformers import GenerationConfig, GenerationMixin

    params = inspect.signature(GenerationMixin.generate).parameters
    return frozenset({*params, *vars(GenerationConfig()), "past_key_values", "cache", *_TEXT_INPUTS})


def _passed_generation_config(args: tuple, kwargs: dict):
    """The ``generation_config`` a generate() call is given, by keyword or second positional argument, or None."""
    passed = kwargs.get("generation_config")
    return args[1] if passed is None and len(args) > 1 else passed


class _GenerationSettings:
    """What ``generate()`` will use for a setting (``kwargs`` aside): a ``generation_config`` passed to the call,
    where it sets the value, else the model's own ``generation_config`` (transformers fills a passed config's unset
    fields from the model's)."""

    def __init__(self, passed, default):
        self._configs = [c for c in (passed, default) if c is not None]

    def __getattr__(self, name: str):
        for config in self._configs:
            value = getattr(config, name, None)
            if value is not None:
                return value
        return None


def _peft_owners(model) -> list:
    """``model`` and, where ``model`` is the base model of a peft model generating now, that peft model (peft's
    ``generate()`` sets its own ``prepare_inputs_for_generation`` on the base model for the call)."""
    return [model, getattr(model.__dict__.get("prepare_inputs_for_generation"), "__self__", None)]


def _peft_prompt_learning(model) -> bool:
    """Whether ``model`` is a peft model whose active adapter is prompt learning (prompt tuning, prefix tuning,
    p-tuning), or the base model of one generating now."""
    for owner in _peft_owners(model):
        try:
            config = getattr(owner, "active_peft_config", None)
        except Exception:  # peft raises for a model without an active adapter
            config = None
        if getattr(config, "is_prompt_learning", False) is True:
            return True
    return False


_PEFT_PER_CALL_ROWS = ("adapter_names", "alora_offsets")  # per-row arguments peft hands its LoRA layers


def peft_adapters_by_row(model, kwargs: dict | None = None) -> str | None:
    """Why peft's LoRA adapters make a token's K/V depend on more than its row's token ids, or None. ``model``
    is a peft model, the base model of one generating now, or a model with adapters loaded by transformers'
    ``load_adapter``; ``kwargs`` are the call's.

    - ``adapter_names=`` passed to the call: each row runs its own adapter (peft splits the batch by rows);
    - an activated LoRA (aLoRA, ``LoraConfig(alora_invocation_tokens=...)``) among the active adapters: it adapts
      each row's tokens from the last invocation sequence on, counted from the row's end for each call
      (peft docs, "Activated LoRA");
    - a base model generating inside a peft model's ``generate()``, whose LoRA layers peft handed either of
      those for the call (as forward pre-hooks).

    Either way the K/V of a prompt do not follow from its ids (no prefix cache), and a prefill must run as the
    rectangle ``generate()`` feeds (not packed into one row, not chunked)."""
    if kwargs is not None and kwargs.get("adapter_names") is not None:
        return "adapter_names= chooses an adapter per row"
    for module in model.modules():
        found = vars(module)
        # a base model generating inside a peft model's generate(): peft hands its LoRA layers the call's
        # adapter_names / alora_offsets through forward pre-hooks for the call
        for hook in found.get("_forward_pre_hooks", {}).values():
            given = getattr(hook, "keywords", None) or {}  # (functools.partial)
            for name in _PEFT_PER_CALL_ROWS:
                if given.get(name) is not None:
                    return f"peft passes its LoRA layers {name} for this call"
        # a LoRA layer whose active adapter is an activated LoRA (seen from the base model too, which knows no
        # peft config)
        variants = found.get("lora_variant")
        if variants and not found.get("_disable_adapters", False):
            active = found.get("_active_adapter")
            for name in [active] if isinstance(active, str) else active or ():
                variant = variants.get(name)
                if (variant if isinstance(variant, type) else type(variant)).__name__.startswith("ALora"):
                    return f"adapter {name!r} is an activated LoRA (alora_invocation_tokens)"
    for owner in _peft_owners(model):
        configs = getattr(owner, "peft_config", None) if owner is not None else None
        if not isinstance(configs, dict):
            continue
        try:
            active = owner.active_adapters
            active = active() if callable(active) else active  # (a method on transformers' adapter mixin)
        except Exception:  # peft and transformers raise for a model without an active adapter
            continue
        for name in [active] if isinstance(active, str) else active or ():
            if getattr(configs.get(name), "alora_invocation_tokens", None):
                return f"adapter {name!r} is an activated LoRA (alora_invocation_tokens)"
    return None


def _cache_implementation(kwargs: dict, passed, default) -> str | None:
    """The ``cache_implementation`` this call asks for itself (keyword, or a ``generation_config`` passed to it),
    or None. ``"hybrid"`` counts as None: ``generate()`` itself replaces it with a dynamic cache."""
    value = kwargs.get("cache_implementation")
    if value is None and "cache_implementation" not in kwargs and passed is not None:
        value = getattr(passed, "cache_implementation", None)
    return None if value == "hybrid" else value


def _cache_for(pool: PagePool, model, args: tuple, kwargs: dict, config, rope_by_length: bool = False,
               embeds_token_types: bool = True, by_row: bool | None = None, held_columns: int = 0) -> PagedCache:
    """The PagedCache a patched ``generate()`` runs on: the prompt's length checked, its padding and prefix
    found (``by_row``: as for :func:`_skips_prefix_cache`; ``held_columns``: those of the cache an earlier call
    returned, which this call continues)."""
    input_ids = _call_input_ids(args, kwargs)
    attention_mask = kwargs.get("attention_mask")
    new_tokens = 0
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point():
        if input_ids.shape[0] == 0:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} holds no prompt; pass at least one row")
        if input_ids.shape[1] == 0 and kwargs.get("inputs_embeds") is None:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} holds no prompt; pass at least one token "
                             "per row")
        if attention_mask is not None and attention_mask.shape == input_ids.shape:
            check_rows_have_tokens(attention_mask)
        if attention_mask is None:
            attention_mask = _implied_mask(input_ids, kwargs, config)
            _check_rows_have_tokens(attention_mask, kwargs, config)
        elif (attention_mask.dim() == 2 and attention_mask.shape == (1, input_ids.shape[1])
              and bool(attention_mask.all())):
            attention_mask = attention_mask.expand_as(input_ids)  # one row of ones: stock broadcasts it
        elif attention_mask.dim() == 2 and attention_mask.shape != input_ids.shape:
            # with no cache of the caller's the prompt starts at column 0: one mask entry per prompt token
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not match input_ids of "
                             f"shape {tuple(input_ids.shape)}; pass one mask entry per prompt token")
        elif attention_mask.shape != input_ids.shape:
            attention_mask = None  # a mask of the caller's making (4D); the model applies it
        new_tokens = _check_length(input_ids, attention_mask, kwargs, config, pool, model)
        if attention_mask is None:
            input_ids = None
    else:
        input_ids = attention_mask = None
    by_row = peft_adapters_by_row(model, kwargs) is not None if by_row is None else by_row
    plain = not _skips_prefix_cache(pool, model, kwargs, config, rope_by_length, embeds_token_types, by_row,
                                    attention_mask)
    # room for the new tokens next to each row's prompt pages keeps a row in consecutive slots (read in place); a
    # prompt holding an id outside the vocabulary gets no prefix hit (PagedCache checks), as stock's forward fails
    cache = PagedCache(pool, input_ids, attention_mask, prefix_cache=plain, reserve_new_tokens=new_tokens, model=model,
                       _held_columns=held_columns)
    try:
        # attention weights come from the model's own attention: run it over K/V gathered from the pool, as an
        # unpatched model does (paged attention returns no weights)
        cache.stock_attention = bool(_get(kwargs, config, "output_attentions"))
        cache.verifies_candidates = _candidate_decoding(kwargs, config)
    except BaseException:  # (a Ctrl-C: the caller may keep the error, and with its traceback this cache)
        cache.release()
        raise
    cache.rows_as_fed = by_row
    cache.made_by_generate = True
    return cache


def _skips_prefix_cache(pool: PagePool, model, kwargs: dict, config, rope_by_length: bool,
                        embeds_token_types: bool = True, by_row: bool | None = None,
                        mask: torch.Tensor | None = None) -> bool:
    """Whether a ``generate()`` call can neither build on cached prefixes nor leave its own for later calls. A
    cache of the caller's that the prefix cache pre-filled starts empty in such a call. ``by_row``: the call's
    :func:`peft_adapters_by_row` found something, where the caller knows already. ``mask``: the call's attention
    mask [B, L] as ``generate()`` takes it (the one passed, else the one it implies), where the caller knows it."""
    # Candidate generation (prompt lookup, assistant models) crops and re-verifies tokens; outputs of every
    # prompt position (hidden states, attentions) need the whole prompt computed.
    candidates = _candidate_decoding(kwargs, config)
    # The prefix cache keys K/V by token ids alone: K/V computed from embeddings or at positions of the caller's
    # choosing would be handed to a later prompt of the same ids, so such calls neither read nor fill it.
    # Token types (GPT-2 embeds them, type 0 included) likewise; in models that only mask with them (Gemma 3,
    # Qwen2.5-VL processors send zeros with plain text) zeros are plain text.
    custom_inputs = kwargs.get("inputs_embeds") is not None or _positions_of_ones_own(kwargs, mask) or (
        embeds_token_types and any(kwargs.get(name) is not None for name in _TOKEN_TYPES))
    # peft's per-call adapter_names choose each row's LoRA adapter, and an activated LoRA adapts the tokens after
    # the last invocation sequence of each call's prompt: K/V the prefix cache, keyed by token ids, does not see
    adapters = peft_adapters_by_row(model, kwargs) is not None if by_row is None else by_row
    # K/V computed under autocast are rounded to its dtype; with a RoPE whose frequencies depend on the longest
    # position of the forward (dynamic NTK, longrope), a cached prefix was rotated for a shorter forward than the
    # one stock runs over the whole prompt
    autocast = autocast_on(pool)
    # K/V computed under dropout (a model in training mode) are no prefix for another call, nor is an eval-mode
    # prefix what a training-mode forward computes
    state = model.__dict__.get(_STATE_ATTR)  # (its lists are this call's: _sync_modules made them)
    watched = state.watched if state is not None else watched_modules(model)
    dropout = dropout_active(watched.dropout) or checkpointing_drops_cache(watched.checkpointing)
    # a decoding loop of the caller's (custom_generate) may feed the whole prompt to the cache it is handed, which
    # on stock is always empty
    custom_loop = kwargs.get("custom_generate") is not None
    # images, audio, video (or their features) enter through placeholder ids the prefix cache cannot tell apart
    custom_inputs = custom_inputs or bool(_other_inputs(kwargs)) or bidirectional_config(model.config)
    return bool(candidates or custom_inputs or adapters or autocast or rope_by_length or dropout or custom_loop
                or _prefill_from_first_column(kwargs, config)
                or _get(kwargs, config, "output_hidden_states") or _get(kwargs, config, "output_attentions"))


def _positions_of_ones_own(kwargs: dict, mask: torch.Tensor | None = None) -> bool:
    """Whether ``generate(position_ids=...)`` passes other positions than those ``generate()`` computes from the
    attention mask (``mask``, else the one passed: its running sum less one, at the columns it leaves unmasked): K/V
    at such positions are no prefix of a later prompt of the same ids. An assistant model's drafts are passed the
    target's positions, which are those; without a mask, or in another shape (M-RoPE's), they count as the
    caller's own."""
    positions = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask") if mask is None else mask
    if positions is None:
        return False
    if (not isinstance(positions, torch.Tensor) or not isinstance(mask, torch.Tensor) or positions.dim() != 2
            or mask.shape != positions.shape):
        return True
    real = mask.to(positions.device) != 0
    return not torch.equal(positions[real], (real.long().cumsum(-1) - 1)[real])


def _prefill_from_first_column(kwargs: dict, config) -> bool:
    """``generate(prefill_chunk_size=...)`` on a transformers release whose chunked prefill feeds the prompt from
    its first column whatever the cache holds (5.17 does; 5.24 starts after the cached tokens): K/V pre-filled from
    the prefix cache would be stored a second time after themselves."""
    return _get(kwargs, config, "prefill_chunk_size") is not None and not _chunked_prefill_resumes()


@functools.cache
def _chunked_prefill_resumes() -> bool:
    """Whether ``generate()``'s chunked prefill starts after the tokens its cache already holds. Read from the
    source of ``GenerationMixin._prefill`` (its chunked branch asks the cache for its length); False when it cannot
    be read."""
    from transformers.generation.utils import GenerationMixin

    try:
        source = inspect.getsource(GenerationMixin._prefill)
    except (AttributeError, OSError, TypeError):
        return False
    chunked = source.find("prefill_chunk_size")
    chunked = source.find("Chunked prefill") if "Chunked prefill" in source else chunked
    return chunked >= 0 and "get_seq_length" in source[chunked:]


def _candidate_decoding(kwargs: dict, config) -> bool:
    """Prompt lookup or assisted decoding (an assistant model, or early exit)."""
    return bool(_get(kwargs, config, "prompt_lookup_num_tokens") or kwargs.get("assistant_model") is not None
                or _get(kwargs, config, "assistant_early_exit"))


def _get(kwargs: dict, config, name: str):
    return kwargs[name] if name in kwargs else getattr(config, name, None)


def _mask_with_holes(args: tuple, kwargs: dict, config) -> torch.Tensor | None:
    """A call's attention mask [B, T] when it has a zero after a one in some row (a hole no paged cache can hold),
    else None: the mask passed (right padding, or the ``input_ids != pad_token_id`` mask transformers hands an
    assistant model's and early exit's drafts), or, without one, the mask ``generate()`` builds
    (:func:`_implied_mask`), which masks a pad token after a row's first token."""
    mask, input_ids, embeds = kwargs.get("attention_mask"), _call_input_ids(args, kwargs), kwargs.get("inputs_embeds")
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point():
        shape = input_ids.shape
        if mask is None:
            mask = _implied_mask(input_ids, kwargs, config)
    elif isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        shape = embeds.shape[:2]
    else:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != shape:
        return None  # (no mask with embeddings; a mask of another shape is refused, naming it)
    try:
        left_padding(mask)
    except ValueError:
        return mask
    return None


def _holes_in_mask_on_every_rank(pool: PagePool, args: tuple, kwargs: dict, config) -> bool:
    """Whether the call's mask has holes (:func:`_mask_with_holes`), agreed by the ranks of a tensor-parallel pool
    (one all-reduce): every rank runs the call stock or none does.

    Raises:
        ValueError: on every rank, when some ranks' masks have holes and others' not (naming a rank's rows).
    """
    mask = _mask_with_holes(args, kwargs, config)
    holes = mask is not None
    if pool.ranks is None:
        return holes
    some, not_all = pool.ranks.max([int(holes), int(not holes)])
    failed = None
    if some and not_all and holes:
        try:
            left_padding(mask)
        except ValueError as e:
            failed = e
    if some and not_all:
        try:
            agree(pool.ranks, failed)
        finally:
            failed = None  # (held by the traceback's frame, it would make a cycle)
    return holes


def _implied_mask(input_ids: torch.Tensor, kwargs: dict, config) -> torch.Tensor:
    """The attention mask ``generate()`` builds for ``input_ids`` when none is passed: every pad token masked when
    the pad token occurs in the prompt and is not an end-of-sequence token, else all ones. (A pad token that
    starts a prompt, such as a beginning-of-sequence token used as pad, is left padding to ``generate()``.)"""
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    ones = torch.ones_like(input_ids)
    if pad is None:
        return ones
    pads = torch.as_tensor(pad, device=input_ids.device).reshape(-1)
    eos_ids = torch.as_tensor(eos).reshape(-1).tolist() if eos is not None else []
    padded = torch.isin(input_ids, pads)
    if any(p in eos_ids for p in pads.tolist()) or not padded.any():
        return ones
    return (~padded).to(input_ids.dtype)


def _check_rows_have_tokens(implied_mask: torch.Tensor, kwargs: dict, config) -> None:
    """Refuse a prompt with a row of nothing but pad tokens and no mask passed: the mask ``generate()`` builds
    masks every one of them (stock then attends over no key: NaN logits), as an all-zero mask row passed is refused.

    Raises:
        ValueError: naming the rows and the pad token.
    """
    empty = empty_rows(implied_mask)
    if empty:
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        raise ValueError(
            f"input_ids rows {empty} hold only the pad token (pad_token_id={pad}); with no attention_mask passed, "
            "generate() masks every pad token, which leaves those rows no tokens. Every row needs one: drop those "
            "rows, or pass an attention_mask"
        )


def _check_callers_cache(cache: PagedCache, args: tuple, kwargs: dict, config) -> None:
    """generate() with a PagedCache of the caller's gets the check a call without one gets: a mask (or the one
    generate() implies from pad tokens) with zeros after ones cannot be expressed by a paged cache. The cache is
    made to fit the prompt (:meth:`PagedCache.fit_to`).

    Raises:
        ValueError: from :func:`~astrai_hf.cache.left_padding` or a mask row of zeros, naming the rows; a mask of
            another row count than the prompt; from :meth:`PagedCache.fit_to`.
    """
    input_ids = _call_input_ids(args, kwargs)
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point()):
        return
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = _implied_mask(input_ids, kwargs, config)
        _check_rows_have_tokens(mask, kwargs, config)
    broadcast = mask.dim() == 2 and mask.shape[0] == 1 and bool(mask.all())  # one row of ones: stock broadcasts it
    if mask.dim() == 2 and mask.shape[0] != input_ids.shape[0] and not broadcast:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} has {mask.shape[0]} rows for input_ids of "
                         f"shape {tuple(input_ids.shape)}; pass one mask row per prompt row")
    if mask.dim() == 2 and mask.shape[0] == input_ids.shape[0]:
        check_rows_have_tokens(mask)  # (a mask covering the whole sequence, the ids the new tokens only, too)
    if mask.dim() == 2 and mask.shape == input_ids.shape:
        left_padding(mask)
    cache.fit_to(input_ids, mask if mask.dim() == 2 else None)


def _room_for(pool: PagePool, model, tokens: int, rows: int) -> str:
    """How to give ``rows`` rows of ``tokens`` tokens room: the call for a pool of ``max_seq_len=tokens`` and at
    least ``rows * tokens`` slots (a row's pages are its own, beyond a shared prompt), as patch() with the settings
    it was given where it built ``pool``, else as PagePool.from_model."""
    state = model.__dict__.get(_STATE_ATTR) if model is not None else None
    own = state is not None and state.pool is pool and state.own_pool_kwargs is not None
    sizing = dict(state.own_pool_kwargs) if own else {}
    capacity = pool.allocator.num_usable * pool.page_size
    needed = rows * -(-tokens // pool.page_size) * pool.page_size
    more = ""
    if capacity < needed:
        if "memory_fraction" in sizing:
            more = f" and a larger memory_fraction (the pool holds {capacity} tokens; {rows} rows need {needed})"
        else:
            sizing["max_tokens"] = needed
    sizing["max_seq_len"] = tokens
    if own:  # (patch() again takes its defaults for what is not given)
        sizing.update({"pack_prefill": False} if not state.pack_prefill else {})
        sizing.update({"prefill_chunk_tokens": state.prefill_chunk_tokens}
                      if state.prefill_chunk_tokens is not None else {})
        sizing.update({"cuda_graphs": state.graphs_given} if state.graphs_given is not None else {})
    settings = ", ".join(f"{k}={_as_source(v)}" for k, v in sizing.items())
    if own:
        return f"give the pool patch() builds room for them: patch(model, {settings}){more}"
    return (f"build the pool again with room for them: PagePool.from_model(model, {settings}), with its other "
            f"settings as they were{more}")


def _as_source(value) -> str:
    """``value`` as it is written in a call (a device as its name: its repr is not source)."""
    if isinstance(value, torch.device):
        return repr(str(value))
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_as_source(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def _check_length(input_ids, attention_mask, kwargs, config, pool: PagePool, model=None) -> int:
    """Raise ValueError when the prompt plus the new tokens overflow ``pool.max_seq_len``, and CacheFullError when
    the longest prompt alone is longer than the whole pool; returns the number of new tokens ``generate()`` may
    produce. With neither ``max_new_tokens`` nor ``max_length`` given, as
    ``generate()`` does: 20 new tokens after the padded prompt, capped at the model's ``max_position_embeddings``."""
    pads = left_padding(attention_mask) if attention_mask is not None else [0] * input_ids.shape[0]
    prompt_len = input_ids.shape[1] - min(pads)
    max_new = kwargs.get("max_new_tokens", config.max_new_tokens)
    max_length = kwargs.get("max_length", config.max_length)
    for name, value in (("max_new_tokens", max_new), ("max_length", max_length)):
        if value is not None and not isinstance(value, (numbers.Real, torch.Tensor)):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if max_new is not None:
        total = prompt_len + max_new
        setting = f"max_new_tokens={max_new}"  # named in the error: the setting that set the length
    else:
        setting = f"max_length={max_length}" if max_length is not None else "max_new_tokens (default 20)"
        if max_length is None:  # neither given: generate() falls back to its default (20)
            from transformers import GenerationConfig

            defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
            max_length = (defaults.get("max_length") or 20) + input_ids.shape[1]
            limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            if isinstance(limit, int):
                max_length = min(max_length, limit)
        total = max_length - min(pads)
    if total > pool.max_seq_len:
        rows = input_ids.shape[0] * max(_get(kwargs, config, "num_beams") or 1,
                                        _get(kwargs, config, "num_return_sequences") or 1)
        raise ValueError(
            f"prompt ({prompt_len} tokens) plus new tokens reaches {total} tokens, more than the pool's "
            f"max_seq_len={pool.max_seq_len}; {_room_for(pool, model, int(total), rows)}, or lower {setting}"
        )
    capacity = pool.allocator.num_usable * pool.page_size
    if prompt_len > capacity:  # certain to fail: refused before any forward
        evictable = pool.prefix_cache.num_evictable if pool.prefix_cache is not None else 0
        raise CacheFullError(-(-prompt_len // pool.page_size), pool.allocator.num_free, evictable,
                             detail=f"a prompt of {prompt_len} tokens is longer than the whole pool ({capacity} tokens)")
    return max(0, int(total) - prompt_len)
