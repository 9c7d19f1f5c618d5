"""A CPU stand-in for CUDA's graph API whose replay runs no Python: capture records every aten op the forward
dispatches, with the very tensors it read and wrote, and a replay runs those ops again on those tensors, writing
each result into the tensor the capture produced. As with a real CUDA graph, anything the forward decided in Python
during the capture (a hook that ran, a branch taken, a parameter looked up on a module) is fixed until the graph is
captured again, and a tensor replaced after the capture (a parameter assigned anew) is not read by a replay.

``install(monkeypatch)`` swaps ``torch.cuda.CUDAGraph``, ``graph``, ``Stream``, ``stream``, ``current_stream``,
``set_stream`` and ``graph_pool_handle`` (and ``is_current_stream_capturing``, which transformers asks before a host read) for the
stand-ins and returns the list of graphs captured.
"""

from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# ops that read a tensor's value back to the host: a real capture fails on them
_HOST_READS = ("_local_scalar_dense", "equal", "nonzero", "is_nonzero", "item")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _alias(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _write_into(recorded, fresh) -> None:
    """Copy a replayed op's result into the tensors its capture produced (views and in-place results alias those
    already: nothing to copy)."""
    if isinstance(recorded, torch.Tensor):
        if recorded is fresh or recorded.untyped_storage().data_ptr() == fresh.untyped_storage().data_ptr():
            return
        recorded.copy_(fresh)
    elif isinstance(recorded, (list, tuple)):
        for r, f in zip(recorded, fresh):
            _write_into(r, f)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in _HOST_READS:
            raise RuntimeError(f"{func} reads a tensor back to the host during a graph capture")
        out = func(*args, **kwargs)
        # each tensor read as the storage it has now (a graph holds addresses: a parameter given new data after
        # the capture, `param.data = ...`, is not read by a replay)
        args, kwargs = tree_map(_alias, (args, kwargs))
        self.ops.append((func, args, kwargs, out))
        return out


class CUDAGraph:
    """A captured forward as the list of its aten ops."""

    def __init__(self):
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            _write_into(out, func(*args, **kwargs))
        self.replays += 1

    def reads(self, tensor: torch.Tensor) -> bool:
        """Whether some op of the graph reads ``tensor``'s storage."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == ptr for _, args, kwargs, _ in self.ops
                   for t in _tensors(list(args) + list(kwargs.values())))


class Stream:
    def __init__(self, device=None):
        self.device = device if device is not None else current_device[0]

    def wait_stream(self, other) -> None:
        pass


current_device = ["cuda:0"]  # the device a Stream() is made on (set by a test)


def install(monkeypatch) -> list[CUDAGraph]:
    captured: list[CUDAGraph] = []
    capturing = []
    current = [Stream()]  # the current stream
    capture_stream = Stream()  # (torch's default capture stream: one per process)

    class stream:  # noqa: N801 (torch.cuda.stream): the stream given is current within the block
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.before, current[0] = current[0], self.s

        def __exit__(self, *exc):
            current[0] = self.before

    class graph:  # noqa: N801 (torch.cuda.graph)
        """As torch's: the capture runs on a stream of its own; when the body raised, ending the capture raises
        too (CUDA invalidated it) and the stream current before it is not set again."""

        def __init__(self, g, pool=None, stream=None, capture_error_mode="global"):
            assert pool is not None and not gc.isenabled(), "capture into the shared pool, garbage collection off"
            self.g = g
            g.stream, g.capture_error_mode = stream, capture_error_mode
            self.stream = stream if stream is not None else capture_stream

        def __enter__(self):
            self.before, current[0] = current[0], self.stream
            capturing.append(self.g)
            self.recorder = _Recorder(self.g.ops)
            self.recorder.__enter__()

        def __exit__(self, *exc):
            self.recorder.__exit__(*exc)
            capturing.pop()
            if exc[0] is not None:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            current[0] = self.before
            captured.append(self.g)

    def set_stream(s) -> None:
        current[0] = s

    for name, value in dict(Stream=Stream, current_stream=lambda: current[0], stream=stream, set_stream=set_stream,
                            graph_pool_handle=object, CUDAGraph=CUDAGraph, graph=graph,
                            is_current_stream_capturing=lambda: bool(capturing)).items():
        monkeypatch.setattr(torch.cuda, name, value)
    return captured


def install_capturing(monkeypatch) -> list[CUDAGraph]:
    """:func:`install`, with every ``DecodeGraphRunner`` made from now on capturing through the stand-in (as on
    CUDA) instead of running its eager stand-in; returns the list of graphs captured."""
    from astrai_hf import graphs

    made = install(monkeypatch)
    init = graphs.DecodeGraphRunner.__init__

    def init_capturing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_cuda_graphs = True

    monkeypatch.setattr(graphs.DecodeGraphRunner, "__init__", init_capturing)
    return made
