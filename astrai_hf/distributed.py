"""Tensor parallelism through transformers' own engine: which KV heads a rank holds, and ranks that agree.

Under ``from_pretrained(..., tp_plan="auto")`` (launched with ``torchrun``) every rank runs the same ``generate()``
on the same inputs. The attention projections are DTensors sharded over a device mesh, and an attention module sees
only its rank's heads: with a column-wise ``k_proj`` a Llama of 2 KV heads gives each of 2 ranks 1 KV head, while
``config.num_key_value_heads`` still says 2. Each rank's pool therefore stores its local heads only.

Page allocation and prefix-cache decisions depend only on the inputs and on the pool's history, so page tables
agree on every rank without communication. What must not happen is one rank raising (pool full, bad input) while
the others go on into the model's next collective and wait forever. :class:`RankGroup` makes the ranks agree at
the few points where astrai-hf can fail or where ranks could drift apart: sizing a pool by free memory, binding a
model (same pool geometry), loading a prefix cache file, the start of a patched ``generate()`` and the planning of
each forward step. Each is one small all-reduce; only a failure adds a broadcast of the failing rank's message.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist

from .errors import CacheFullError

logger = logging.getLogger(__name__)

# names of the projection whose output holds the keys, plain or fused with queries and values
_KEY_PROJECTIONS = ("k_proj", "key", "qkv_proj", "query_key_value", "c_attn", "Wqkv")

_OK, _VALUE_ERROR, _TYPE_ERROR, _FULL_PAGES, _FULL_ROWS, _OTHER = range(6)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


class RankGroup:
    """The tensor-parallel ranks of one model: they hold different heads of the same sequences, so their pools
    must take the same decisions and fail together.

    Every collective here is issued by all ranks at the same point of the same program (SPMD, as transformers'
    tensor parallelism requires anyway). Flags travel as CPU tensors when the group's backend has gloo, so the
    all-reduce does not wait on the GPU stream; on an NCCL-only group they go through a tensor on ``device`` and
    reading the result synchronises with the GPU, once per planned step.

    Args:
        group: a ``torch.distributed`` process group (the tensor-parallel group of the model's device mesh).
        device: where an NCCL-only group can reduce a tensor (the local device of the model's shards).
    """

    def __init__(self, group, device: torch.device | str = "cpu"):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        backend = str(dist.get_backend(group))
        self.device = torch.device("cpu") if "gloo" in backend else torch.device(device)

    def _reduce(self, values: list[int], op) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks."""
        return self._reduce(values, dist.ReduceOp.MIN)

    def max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over the ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed; return on every rank if none did.

        Args:
            error: what this rank raised at this point, or None.

        Raises:
            this rank's own ``error`` if it failed; otherwise, when another rank failed, an error of the same
            type (``CacheFullError`` with that rank's numbers, ``ValueError``, ``TypeError``, else
            ``RuntimeError``) naming the rank and carrying its message. When several ranks failed, one of them is
            reported, and a ``CacheFullError``'s numbers are the largest over the failing ranks.
        """
        code, needed, free, evictable = _encode(error)
        code, needed, free, evictable, rank = self.max([code, needed, free, evictable, self.rank if code else -1])
        if code == _OK:
            return
        # only on failure: the failing rank's message, for the ranks that have none of their own
        message = [str(error) if self.rank == rank else None]
        dist.broadcast_object_list(message, src=dist.get_global_rank(self.group, rank), group=self.group,
                                   device=self.device)
        if error is not None:
            try:
                raise error
            finally:
                error = None  # (the traceback holds this frame: no cycle through it keeps the error's frames alive)
        where = f"tensor-parallel rank {rank} of {self.size}"
        if code in (_FULL_PAGES, _FULL_ROWS):
            raise CacheFullError(
                needed, free, evictable, unit="pages" if code == _FULL_PAGES else "request rows",
                detail=f"raised on {where}: {message[0]}", hint=False,  # the rank's message gives the hint
            )
        kind = {_VALUE_ERROR: ValueError, _TYPE_ERROR: TypeError}.get(code, RuntimeError)
        raise kind(f"{where} raised {kind.__name__}: {message[0]}")

    def check_equal(self, what: str, values: dict[str, int], hint: str) -> None:
        """Raise ``ValueError`` on every rank, naming each value that differs and ending with ``hint``, unless
        ``values`` are the same on all ranks. One all-reduce (the maximum of each value and of its negation)."""
        names = list(values)
        local = [int(values[n]) for n in names]
        reduced = self.max(local + [-v for v in local])
        high, low = reduced[: len(names)], [-v for v in reduced[len(names) :]]
        differ = [f"{n} from {lo} to {hi}" for n, lo, hi in zip(names, low, high) if lo != hi]
        if differ:
            raise ValueError(f"{what} differs between the tensor-parallel ranks ({', '.join(differ)}); {hint}")


def agree(ranks: RankGroup | None, error: BaseException | None) -> None:
    """Re-raise ``error`` without tensor parallelism; with it, :meth:`RankGroup.agree` (a collective)."""
    try:
        if ranks is not None:
            ranks.agree(error)
        elif error is not None:
            raise error
    finally:
        error = None  # (the traceback holds this frame: no cycle through it keeps the error's frames alive)


def _encode(error: BaseException | None) -> tuple[int, int, int, int]:
    if error is None:
        return _OK, 0, 0, 0
    if isinstance(error, CacheFullError):
        code = _FULL_ROWS if error.unit == "request rows" else _FULL_PAGES
        return code, error.needed, error.free, error.evictable
    if isinstance(error, ValueError):
        return _VALUE_ERROR, 0, 0, 0
    if isinstance(error, TypeError):
        return _TYPE_ERROR, 0, 0, 0
    return _OTHER, 0, 0, 0


def rank_group(attention_modules: list[torch.nn.Module]) -> RankGroup | None:
    """The tensor-parallel group of a model, read from its attention modules' DTensor parameters; None when the
    model is not tensor-parallel (no DTensor sharded over more than one rank, or ``torch.distributed`` is not
    initialised)."""
    DTensor = _dtensor_type()
    if DTensor is None or not dist.is_available() or not dist.is_initialized():
        return None
    for module in attention_modules:
        for p in module.parameters():
            if not isinstance(p, DTensor):
                continue
            mesh = p.device_mesh
            for dim, placement in enumerate(p.placements):
                if placement.is_shard() and mesh.size(dim) > 1:
                    return RankGroup(mesh.get_group(dim), p.to_local().device)
    return None


def kv_heads_per_rank(model: torch.nn.Module, attention_modules: list[torch.nn.Module], num_kv_heads: int) -> int:
    """KV heads one attention module of this rank produces: ``num_kv_heads`` unless a tensor-parallel plan shards
    the key projection's output, then this rank's share of them.

    The share is read from the key projection's parameter (local rows over global rows of its sharded dim), so it
    follows the plan transformers applied, fused QKV projections included. A plan that gathers the projection's
    output (e.g. ``colwise_gather_output``) leaves every head on every rank.

    Raises:
        ValueError: the heads do not split into whole heads per rank (e.g. one KV head over 2 ranks: transformers
            splits the head's channels and the model's own attention fails), or layers hold different counts.
    """
    DTensor = _dtensor_type()
    if DTensor is None:
        return num_kv_heads
    names = {id(m): name for name, m in model.named_modules()}
    counts = {_local_heads(model, attn, num_kv_heads, names, DTensor) for attn in attention_modules}
    if len(counts) > 1:
        raise ValueError(
            f"the attention layers of {type(model).__name__} hold different KV head counts {sorted(counts)}"
        )
    return counts.pop() if counts else num_kv_heads


def _local_heads(model, attn: torch.nn.Module, num_kv_heads: int, names: dict[int, str], DTensor) -> int:
    proj = next((getattr(attn, n) for n in _KEY_PROJECTIONS if isinstance(getattr(attn, n, None), torch.nn.Module)),
                None)
    weight = proj._parameters.get("weight") if proj is not None else None
    if not isinstance(weight, DTensor):
        return num_kv_heads
    name = names.get(id(proj), type(proj).__name__)
    dims = [p.dim for p in weight.placements if p.is_shard()]
    if not dims or _gathers_output(model, name):
        return num_kv_heads
    local, total = weight.to_local().shape[dims[0]], weight.shape[dims[0]]
    if (num_kv_heads * local) % total:
        raise ValueError(
            f"{type(model).__name__} has {num_kv_heads} KV head(s), which the tensor-parallel plan cannot split into "
            f"whole heads: this rank holds {local} of the {total} output channels of {name} over "
            f"{weight.device_mesh.size()} ranks (transformers' own attention fails on this too); use a "
            "tensor-parallel size that divides num_key_value_heads"
        )
    return num_kv_heads * local // total


def _gathers_output(model: torch.nn.Module, name: str) -> bool:
    """Whether the model's tensor-parallel plan gives module ``name`` a replicated (gathered) output."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    if not plan or not name:
        return False
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    style_name = next((s for key, s in plan.items() if generic == key or generic.endswith("." + key)), None)
    if style_name is None:
        return False
    try:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

        style = ALL_PARALLEL_STYLES[style_name]
    except (ImportError, KeyError):
        logger.warning("unknown tensor-parallel style %r for %s: taken to shard its output", style_name, name)
        return False
    layout = getattr(style, "output_layouts", None)
    return layout is not None and not layout.is_shard()
