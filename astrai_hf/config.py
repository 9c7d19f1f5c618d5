"""Geometry of a model's KV cache and the validated settings of a page pool."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What one token's K/V looks like in every layer.

    Attributes:
        num_layers: decoder layers that keep a KV cache.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA/MQA); under tensor parallelism,
            the heads one rank holds.
        head_dim: channels per head.
        model_type: ``config.model_type``, for error messages and fingerprints.
        kv_source: per layer, the layer whose K/V it attends over: itself, or an earlier layer of the same type for
            a layer that reuses another's K/V (KV sharing, Gemma 3n); empty when every layer keeps its own.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_type: str = ""
    kv_source: tuple[int, ...] = ()

    @property
    def stored_layers(self) -> list[int]:
        """The layers that store K/V of their own (every layer, without KV sharing)."""
        return [i for i in range(self.num_layers) if not self.kv_source or self.kv_source[i] == i]

    @classmethod
    def from_config(cls, config) -> "KVSpec":
        """Read the KV geometry from a transformers ``PretrainedConfig`` (the text decoder's, for composite models).

        Raises:
            ValueError: the config lacks the layer or head counts.
        """
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = getattr(text, "num_hidden_layers", None)
        num_heads = getattr(text, "num_attention_heads", None)
        if not num_layers or not num_heads:
            raise ValueError(
                f"cannot read num_hidden_layers / num_attention_heads from {type(config).__name__}; "
                "a decoder-only language model config is expected"
            )
        num_kv_heads = getattr(text, "num_key_value_heads", None)
        if num_kv_heads is None and getattr(text, "multi_query", False) is True and not getattr(
                text, "new_decoder_architecture", False):
            num_kv_heads = 1  # a config that predates the name: one K/V head (the original Falcon-7B layout)
        num_kv_heads = num_kv_heads or num_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        return cls(int(num_layers), int(num_kv_heads), int(head_dim), getattr(text, "model_type", "") or "",
                   kv_sharing_sources(text, int(num_layers)))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token across all layers (a layer that reuses another's K/V stores none)."""
        return 2 * len(self.stored_layers) * self.num_kv_heads * self.head_dim * _itemsize(dtype)


def kv_sharing_sources(text_config, num_layers: int) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it reuses under KV sharing (``num_kv_shared_layers``, Gemma 3n): the last
    ``num_kv_shared_layers`` layers each reuse the last earlier non-shared layer of their ``layer_types`` entry.
    Empty when the config shares nothing.

    Raises:
        ValueError: a shared layer's type has no earlier layer to reuse.
    """
    shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
    if not isinstance(shared, int) or shared <= 0:
        return ()
    types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers)
    first = num_layers - shared
    sources = list(range(num_layers))
    for i in range(first, num_layers):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(f"layer {i} reuses the K/V of a {types[i]!r} layer, but no layer before {first} is one")
        sources[i] = earlier[-1]
    return tuple(sources)


@dataclass(frozen=True, slots=True)
class PagePoolConfig:
    """Settings of a :class:`~astrai_hf.PagePool`, checked on construction.

    Attributes:
        spec: KV geometry of the model the pool serves.
        page_size: token slots per page.
        num_pages: pages in the pool, including the reserved trash page 0.
        max_seq_len: longest sequence (prompt plus generated tokens, padding excluded) one row can hold.
        max_reqs: rows of the ``req_to_token`` table, i.e. sequences alive at once across all caches.
        dtype: K/V dtype.
        layer_devices: device of each layer's K/V storage (several under ``device_map``).
    """

    spec: KVSpec
    page_size: int
    num_pages: int
    max_seq_len: int
    max_reqs: int
    dtype: torch.dtype
    layer_devices: tuple[torch.device, ...]

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_seq_len", "max_reqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one reserved trash page plus one usable), got {self.num_pages}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.max_reqs < 1:
            raise ValueError(f"max_reqs must be >= 1, got {self.max_reqs}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        if len(self.layer_devices) != self.spec.num_layers:
            raise ValueError(
                f"layer_devices has {len(self.layer_devices)} entries, expected one per layer ({self.spec.num_layers})"
            )

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.spec.bytes_per_token(self.dtype)

    @property
    def bytes_per_page_by_device(self) -> dict[torch.device, int]:
        """Bytes of one page (K and V) on each device, summed over the layers stored there."""
        return page_bytes_by_device(self.spec, self.page_size, self.dtype, self.layer_devices)


def page_bytes_by_device(
    spec: KVSpec, page_size: int, dtype: torch.dtype, layer_devices: tuple[torch.device, ...]
) -> dict[torch.device, int]:
    """Bytes one page of ``page_size`` tokens takes on each device: K and V of every layer whose storage lives there.

    Args:
        spec: KV geometry (heads as stored on this rank).
        page_size: token slots per page.
        dtype: K/V dtype.
        layer_devices: device of each layer's storage.
    """
    per_layer = 2 * page_size * spec.num_kv_heads * spec.head_dim * _itemsize(dtype)
    out: dict[torch.device, int] = {}
    for i in spec.stored_layers:
        out[layer_devices[i]] = out.get(layer_devices[i], 0) + per_layer
    return out


def as_int(name: str, value) -> int:
    """``value`` as a plain int: Python ints and integer scalars of numpy or torch (anything with ``__index__``)
    pass; bools, floats and other types raise ``TypeError`` naming ``name`` and the value."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} (bool)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def as_flag(name: str, value) -> bool:
    """``value`` as a bool: Python and numpy bools pass; anything else (a string like ``"no"`` is truthy) raises
    ``TypeError`` naming ``name`` and the value."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)  # numpy 2 names its scalar bool type `bool`, numpy 1 `bool_`
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def as_count(name: str, value, minimum: int) -> int:
    """``value`` as a plain int of at least ``minimum`` (integer scalars of numpy / torch accepted).

    Raises:
        ValueError: naming ``name`` and the value, for anything else.
    """
    try:
        n = as_int(name, value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        kind = "positive" if minimum == 1 else "non-negative" if minimum == 0 else f">= {minimum}"
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_MISSING = object()


def class_attr(cls: type, name: str, default=None):
    """``getattr(cls, name, default)``, read from the dicts along ``cls``'s MRO: a lookup on the class that misses
    raises and catches an AttributeError inside (microseconds), and the walks of a model made at each call ask it
    of every module (900 of a 60-layer model). Not remembered: a class may gain or lose the attribute later."""
    for k in cls.__mro__:
        found = k.__dict__.get(name, _MISSING)
        if found is not _MISSING:
            return found
    return default


def class_defines(cls: type, name: str) -> bool:
    """``hasattr(cls, name)`` (see :func:`class_attr`)."""
    return class_attr(cls, name, _MISSING) is not _MISSING


def _collect_rope_types(value, types: set[str]) -> None:
    """Add the rope types named in ``value`` (a config's ``rope_parameters`` or ``rope_scaling``, nested per layer
    type in some) to ``types``. (A function of the module: a closure calling itself is a reference cycle.)"""
    if isinstance(value, dict):
        for key in ("rope_type", "type"):  # ("type": the name in older configs' rope_scaling)
            if isinstance(value.get(key), str):
                types.add(value[key])
        for v in value.values():
            _collect_rope_types(v, types)


def rope_depends_on_length(config) -> bool:
    """Whether the model's RoPE frequencies depend on the longest position of each forward (transformers'
    ``dynamic_rope_update``: rope types ``dynamic`` and ``longrope``). Such a model computes a prompt's K/V
    differently in one forward than in pieces, so neither prefix reuse nor chunked prefill can match stock.

    ``config`` is a model's config, or the model itself (an ``nn.Module``): then its rotary embedding modules'
    own ``rope_type`` counts too, which a module swapped in after loading (a context-extension recipe) sets while
    the config still says ``default``."""
    types: set[str] = set()
    if isinstance(config, torch.nn.Module):
        for module in config.modules():
            # (transformers' *RotaryEmbedding sets it in __init__; a dict per layer type. Read from the instance's
            # dict: a module's getattr of a missing name raises inside, and this runs per call)
            rope_type = vars(module).get("rope_type")
            for t in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
                if isinstance(t, str):
                    types.add(t)
        config = getattr(config, "config", None)

    configs = [config]
    text_config = getattr(config, "get_text_config", None)
    if callable(text_config):  # a multimodal model's language model has a config of its own (LLaVA, Gemma 3)
        try:
            configs.append(text_config(decoder=True))
        except (TypeError, ValueError):  # (a config with several text configs and no decoder among them)
            pass
    for cfg in configs:
        for name in ("rope_parameters", "rope_scaling"):
            _collect_rope_types(getattr(cfg, name, None), types)
    return any("dynamic" in t or t == "longrope" for t in types)


# id(config) -> the attention implementation a config selects outside the paged forward under way, which switched
# it to paged attention (see patch.paged_attention_on); kept off the config, which a hook may save or copy meanwhile
OWN_ATTENTION: dict[int, str] = {}


@functools.cache
def sdpa_refuses_softcap() -> bool:
    """Whether this transformers' sdpa attention raises ValueError for an attention logit softcap (from 5.24),
    rather than ignore it; found by calling it once on a one-element query."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = torch.zeros(1, 1, 1, 1)
    try:
        sdpa_attention_forward(torch.nn.Module(), q, q, q, None, softcap=1.0)
    except ValueError as e:
        return "softcap" in str(e)
    except Exception:  # (a release whose sdpa wants more of the module: it got past the softcap)
        return False
    return False


def attention_drops_softcap(config) -> bool:
    """Whether stock attention of a model of ``config`` ignores its attention logit softcap
    (``attn_logit_softcapping``): the config selects transformers' sdpa, which takes no softcap and before
    transformers 5.24 dropped the one a model passes (Gemma 2's default on those releases; later ones refuse sdpa
    there). Paged attention then drops it too, so that it computes what stock computes; the K/V of such a model
    differ from those of the same weights under eager attention, so the flag is part of the config's fingerprint."""
    if config is None or getattr(config, "attn_logit_softcapping", None) is None:
        return False
    name = OWN_ATTENTION.get(id(config)) or getattr(config, "_attn_implementation_internal", None)
    return isinstance(name, str) and name.split("|")[-1] == "sdpa"
