"""The ``astrai-hf`` command: ``demo``, ``generate`` and ``bench`` on the embedded model or any ``--model``, and
``run``, which runs a script of yours with every ``generate()`` patched."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DEMO_TURNS = [
    "What is the capital of France?",
    "Name one famous museum there.",
    "In one sentence, why do people visit it?",
]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="astrai-hf",
        description="astrai-hf: paged KV cache, prefix cache and paged attention behind transformers generate(). "
                    "Commands: demo, generate, run, bench.")
    model_help = "HF model id, local folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    parser.add_argument("--model", default=None, help=model_help)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"astrai-hf {__version__}")
    # --model is accepted after the subcommand too: `astrai-hf bench --model PATH`
    with_model = argparse.ArgumentParser(add_help=False)
    with_model.add_argument("--model", default=argparse.SUPPRESS, help=model_help)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[with_model],
                          help="multi-turn chat through the patched generate(), then a side-by-side table")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=48, help="new tokens per turn (default 48)")
    gen = sub.add_parser("generate", parents=[with_model], help="answer one prompt (chat template), streamed")
    gen.add_argument("prompt", help="the user message, put into the model's chat template")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="most new tokens (default 128)")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    # --model is parsed for run too, to say that it does not apply (not to take the model id for the script)
    run_model = argparse.ArgumentParser(add_help=False)  # not listed in run's help: it only says it does not apply
    run_model.add_argument("--model", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    run = sub.add_parser("run", parents=[run_model],
                         help="run an unmodified Python script with every generate() patched (zero-code)")
    run.add_argument("--max-tokens", type=_positive_int, default=None, help="token capacity of each model's pool")
    run.add_argument("--page-size", type=_positive_int, default=None, help="tokens per page")
    run.add_argument("--max-reqs", type=_positive_int, default=None,
                     help="sequences alive at once in each model's pool: rows x samples or beams (default 128)")
    run.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    run.add_argument("--report", action="store_true",
                     help="print the pool statistics of each patched model still alive when the script ends")
    run.add_argument("--quiet", action="store_true", help="do not print a line to stderr when a model is patched")
    run.add_argument("script", help="the script, run as __main__")
    # (optional: a missing script is reported alone, not with it)
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments").required = False
    bench = sub.add_parser("bench", parents=[with_model], help="benchmarks side by side: decode tok/s and KV bytes, prefix cache, packed prefill "
                           "(about 13 minutes on 2 CPU cores for all three)")
    bench.add_argument("--out", type=Path, default=None, help="folder for the markdown tables and JSON")
    bench.add_argument("--plot", type=Path, default=None, help="also draw the results side by side into this PNG")
    bench.add_argument("--suite", choices=["decode", "prefix", "prefill", "all"], default="all",
                       help="decode: tok/s and KV bytes by cache; prefix: time to first token, chat and n samples "
                            "with the prefix cache; prefill: a mixed-length batch end to end, packed vs padded "
                            "(default: all three)")
    bench.add_argument("--repeats", type=_positive_int, default=3,
                       help="repeats of the prefill suite, whose table gives medians and paired ratios (default 3)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own parser, whose usage lists the options it takes
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "run":
        args.args = _script_args(sys.argv[1:] if argv is None else argv, args.script, args.args)
        if args.model is not None:
            print("astrai-hf: --model does not apply to run: the script loads its own models", file=sys.stderr)
            return 2
        return _run_script(args)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from .models import load_model

    if args.command == "bench":  # a bad path fails now, in one line, not after the suites ran
        if args.plot is not None and args.plot.is_dir():
            print(f"astrai-hf: --plot {args.plot} is a folder; name the PNG file", file=sys.stderr)
            return 2
        if args.plot is not None:
            from .plots import check_plot_path

            try:
                check_plot_path(args.plot)
            except (ImportError, ValueError) as e:
                print(f"astrai-hf: --plot: {e}", file=sys.stderr)
                return 2
        for option, folder in (("--plot", None if args.plot is None else args.plot.parent), ("--out", args.out)):
            try:
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                print(f"astrai-hf: {option}: cannot make the folder {folder}: {e.strerror or e}", file=sys.stderr)
                return 2
    try:
        model, tokenizer = load_model(args.model)
    except (OSError, ValueError, ModuleNotFoundError) as e:  # not there, not a causal LM, no gguf: one line
        print(f"astrai-hf: cannot load the model: {_first_line(e)}", file=sys.stderr)
        return 2
    try:
        if args.command == "demo":
            return _demo(model, tokenizer, args.max_new_tokens)
        if args.command == "generate":
            return _generate(model, tokenizer, args.prompt, args.max_new_tokens, args.sample)
    except (NotImplementedError, ValueError) as e:  # a model astrai-hf cannot patch, a prompt the model cannot take
        print(f"astrai-hf: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return _bench(model, tokenizer, args.out, args.suite, args.plot, args.repeats)


def _first_line(error: Exception) -> str:
    """An error's first line (transformers lists every model class it knows after it)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:  # "... from one of:" says nothing without what follows
        first = f"{first} {lines[1]}"
    return first


def _run_script(args) -> int:
    import os
    from unittest import mock

    import astrai_hf.patches.autopatch as autopatch

    script = Path(args.script)
    if not script.exists():
        print(f"astrai-hf run: no such script: {args.script}", file=sys.stderr)
        return 2
    if script.is_dir() and not (script / "__main__.py").is_file():
        print(f"astrai-hf run: {args.script} is a folder without a __main__.py", file=sys.stderr)
        return 2
    env = {"ASTRAI_HF_MAX_TOKENS": args.max_tokens, "ASTRAI_HF_PAGE_SIZE": args.page_size,
           "ASTRAI_HF_MAX_REQS": args.max_reqs, "ASTRAI_HF_PREFIX_CACHE": "0" if args.no_prefix_cache else None}
    saved_level, handler = autopatch.logger.level, None
    # (a caller of main() in Python keeps its process: its environment and logging as they were, on every way out)
    with mock.patch.dict(os.environ, {k: str(v) for k, v in env.items() if v is not None}):
        try:
            if not args.quiet:  # one line per patched model, so a user sees the switch took effect
                import logging

                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter("%(message)s"))
                autopatch.logger.addHandler(handler)
                autopatch.logger.setLevel(logging.INFO)
            try:
                autopatch.install()
            except (ValueError, TypeError) as e:  # an ASTRAI_HF_* variable that is not a setting
                print(f"astrai-hf run: {e}", file=sys.stderr)
                return 2
            _run_installed(script, args)
        finally:
            if handler is not None:
                autopatch.logger.removeHandler(handler)
                autopatch.logger.setLevel(saved_level)
    return 0


def _script_args(argv: list[str], script: str, parsed: list[str]) -> list[str]:
    """The script's own arguments as ``python script ...`` hands them on: argparse drops a ``--`` right after the
    script (``astrai-hf run s.py -- a`` gave ``['a']``, where ``python s.py -- a`` gives ``['--', 'a']``)."""
    for i, token in enumerate(argv):
        if token == script and argv[i + 1 : i + 2] == ["--"] and argv[i + 2 :] == parsed:
            return argv[i + 1 :]
    return parsed


def _run_installed(script: Path, args) -> None:
    """Run ``script`` as ``python script args...`` would, with ``autopatch`` installed, which is uninstalled after
    (a ``SystemExit`` of the script's passes through, its code the command's exit code)."""
    import runpy
    import zipfile

    import astrai_hf.patches.autopatch as autopatch

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.script, *args.args]
    if script.is_file() and not zipfile.is_zipfile(script):  # (runpy puts a folder or zip of __main__.py first itself)
        sys.path.insert(0, str(script.resolve().parent))  # as `python script.py`: the script imports its neighbours
    namespace = None  # the script's globals, kept for the report: a model the script holds there is still alive
    try:
        # an absolute __file__, as Python 3.9 and later give `python script.py` (runpy makes sys.argv[0] the same)
        namespace = runpy.run_path(str(script.resolve()), run_name="__main__")
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if args.report:
            import astrai_hf

            for model in autopatch.patched_models():
                if astrai_hf.is_patched(model):
                    print(f"astrai-hf: {type(model).__name__} {json.dumps(astrai_hf.get_pool(model).stats())}",
                          file=sys.stderr)
        autopatch.uninstall()
        del namespace


def _chat_inputs(tokenizer, conversations):
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _generate(model, tokenizer, prompt, max_new_tokens, sample) -> int:
    from transformers import TextStreamer

    import astrai_hf

    astrai_hf.patch(model)
    inputs = _chat_inputs(tokenizer, [[{"role": "user", "content": prompt}]])
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=sample, streamer=streamer)
    return 0


def _demo(model, tokenizer, max_new_tokens) -> int:
    import astrai_hf

    from .bench import kv_bytes

    pool = astrai_hf.PagePool.from_model(model, max_tokens=8192, page_size=16)
    astrai_hf.patch(model, pool=pool)
    print(f"astrai-hf demo: {model.config.model_type}, {pool}\n")
    conversation, transcript = [], []
    for i, turn in enumerate(DEMO_TURNS, 1):
        conversation.append({"role": "user", "content": turn})
        inputs = _chat_inputs(tokenizer, [conversation])
        before = pool.stats()
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        conversation.append({"role": "assistant", "content": answer})
        transcript.append(list(conversation[:-1]))
        print(f"user: {turn}\nassistant: {answer}")
        s = pool.stats()
        query = s["prefix_query_tokens"] - before["prefix_query_tokens"]
        hit = s["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        print(f"  turn {i}: prefix cache hit rate {hit}/{query} prompt tokens ({100 * hit / max(query, 1):.0f}%), "
              f"{elapsed:.2f} s; pool: {s['num_used_pages']} pages used, {s['num_cached_pages']} cached, "
              f"{s['num_free_pages']} free\n")

    # the same prompts as one left-padded batch, stock DynamicCache vs the patched PagedCache
    inputs = _chat_inputs(tokenizer, transcript)
    results = {}
    for name in ("DynamicCache", "PagedCache"):
        if name == "DynamicCache":
            astrai_hf.unpatch(model)
            cache = None
        else:
            astrai_hf.patch(model, pool=pool)
            cache = astrai_hf.PagedCache(pool)
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                      return_dict_in_generate=True)
        if cache is not None:
            kwargs[astrai_hf.cache_kwarg(model)] = cache
        start = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
        elapsed = time.perf_counter() - start
        held = cache if cache is not None else (getattr(out, "cache", None) or getattr(out, "past_key_values", None))
        results[name] = (out.sequences, elapsed, kv_bytes(held))
        if cache is not None:
            cache.release()
    astrai_hf.unpatch(model)
    ref = results["DynamicCache"][0]
    batch = inputs["input_ids"].shape[0]
    print(f"Side by side: the {batch} prompts above as one left-padded batch, {max_new_tokens} new tokens each")
    print(f"{'cache':<14}{'tokens identical':>18}{'tok/s (end to end)':>20}{'KV bytes':>14}")
    for name, (seqs, elapsed, nbytes) in results.items():
        same = "yes" if torch.equal(seqs, ref) else "NO"
        print(f"{name:<14}{same:>18}{batch * max_new_tokens / elapsed:>20.1f}{nbytes / 2**20:>11.2f} MiB")
    print(f"after the demo: {pool.stats()['num_used_pages']} pages in use")
    print("One short batch, timed once (noisy on a CPU). The patched run computes its prefill on the real tokens\n"
          "only and never attends over padding; the larger gains come with long prompts of mixed lengths in one\n"
          "batch and with prompts sent again: see `astrai-hf bench`.")
    return 0


def _bench(model, tokenizer, out_dir, suite: str = "all", plot_path=None, repeats: int = 3) -> int:
    from tqdm.auto import tqdm

    from . import bench, bench_prefill, bench_prefix

    def decode(bar):
        rows, env = bench.run(model, tokenizer, progress=bar)
        return bench.to_markdown(rows, env), {"env": env, "rows": [r.__dict__ for r in rows]}

    def prefix(bar):
        results, env = bench_prefix.run(model, tokenizer, progress=bar), bench.environment(model)
        return bench_prefix.to_markdown(results, env), {"env": env, **bench_prefix.as_dict(results)}

    def prefill(bar):
        results = bench_prefill.run(model, tokenizer, repeats=repeats, progress=bar)
        env = bench.environment(model)
        return bench_prefill.to_markdown(results, env), {"env": env, **bench_prefill.as_dict(results)}

    # suite: (runner, progress steps, file stem); the stems are what astrai_hf.plots.load_results reads
    suites = {"decode": (decode, 2, "bench"), "prefix": (prefix, 3, "prefix"), "prefill": (prefill, 3 * repeats, "prefill")}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    collected = {}
    for name, (runner, steps, stem) in suites.items():
        if suite not in (name, "all"):
            continue
        with tqdm(total=steps, desc=f"bench {name}") as bar:
            table, data = runner(bar)
        print(table)
        collected[name] = data
        if out_dir is not None:
            (out_dir / f"{stem}.md").write_text(table)
            (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2))
    if plot_path is not None:
        from .plots import plot

        print(f"chart: {plot(collected, plot_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
