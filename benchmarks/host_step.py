"""Host work of a decode step replayed from a CUDA graph, measured on any machine (no GPU needed).

At small batch a replayed decode step is bound by the host: ``generate()``'s own loop plus what astrai-hf does
around the replay (planning the step, filling the workspace, handing back the logits). This script measures that
host work with the graph's replay made free: CUDA's graph API is replaced by a stand-in whose capture runs the
forward once and whose replay does nothing, so every step costs only its host work. Beside it, stock
``generate()`` with a forward that returns fixed logits at once gives ``generate()``'s own loop.

Two measures, per batch size:

- microseconds per step (the fastest of several calls of 400 new tokens, one CPU thread): patched with a free
  replay, and stock with a free forward; their difference is astrai-hf's host time per step;
- aten operations dispatched per step outside the model (counted with a ``TorchDispatchMode``), and among them the
  ones that launch device work (copies and kernels: everything but views and tensor creation on the host). On a
  GPU each of those is a launch the host pays for at every step.

Usage: ``python benchmarks/host_step.py --out DIR`` writes ``host_step.md`` and ``host_step.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import astrai_hf
from astrai_hf import graphs

# aten ops that launch nothing on a device: views, shape queries, tensors made on the host
_NO_LAUNCH = {"view", "slice", "select", "expand", "split", "split_with_sizes", "unbind", "t", "transpose",
              "lift_fresh", "alias", "detach", "unsqueeze", "squeeze", "as_strided", "_unsafe_view"}


class _FreeGraph:
    def replay(self) -> None:
        pass


class _Stream:
    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def _free_graph_api():
    """CUDA's graph API as a stand-in: a capture runs the forward once, a replay does nothing."""
    names = dict(Stream=_Stream, current_stream=_Stream, stream=lambda s: contextlib.nullcontext(),
                 set_stream=lambda s: None, graph_pool_handle=object, CUDAGraph=_FreeGraph,
                 graph=lambda g, pool=None, **kwargs: contextlib.nullcontext())
    saved = {n: getattr(torch.cuda, n) for n in names}
    init = graphs.DecodeGraphRunner.__init__

    def init_capturing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_cuda_graphs = True

    try:
        for n, v in names.items():
            setattr(torch.cuda, n, v)
        graphs.DecodeGraphRunner.__init__ = init_capturing
        yield
    finally:
        for n, v in saved.items():
            setattr(torch.cuda, n, v)
        graphs.DecodeGraphRunner.__init__ = init


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # fixed lengths
    return model


def _per_step(generate, new_tokens: int, runs: int) -> tuple[float, dict]:
    """(microseconds per step, aten ops per step) of ``generate(n)``. Time: the fastest call of ``new_tokens``
    over their number (the prompt's forward of the tiny model is under 1% of it). Ops: the difference between a
    call of ``new_tokens`` and one of half as many, so the prompt's forward cancels out."""
    half = new_tokens // 2
    generate(half)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        generate(new_tokens)
        times.append((time.perf_counter() - start) / new_tokens * 1e6)
    short, full = _CountOps(), _CountOps()
    with short:
        generate(half)
    with full:
        generate(new_tokens)
    ops = full.ops.copy()
    ops.subtract(short.ops)
    return min(times), {k: v / (new_tokens - half) for k, v in ops.items() if v}


def measure(batches=(1, 8), new_tokens: int = 400, runs: int = 7) -> dict:
    """``{batch: {...}}`` with the measures of the module docstring (microseconds, ops per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(batches, new_tokens, runs)
    finally:
        torch.set_num_threads(threads)


def _measure(batches, new_tokens: int, runs: int) -> dict:
    model = _model()
    results = {}
    for batch in batches:
        ids = torch.randint(3, 96, (batch, 20), generator=torch.Generator().manual_seed(batch))

        def generate(n):
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        with _free_graph_api():
            astrai_hf.patch(model, max_tokens=batch * 512, page_size=16, cuda_graphs=True, prefix_cache=False)
            try:
                patched_us, patched_ops = _per_step(generate, new_tokens, runs)
            finally:
                astrai_hf.unpatch(model)
        logits = torch.zeros(batch, 1, model.config.vocab_size)
        field = astrai_hf.cache_kwarg(model)  # the output's field is named as generate()'s keyword ("cache" from 5.24)

        @functools.wraps(model.forward)  # (generate() reads the forward's signature)
        def free_forward(*args, **kwargs):
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            return CausalLMOutputWithPast(logits=logits.clone(), **{field: cache})

        model.forward = free_forward
        try:
            stock_us, stock_ops = _per_step(generate, new_tokens, runs)
        finally:
            del model.forward
        own = collections.Counter(patched_ops)
        own.subtract(stock_ops)
        own = {k: v for k, v in sorted(own.items()) if v}
        results[batch] = {
            "patched_us": patched_us, "generate_loop_us": stock_us, "astrai_host_us": patched_us - stock_us,
            "astrai_ops": sum(own.values()),
            "astrai_device_ops": sum(v for k, v in own.items() if k not in _NO_LAUNCH),
            "astrai_ops_by_name": own,
        }
    return results


def table(results: dict) -> str:
    lines = ["| batch | patched, free replay (us/step) | generate() loop (us/step) | astrai-hf host (us/step) "
             "| astrai-hf aten ops/step | of which copies and kernels | ops |",
             "|---|---|---|---|---|---|---|"]
    for batch, r in results.items():
        names = ", ".join(f"{k} {v:g}" for k, v in r["astrai_ops_by_name"].items())
        lines.append(f"| {batch} | {r['patched_us']:.0f} | {r['generate_loop_us']:.0f} | {r['astrai_host_us']:.0f} "
                     f"| {r['astrai_ops']:g} | {r['astrai_device_ops']:g} | {names} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    results = measure(tuple(int(b) for b in args.batches.split(",")), runs=args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_step.json").write_text(json.dumps(results, indent=2))
    (args.out / "host_step.md").write_text(f"# Host work per replayed decode step\n\n{table(results)}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
