"""``astrai-hf bench``: decode speed and KV memory of DynamicCache, StaticCache and patched PagedCache, side by side.

Decode tokens/s is measured inside one ``generate()`` call: a streamer timestamps each step, and the speed is
``B * (N - 1) / (t(last token) - t(first token))``, which leaves the prefill out. KV bytes are what the cache holds
when generation ends.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

from .patch import patch, unpatch
from .cache import PagedCache, cache_kwarg
from .pool import PagePool


@dataclass
class Row:
    batch: str
    cache: str
    decode_tok_s: float
    kv_bytes: int
    same_tokens: bool


def mixed_prompts(tokenizer, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of exactly ``lengths`` tokens, cut from varied English text."""
    g = torch.Generator().manual_seed(seed)
    words = ("the model reads a long document about rivers , cities , history and science and then answers "
             "questions about what it read in short clear sentences").split()
    rows = []
    for n in lengths:
        order = torch.randint(0, len(words), (n * 2,), generator=g).tolist()
        ids = tokenizer(" ".join(words[i] for i in order), add_special_tokens=False)["input_ids"]
        while len(ids) < n:
            ids = ids + ids
        rows.append(ids[:n])
    width = max(lengths)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, width - len(ids):] = torch.tensor(ids)
        mask[r, width - len(ids):] = 1
    return input_ids, mask


def kv_bytes(cache) -> int:
    """Bytes of K and V a cache holds now: a PagedCache's pool pages in use; a DynamicCache's or StaticCache's
    layer tensors."""
    if isinstance(cache, PagedCache):
        return cache.pool.stats()["kv_bytes_used"]
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class StepTimer:
    """A ``generate()`` streamer that timestamps every step: ``times[0]`` when the first new token is out (end of
    prefill), then one per decode step. Works at any batch size."""

    def __init__(self):
        self.times: list[float] = []
        self._calls = 0

    def put(self, value) -> None:
        self._calls += 1
        if self._calls > 1:  # the first call carries the prompt
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_tok_s(self, batch: int) -> float:
        """Tokens per second over the decode steps (after the first token)."""
        steps = len(self.times) - 1
        return batch * steps / max(self.times[-1] - self.times[0], 1e-9) if steps > 0 else float("nan")


def _run(model, ids, mask, new_tokens: int, make_cache, timer: StepTimer | None = None):
    cache = make_cache()
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if timer is not None:
        kwargs["streamer"] = timer
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        cache = None
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    kwargs["return_dict_in_generate"] = True
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    elapsed = time.perf_counter() - start
    held = cache if cache is not None else (getattr(out, "cache", None) or getattr(out, "past_key_values", None))
    nbytes = kv_bytes(held)
    if isinstance(cache, PagedCache):
        cache.release()
    return out.sequences, elapsed, nbytes


def measure(model, ids, mask, new_tokens: int, label: str, pool: PagePool) -> list[Row]:
    """One batch, three caches; returns one row per cache."""
    setups = {
        "DynamicCache": lambda: None,
        "StaticCache": lambda: "static",
        # what a patched generate() builds itself: room for the new tokens next to each prompt
        "PagedCache (patched)": lambda: PagedCache(pool, reserve_new_tokens=new_tokens),
    }
    rows, reference = [], None
    for name, make in setups.items():
        if name.startswith("Paged"):
            patch(model, pool=pool)
        try:
            _run(model, ids[:, -8:], mask[:, -8:], 2, make)  # warm-up (the last columns: every row has tokens)
            timer = StepTimer()
            seqs, _, nbytes = _run(model, ids, mask, new_tokens, make, timer)
        finally:
            unpatch(model)
        if reference is None:
            reference = seqs
        speed = timer.decode_tok_s(ids.shape[0])
        rows.append(Row(label, name, speed, nbytes, torch.equal(seqs, reference)))
    return rows


def run(model, tokenizer, *, new_tokens_b1: int = 64, new_tokens_b8: int = 32, seed: int = 0,
        progress=None) -> tuple[list[Row], dict]:
    """The benchmark of the README: batch 1 (512-token prompt) and batch 8 (prompts of 64-1000 tokens,
    geometrically spaced). Returns the rows and a description of the environment."""
    # geometric spacing from 64 to 1000 tokens: many short prompts, few long ones, as in chat traffic; the
    # padded rectangle is then about 36% real tokens
    lengths8 = [round(64 * (1000 / 64) ** (i / 7)) for i in range(8)]
    batches = [("batch 1 (512-token prompt)", [512], new_tokens_b1),
               (f"batch 8 (prompts {min(lengths8)}-{max(lengths8)} tokens)", lengths8, new_tokens_b8)]
    # no prefix cache here: the N-token run would reuse the 1-token run's prompt and skew the difference
    pool = PagePool.from_model(model, max_tokens=16_384, page_size=16, prefix_cache=False)
    rows = []
    for label, lengths, n in batches:
        ids, mask = mixed_prompts(tokenizer, lengths, seed)
        rows += measure(model, ids, mask, n, label, pool)
        if progress is not None:
            progress.update()
    return rows, environment(model)


def environment(model) -> dict:
    """Versions, device, threads and dtype, for the header of a results table."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def to_markdown(rows: list[Row], env: dict) -> str:
    lines = [
        f"Embedded model, {env['device']}, {env['dtype']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['threads']} threads, {env['date']}.",
        "",
        "| batch | cache | decode tok/s | vs DynamicCache | KV bytes | vs DynamicCache | tokens identical |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    base = {}
    for r in rows:
        base.setdefault(r.batch, r)
        b = base[r.batch]
        lines.append(
            f"| {r.batch} | {r.cache} | {r.decode_tok_s:.1f} | {r.decode_tok_s / b.decode_tok_s:.2f}x | "
            f"{r.kv_bytes / 2**20:.1f} MiB | {r.kv_bytes / max(b.kv_bytes, 1):.2f}x | {'yes' if r.same_tokens else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
