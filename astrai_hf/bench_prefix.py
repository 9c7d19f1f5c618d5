"""``astrai-hf bench --suite prefix``: what the prefix cache saves, side by side with stock transformers.

Three measurements on one model:

- **Time to first token** (``generate(max_new_tokens=1)``, median of ``repeats``) of a 1024-token prompt whose first
  1000 tokens were seen before: cold ``DynamicCache``; transformers' documented manual reuse (pre-fill a
  ``DynamicCache`` with the 1000 tokens once, ``copy.deepcopy`` it for every prompt); cold and warm patched
  ``PagedCache``. Every repeat uses a different 24-token suffix, so the warm run hits exactly the shared 1000.
- **A 5-turn chat** (greedy): prompt tokens computed per turn. ``DynamicCache`` recomputes the whole conversation
  every turn; the prefix cache computes what it has not seen.
- **``num_return_sequences=8``** on a 1000-token prompt (sampling, same seed): peak KV bytes held during
  ``generate()`` (``PagedCache``: used pages x bytes per page) against what ``DynamicCache`` holds at the end.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache, LogitsProcessorList

from .bench import mixed_prompts
from .cache import cache_kwarg
from .patch import get_pool, patch, unpatch
from .pool import PagePool

CHAT_TURNS = [
    "Write two sentences about the river Seine.",
    "Which cities does it flow through?",
    "Name one bridge in the largest of them.",
    "When was that bridge built?",
    "Summarise our conversation in one sentence.",
]


@dataclass
class PrefixResults:
    ttft_s: dict  # method -> median seconds
    ttft_same_tokens: bool
    ttft_hit_tokens: int
    chat_prompt_tokens: list  # per turn: full prompt length
    chat_computed_tokens: list  # per turn: tokens the prefix cache left to compute
    chat_time_s: dict  # method -> seconds for the whole chat
    chat_same_answers: bool
    n8_kv_bytes: dict  # method -> bytes
    n8_same_tokens: bool
    n8_prompt_tokens: int
    n8_new_tokens: int


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _pool(model, prefix_cache: bool) -> PagePool:
    return PagePool.from_model(model, max_tokens=32_768, page_size=16, prefix_cache=prefix_cache)


def measure_ttft(model, tokenizer, repeats: int = 5, seed: int = 0):
    base_ids, _ = mixed_prompts(tokenizer, [1000], seed)
    suffixes = [mixed_prompts(tokenizer, [24], seed + 1 + i)[0] for i in range(repeats)]
    gen = dict(max_new_tokens=1, do_sample=False)
    kw = cache_kwarg(model)
    with torch.no_grad():
        shared = DynamicCache(config=model.config)
        model(base_ids, **{kw: shared})
    cold_pool, warm_pool = _pool(model, prefix_cache=False), _pool(model, prefix_cache=True)
    patch(model, pool=warm_pool)
    try:
        model.generate(base_ids, **gen)  # the 1000 shared tokens, seen once
    finally:
        unpatch(model)

    def plain(p):
        return _timed(lambda: model.generate(p, **gen))

    def manual(p):  # the copy is part of the cost of this recipe
        return _timed(lambda: model.generate(p, **gen, **{kw: copy.deepcopy(shared)}))

    def paged(pool, p):
        patch(model, pool=pool)
        try:
            return _timed(lambda: model.generate(p, **gen))
        finally:
            unpatch(model)

    methods = {
        "DynamicCache, cold": plain,
        "DynamicCache, manual reuse (deepcopy)": manual,
        "astrai-hf, cold": lambda p: paged(cold_pool, p),
        "astrai-hf, 1000 tokens cached": lambda p: paged(warm_pool, p),
    }
    model.generate(base_ids[:, :16], **gen)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in methods}
    firsts: dict[str, list[int]] = {name: [] for name in methods}
    before = warm_pool.stats()["prefix_hit_tokens"]
    for suffix in suffixes:  # methods interleaved, so drift in machine load hits all of them alike
        p = torch.cat([base_ids, suffix], dim=1)
        for name, fn in methods.items():
            out, t = fn(p)
            times[name].append(t)
            firsts[name].append(int(out[0, -1]))
    hit = (warm_pool.stats()["prefix_hit_tokens"] - before) // repeats
    same = len({tuple(v) for v in firsts.values()}) == 1
    return {k: statistics.median(v) for k, v in times.items()}, same, hit


def measure_chat(model, tokenizer, max_new_tokens: int = 32):
    def chat(patched: bool):
        if patched:
            patch(model, pool=_pool(model, prefix_cache=True))
        try:
            conversation, answers, lengths, computed = [], [], [], []
            start = time.perf_counter()
            for turn in CHAT_TURNS:
                conversation.append({"role": "user", "content": turn})
                text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
                before = get_pool(model).stats()["prefix_hit_tokens"] if patched else 0
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
                hit = get_pool(model).stats()["prefix_hit_tokens"] - before if patched else 0
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
                conversation.append({"role": "assistant", "content": answer})
                answers.append(answer)
                lengths.append(ids.shape[1])
                computed.append(ids.shape[1] - hit)
            return answers, lengths, computed, time.perf_counter() - start
        finally:
            unpatch(model)

    ref_answers, lengths, _, t_ref = chat(False)
    answers, lengths_p, computed, t_paged = chat(True)
    return lengths, computed, {"DynamicCache": t_ref, "astrai-hf": t_paged}, answers == ref_answers and lengths == lengths_p


def measure_n_samples(model, tokenizer, n: int = 8, prompt_tokens: int = 1000, new_tokens: int = 16, seed: int = 0):
    ids, _ = mixed_prompts(tokenizer, [prompt_tokens], seed)
    gen = dict(do_sample=True, num_return_sequences=n, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
               return_dict_in_generate=True)
    torch.manual_seed(seed)
    ref = model.generate(ids, **gen)
    cache = getattr(ref, "cache", None) or getattr(ref, "past_key_values", None)
    dynamic = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    pool = _pool(model, prefix_cache=True)
    patch(model, pool=pool)
    peak = [0]

    def record_peak(input_ids, scores):
        # a logits processor runs after each forward; a forward hook would have the call run as hooks need
        # (pool.has_caller_hooks: every row computed, no packing)
        peak[0] = max(peak[0], pool.stats()["kv_bytes_used"])
        return scores

    try:
        torch.manual_seed(seed)
        out = model.generate(ids, logits_processor=LogitsProcessorList([record_peak]), **gen)
    finally:
        unpatch(model)
    return {"DynamicCache": dynamic, "astrai-hf": peak[0]}, torch.equal(out.sequences, ref.sequences)


def run(model, tokenizer, progress=None) -> PrefixResults:
    ttft, ttft_same, hit = measure_ttft(model, tokenizer)
    if progress is not None:
        progress.update()
    lengths, computed, chat_time, chat_same = measure_chat(model, tokenizer)
    if progress is not None:
        progress.update()
    kv, n8_same = measure_n_samples(model, tokenizer)
    if progress is not None:
        progress.update()
    return PrefixResults(ttft, ttft_same, hit, lengths, computed, chat_time, chat_same, kv, n8_same, 1000, 16)


def to_markdown(r: PrefixResults, env: dict) -> str:
    cold = r.ttft_s["DynamicCache, cold"]
    lines = [
        f"Prefix cache, embedded model, {env['device']}, {env['dtype']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['threads']} threads, {env['date']}.",
        "",
        f"Time to first token, 1024-token prompt whose first 1000 tokens were seen before (median of 5, methods interleaved; "
        f"astrai-hf reused {r.ttft_hit_tokens} tokens; first tokens identical: {'yes' if r.ttft_same_tokens else 'NO'}):",
        "",
        "| method | TTFT s | speed-up vs cold DynamicCache |",
        "|---|---:|---:|",
    ]
    for name, t in r.ttft_s.items():
        lines.append(f"| {name} | {t:.3f} | {cold / t:.1f}x |")
    total, computed = sum(r.chat_prompt_tokens), sum(r.chat_computed_tokens)
    lines += [
        "",
        f"5-turn chat, greedy, 32 new tokens per turn (answers identical: {'yes' if r.chat_same_answers else 'NO'}):",
        "",
        "| turn | prompt tokens | computed by DynamicCache | computed by astrai-hf |",
        "|---:|---:|---:|---:|",
    ]
    for i, (n, c) in enumerate(zip(r.chat_prompt_tokens, r.chat_computed_tokens), 1):
        lines.append(f"| {i} | {n} | {n} | {c} |")
    lines += [
        f"| all | {total} | {total} | {computed} ({computed / total:.2f}x) |",
        "",
        f"Whole chat: DynamicCache {r.chat_time_s['DynamicCache']:.2f} s, astrai-hf {r.chat_time_s['astrai-hf']:.2f} s.",
        "",
        f"`num_return_sequences=8`, {r.n8_prompt_tokens}-token prompt, {r.n8_new_tokens} new tokens, sampling "
        f"(tokens identical: {'yes' if r.n8_same_tokens else 'NO'}):",
        "",
        "| cache | KV bytes | vs DynamicCache |",
        "|---|---:|---:|",
    ]
    base = r.n8_kv_bytes["DynamicCache"]
    for name, b in r.n8_kv_bytes.items():
        lines.append(f"| {name}{' (peak)' if name != 'DynamicCache' else ''} | {b / 2**20:.1f} MiB | {b / base:.2f}x |")
    return "\n".join(lines) + "\n"


def as_dict(r: PrefixResults) -> dict:
    return asdict(r)
