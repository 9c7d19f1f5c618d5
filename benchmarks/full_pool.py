"""Host time of a call on a pool full of cached prefixes, measured on any machine (no GPU needed).

In a long session the prefix cache fills the whole pool: it is evicted only when a call needs room. Each eviction
walks every cached page (to find the least recently used leaves), so a call whose every new page had to evict
walked them once per page it took, and the call's time grew with the pool's size. This script fills pools of
several sizes with distinct cached prompts, then times one fixed call (4 fresh rows of 10-40 tokens, 16 new
tokens) on each: process CPU time on one thread, the fastest of 5 calls, with the call on an empty pool of the
same size beside it.

The model is a 2-layer Llama of random weights (tests/tiny_models.py), so the model's own compute is small and
the host work astrai-hf does around it shows.

Usage: ``python benchmarks/full_pool.py --out DIR`` writes ``full_pool.md`` and ``full_pool.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import astrai_hf  # noqa: E402
from tiny_models import left_padded_batch, tiny_model  # noqa: E402

PAGE_SIZE = 4


def _call_ms(model, ids, mask, calls: int = 5) -> float:
    times = []
    for i in range(calls):
        fresh = torch.where(mask.bool(), (ids + i) % 80 + 3, ids)  # new tokens each call: no prefix hit
        start = time.process_time()
        model.generate(fresh, attention_mask=mask, max_new_tokens=16, do_sample=False)
        times.append(time.process_time() - start)
    return 1000 * min(times)


def measure(max_tokens: int) -> dict:
    model = tiny_model("llama", max_position_embeddings=512)
    ids, mask = left_padded_batch([40, 30, 20, 10])
    astrai_hf.patch(model, max_tokens=max_tokens, page_size=PAGE_SIZE)
    pool = astrai_hf.get_pool(model)
    empty = _call_ms(model, ids, mask)
    pool.clear_prefix_cache()
    g = torch.Generator().manual_seed(0)
    while pool.stats()["num_free_pages"] > 64 or pool.stats()["evictions"] == 0:
        prompts = torch.randint(3, 90, (8, 200), generator=g)
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=1, do_sample=False)
    evictions = pool.stats()["evictions"]
    full = _call_ms(model, ids, mask)
    stats = pool.stats()
    return {"pages": stats["num_pages"], "empty_pool_ms": empty, "full_pool_ms": full,
            "cached_pages": stats["num_cached_pages"], "evictions_per_call": (stats["evictions"] - evictions) / 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", default="8192,65536,262144")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(int(n)) for n in args.max_tokens.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "full_pool.json").write_text(json.dumps(rows, indent=1))
    lines = ["| pages | call on an empty pool (ms) | call on a full pool (ms) | cached pages | pages evicted per call |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['pages']} | {r['empty_pool_ms']:.1f} | {r['full_pool_ms']:.1f} | {r['cached_pages']} | "
              f"{r['evictions_per_call']:.0f} |" for r in rows]
    (args.out / "full_pool.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
