"""One rank of the tensor-parallel test, run by tests/test_tensor_parallel.py as
``torchrun --standalone --nproc_per_node 2 tests/tp_worker.py MODEL_DIR MQA_DIR REFERENCE_JSON OUT_DIR``.

Every scenario runs on both ranks in the same order and records what happened (tokens, pool facts, or the error's
type and message) in ``OUT_DIR/rank{r}.json``; the test compares the two ranks and the single-process reference.
A rank that waits forever in a collective makes the test's timeout fire.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main(model_dir: str, mqa_dir: str, reference_path: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, DistributedConfig
    from transformers.utils import logging as hf_logging

    import astrai_hf
    from astrai_hf import CacheFullError, PagedCache, PagePool

    hf_logging.set_verbosity_error()
    ref = json.loads(Path(reference_path).read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "world": world, "backend": str(dist.get_backend())}
    greedy = dict(do_sample=False, max_new_tokens=ref["max_new_tokens"])

    def tensor(name):
        return torch.tensor(ref[name])

    def attempt(name, fn):
        """Run one scenario; record its value or its error. Both ranks must come back from each one."""
        try:
            result[name] = {"ok": fn()}
        except Exception as e:  # recorded, compared by the test
            result[name] = {"error": type(e).__name__, "message": str(e)}

    # 1. paged generate() on both ranks, a left-padded batch, then a second turn that hits the prefix cache
    astrai_hf.patch(model, max_tokens=512, page_size=4)
    pool = astrai_hf.get_pool(model)
    result["pool"] = {
        "num_kv_heads": pool.config.spec.num_kv_heads,
        "storage_shape": list(pool.storage.k[0].shape),
        "config_kv_heads": model.config.num_key_value_heads,
        "kv_bytes_by_device": pool.stats()["kv_bytes_by_device"],
        "kv_bytes_total": pool.stats()["kv_bytes_total"],
        "tp": pool.ranks is not None and pool.ranks.size,
    }

    def two_turns():
        out1 = model.generate(tensor("ids1"), attention_mask=tensor("mask1"), **greedy)
        hit_before = pool.stats()["prefix_hit_tokens"]
        out2 = model.generate(tensor("ids2"), attention_mask=tensor("mask2"), **greedy)
        s = pool.stats()
        return {"out1": out1.tolist(), "out2": out2.tolist(), "hit2": s["prefix_hit_tokens"] - hit_before,
                "used_after": s["num_used_pages"], "cached_after": s["num_cached_pages"]}

    attempt("two_turns", two_turns)

    # 2. without patch(): stock attention over K/V gathered from this rank's pool
    astrai_hf.unpatch(model)

    def unpatched():
        plain = PagePool.from_model(model, max_tokens=256, page_size=4)
        with PagedCache(plain, tensor("ids1"), tensor("mask1")) as cache:
            return model.generate(tensor("ids1"), attention_mask=tensor("mask1"), past_key_values=cache,
                                  **greedy).tolist()

    attempt("unpatched", unpatched)

    # 3. a pool too small for the batch on every rank: CacheFullError on both, and the pool recovers
    def full_everywhere():
        small = PagePool.from_model(model, max_tokens=12, page_size=4, max_seq_len=64)
        astrai_hf.patch(model, pool=small)
        try:
            model.generate(tensor("ids1"), attention_mask=tensor("mask1"), **greedy)
        finally:
            result["full_everywhere_used_after"] = small.stats()["num_used_pages"]
        return "no error"

    attempt("full_everywhere", full_everywhere)

    # 4. rank 1 alone runs out of pages in the middle of decoding: both ranks raise CacheFullError
    def full_on_rank1():
        pool4 = PagePool.from_model(model, max_tokens=16, page_size=4, prefix_cache=False)  # 4 pages
        astrai_hf.patch(model, pool=pool4)
        taken = pool4.allocator.alloc(2) if rank == 1 else []  # rank 1 keeps 2 free pages, rank 0 has 4
        try:
            # 4 prompt tokens + 6 new need 3 pages: prefill and the first decode pages fit on both ranks
            model.generate(tensor("one_row"), **greedy)
        finally:
            result["full_on_rank1_used_after"] = pool4.stats()["num_used_pages"] - len(taken)
            pool4.allocator.decref(taken)
        return "no error"

    attempt("full_on_rank1", full_on_rank1)

    # 4b. rank 0 alone short of request rows (it holds one of 3): both ranks raise it, in request rows
    def rows_full_on_rank0():
        rows_pool = PagePool.from_model(model, max_tokens=256, page_size=4, max_reqs=3)
        astrai_hf.patch(model, pool=rows_pool)
        taken = rows_pool.req_to_token.alloc(1) if rank == 0 else []
        try:
            model.generate(tensor("ids1"), attention_mask=tensor("mask1"), **greedy)  # 3 rows
        finally:
            result["rows_full_on_rank0_used_after"] = rows_pool.stats()["num_reqs_used"] - len(taken)
            rows_pool.req_to_token.free(taken)
        return "no error"

    attempt("rows_full_on_rank0", rows_full_on_rank0)

    # 5. a bad input (right padding) on rank 1 only: ValueError on both ranks
    astrai_hf.patch(model, pool=pool)

    def bad_input_on_rank1():
        mask = tensor("mask1")
        if rank == 1:
            mask = mask.flip(-1)
        return model.generate(tensor("ids1"), attention_mask=mask, **greedy).tolist()

    attempt("bad_input_on_rank1", bad_input_on_rank1)

    def bad_input_on_rank0():  # (the lowest rank: the others name it and carry its message)
        mask = tensor("mask1")
        if rank == 0:
            mask = mask.flip(-1)
        return model.generate(tensor("ids1"), attention_mask=mask, **greedy).tolist()

    attempt("bad_input_on_rank0", bad_input_on_rank0)

    # 6. after all that the first pool still generates the reference tokens
    attempt("after_errors", lambda: model.generate(tensor("ids1"), attention_mask=tensor("mask1"), **greedy).tolist())

    # 7. the prefix cache saved and loaded per rank: a new pool serves the second turn from the file
    def persist():
        saved = pool.save_prefix_cache(Path(out_dir, f"prefix.rank{rank}.safetensors"))
        fresh = PagePool.from_model(model, max_tokens=512, page_size=4)
        loaded = fresh.load_prefix_cache(Path(out_dir, f"prefix.rank{rank}.safetensors"))
        astrai_hf.patch(model, pool=fresh)
        out2 = model.generate(tensor("ids2"), attention_mask=tensor("mask2"), **greedy)
        return {"saved": saved, "loaded": loaded, "hit": fresh.stats()["prefix_hit_tokens"], "out2": out2.tolist()}

    attempt("persist", persist)

    def persist_differs():
        fresh = PagePool.from_model(model, max_tokens=512, page_size=4)
        taken = fresh.allocator.alloc(fresh.allocator.num_free - 3) if rank == 1 else []  # room for 3 pages
        try:
            return fresh.load_prefix_cache(Path(out_dir, f"prefix.rank{rank}.safetensors"))
        finally:
            result["persist_differs_cached_after"] = fresh.stats()["prefix_cache_pages"]
            fresh.allocator.decref(taken)

    attempt("persist_differs", persist_differs)
    astrai_hf.patch(model, pool=pool)

    # 8. pools that differ between the ranks are refused on every rank
    attempt("pools_differ", lambda: repr(PagePool.from_model(model, max_tokens=64 * (rank + 1), page_size=4)))

    # 9. memory_fraction: the ranks agree on the page count
    attempt("memory_fraction", lambda: PagePool.from_model(model, memory_fraction=1e-6, page_size=4).stats()["num_pages"])

    # 10. fused QKV projections: Phi-3's plan gathers qkv_proj's output (every rank keeps every head), GPT-NeoX's
    # shards query_key_value (each rank keeps half)
    for name, family in ref["families"].items():
        def fused(family=family):
            other = AutoModelForCausalLM.from_pretrained(family["dir"],
                                                         distributed_config=DistributedConfig(tp_plan="auto"))
            astrai_hf.patch(other, max_tokens=256, page_size=4)
            out = other.generate(tensor("ids1"), attention_mask=tensor("mask1"), **greedy).tolist()
            return {"num_kv_heads": astrai_hf.get_pool(other).config.spec.num_kv_heads, "out": out}

        attempt(name, fused)

    # 11. one KV head over two ranks: transformers splits the head itself; the pool refuses with the reason
    mqa = AutoModelForCausalLM.from_pretrained(mqa_dir, distributed_config=DistributedConfig(tp_plan="auto"))
    attempt("mqa", lambda: repr(PagePool.from_model(mqa, max_tokens=64)))

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
