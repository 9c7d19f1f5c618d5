"""``astrai-hf bench --suite prefill``: a left-padded batch of very different prompt lengths, end to end.

The 8 prompts of the decode benchmark (64 to 1000 tokens, geometrically spaced: about 37% of the padded rectangle
is real tokens), greedy. Wall time of ``generate()`` for 1 new token (time to first token) and for 16 and 64 new
tokens, for: stock ``DynamicCache``; patched astrai-hf with packed prefill (the default) and with
``pack_prefill=False`` (the padded rectangle); and transformers' continuous batching ``generate_batch``, which packs
real tokens too. Methods are interleaved within each repeat; the table gives the median over repeats, and a
second table each method's time over `DynamicCache`'s within a repeat (median and range over repeats).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .bench import mixed_prompts
from .patch import patch, unpatch
from .pool import PagePool


@dataclass
class PrefillResults:
    prompt_lengths: list
    new_tokens: list  # e.g. [1, 16, 64]
    seconds: dict  # method -> {new_tokens: median seconds}
    same_tokens: dict  # method -> bool (every run equal to DynamicCache)
    repeats: int
    runs: dict = dataclasses.field(default_factory=dict)  # method -> {new_tokens: [seconds of each repeat]}

    def paired_ratios(self, method: str, n: int) -> list[float]:
        """``method``'s time over ``DynamicCache``'s in each repeat. The two ran back to back, so a slow spell of
        the machine weighs on both sides of one ratio, where a ratio of medians can pair a fast run with a slow."""
        return [t / base for t, base in zip(self.runs[method][n], self.runs["DynamicCache"][n])]


def generate_batch_runner(model, pad_token_id: int | None, prompts: list[list[int]], *, num_blocks: int = 2048,
                          max_batch_tokens: int = 4096):
    """A callable ``run(new_tokens) -> [B, new_tokens]`` token lists running transformers' continuous batching
    (``generate_batch``, greedy, no EOS) on ``prompts``, or None where this transformers release lacks it.
    ``num_blocks`` pages of 16 tokens and ``max_batch_tokens`` are set explicitly: auto-sizing probes the host's
    RAM and takes seconds on a CPU."""
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return None
    if not hasattr(model, "generate_batch"):
        return None

    # the page size field is `block_size` up to transformers 5.2x, `page_size` after (5.24 takes both)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"

    def run(new_tokens: int, warmup: bool = True) -> list[list[int]]:
        cb = ContinuousBatchingConfig(**{page_field: 16}, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
        gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=pad_token_id)
        out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, warmup=warmup)
        return [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))]

    return run


def run(model, tokenizer, *, new_tokens=(1, 16, 64), repeats: int = 3, seed: int = 0, progress=None) -> PrefillResults:
    lengths = [round(64 * (1000 / 64) ** (i / 7)) for i in range(8)]
    ids, mask = mixed_prompts(tokenizer, lengths, seed)
    width = ids.shape[1]
    prompts = [ids[r][mask[r].bool()].tolist() for r in range(ids.shape[0])]
    pool = PagePool.from_model(model, max_tokens=32_768, page_size=16, prefix_cache=False)

    def stock(n):
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, width:]

    def paged(n, pack):
        patch(model, pool=pool, pack_prefill=pack)
        try:
            return stock(n)
        finally:
            unpatch(model)

    methods = {
        "DynamicCache": stock,
        "astrai-hf, packed prefill": lambda n: paged(n, True),
        "astrai-hf, padded rectangle": lambda n: paged(n, False),
    }
    batch_runner = generate_batch_runner(model, tokenizer.pad_token_id, prompts)
    if batch_runner is not None:
        methods["generate_batch (continuous batching)"] = lambda n: torch.tensor(batch_runner(n))
    stock(2)  # warm-up
    times = {m: {n: [] for n in new_tokens} for m in methods}
    same = {m: True for m in methods}
    for _ in range(repeats):
        for n in new_tokens:
            reference = None
            for name, fn in methods.items():
                start = time.perf_counter()
                out = fn(n)
                times[name][n].append(time.perf_counter() - start)
                reference = out if reference is None else reference
                same[name] &= torch.equal(out, reference)
            if progress is not None:
                progress.update()
    seconds = {m: {n: statistics.median(v) for n, v in per.items()} for m, per in times.items()}
    return PrefillResults(lengths, list(new_tokens), seconds, same, repeats, times)


def to_markdown(r: PrefillResults, env: dict) -> str:
    base = r.seconds["DynamicCache"]
    head = " | ".join(f"{'TTFT' if n == 1 else f'{n} new tokens'} s (vs DynamicCache)" for n in r.new_tokens)
    lines = [
        f"Packed prefill, embedded model, {env['device']}, {env['dtype']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['threads']} threads, {env['date']}.",
        "",
        f"8 left-padded prompts of {min(r.prompt_lengths)}-{max(r.prompt_lengths)} tokens "
        f"({sum(r.prompt_lengths)} real of {len(r.prompt_lengths) * max(r.prompt_lengths)} padded), greedy; "
        f"wall time of the whole call, median of {r.repeats}, methods interleaved.",
        "",
        f"| method | {head} | tokens identical |",
        "|---|" + "---:|" * len(r.new_tokens) + "---|",
    ]
    for name, per in r.seconds.items():
        cells = " | ".join(f"{per[n]:.2f} ({per[n] / base[n]:.2f}x)" for n in r.new_tokens)
        lines.append(f"| {name} | {cells} | {'yes' if r.same_tokens[name] else 'NO'} |")
    if r.runs:
        lines += [
            "",
            "Paired: each method's time over DynamicCache's in the same repeat (run back to back), median [min-max] "
            "over repeats.",
            "",
            f"| method | {' | '.join('TTFT' if n == 1 else f'{n} new tokens' for n in r.new_tokens)} |",
            "|---|" + "---:|" * len(r.new_tokens),
        ]
        for name in r.runs:
            if name == "DynamicCache":
                continue
            cells = []
            for n in r.new_tokens:
                ratios = r.paired_ratios(name, n)
                cells.append(f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
            lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def as_dict(r: PrefillResults) -> dict:
    return asdict(r)
