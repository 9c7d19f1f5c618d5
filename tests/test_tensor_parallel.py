"""Tensor parallelism through transformers' own engine: two CPU processes (gloo) under torchrun, each loading a
tiny Llama with ``tp_plan="auto"`` and generating with its own pool of half the KV heads.

The ranks run tests/tp_worker.py; this module builds the model and the single-process ``DynamicCache`` reference,
launches ``torch.distributed.run`` with a timeout (a rank left waiting in a collective fails the test instead of
hanging it), and checks what each rank recorded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tiny_models import left_padded_batch, tiny_model

MAX_NEW_TOKENS = 6
# fused QKV projections and the KV heads each of 2 ranks holds: Phi-3's plan gathers qkv_proj's output (both of its
# 2 KV heads on every rank); GPT-NeoX's shards query_key_value (2 of its 4 heads per rank)
FUSED_QKV = {"phi3": 2, "gpt_neox": 2}
TIMEOUT_S = 240


def _gloo_available() -> str | None:
    if not torch.distributed.is_available():
        return "torch was built without torch.distributed"
    if not torch.distributed.is_gloo_available():
        return "torch.distributed has no gloo backend"
    return None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    reason = _gloo_available()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("tp")
    model = tiny_model("llama")  # 4 query heads, 2 KV heads
    model.save_pretrained(tmp / "llama")
    tiny_model("llama", num_key_value_heads=1).save_pretrained(tmp / "mqa")

    # single process, stock DynamicCache: what both ranks must reproduce token for token
    model = AutoModelForCausalLM.from_pretrained(tmp / "llama").eval()
    greedy = dict(do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    ids1, mask1 = left_padded_batch([5, 11, 3], seed=1)
    out1 = model.generate(ids1, attention_mask=mask1, past_key_values=DynamicCache(), **greedy)
    follow = torch.randint(3, 90, (3, 4), generator=torch.Generator().manual_seed(2))
    ids2 = torch.cat([out1, follow], dim=1)  # the next turn: everything so far plus new tokens, still left-padded
    mask2 = torch.cat([mask1, torch.ones(3, MAX_NEW_TOKENS + 4, dtype=mask1.dtype)], dim=1)
    out2 = model.generate(ids2, attention_mask=mask2, past_key_values=DynamicCache(), **greedy)
    one_row = torch.tensor([[5, 6, 7, 8]])
    families = {}
    for arch in FUSED_QKV:
        other = tiny_model(arch)
        other.save_pretrained(tmp / arch)
        out = other.generate(ids1, attention_mask=mask1, past_key_values=DynamicCache(), **greedy)
        families[arch] = {"dir": str(tmp / arch), "out": out.tolist()}
    reference = {
        "max_new_tokens": MAX_NEW_TOKENS,
        "ids1": ids1.tolist(), "mask1": mask1.tolist(), "ids2": ids2.tolist(), "mask2": mask2.tolist(),
        "out1": out1.tolist(), "out2": out2.tolist(), "one_row": one_row.tolist(), "families": families,
    }
    (tmp / "reference.json").write_text(json.dumps(reference))

    # the CPU / gloo path, even on a GPU box; torchrun's own temporary folders go under the test's, not the system's
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("tp_worker.py")), str(tmp / "llama"), str(tmp / "mqa"),
           str(tmp / "reference.json"), str(tmp)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s (a rank hung):\n{(e.stderr or b'')[-3000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    if os.environ.get("ASTRAI_HF_TP_DUMP"):
        print(json.dumps(results, indent=1))
    return reference, results


def test_each_rank_holds_half_the_kv_heads(ranks):
    _, results = ranks
    for r in results:
        assert r["world"] == 2 and r["backend"] == "gloo"
        pool = r["pool"]
        assert pool["config_kv_heads"] == 2 and pool["num_kv_heads"] == 1 and pool["tp"] == 2
        assert pool["storage_shape"][1:] == [1, 16]  # [slots, local KV heads, head_dim]
        assert pool["kv_bytes_by_device"] == {"cpu": pool["kv_bytes_total"]}
    # 128 usable pages x 4 tokens x K,V x 2 layers x 1 head x 16 x fp32
    assert results[0]["pool"]["kv_bytes_total"] == 128 * 4 * 2 * 2 * 1 * 16 * 4


def test_tokens_match_single_process_dynamic_cache_with_a_prefix_hit(ranks):
    reference, results = ranks
    for r in results:
        got = r["two_turns"]
        assert "ok" in got, got
        got = got["ok"]
        assert got["out1"] == reference["out1"]
        assert got["out2"] == reference["out2"]
        assert got["hit2"] > 0 and got["used_after"] == 0 and got["cached_after"] > 0
        assert r["unpatched"] == {"ok": reference["out1"]}
        assert r["after_errors"] == {"ok": reference["out1"]}
    assert results[0]["two_turns"]["ok"]["hit2"] == results[1]["two_turns"]["ok"]["hit2"]


def test_pool_full_is_raised_on_both_ranks(ranks):
    _, results = ranks
    for r in results:
        assert r["full_everywhere"]["error"] == "CacheFullError"
        assert r["full_everywhere_used_after"] == 0
        assert r["full_on_rank1"]["error"] == "CacheFullError"
        assert r["full_on_rank1_used_after"] == 0
    assert "needed 1 page, 0 free" in results[1]["full_on_rank1"]["message"]
    assert results[0]["full_on_rank1"]["message"] == (
        "KV page pool is full: needed 1 page, 0 free, 0 evictable (raised on tensor-parallel rank 1 of 2: "
        f"{results[1]['full_on_rank1']['message']})"
    )


def test_request_rows_short_on_one_rank_are_raised_on_both_in_rows(ranks):
    _, results = ranks
    for r in results:
        assert r["rows_full_on_rank0"]["error"] == "CacheFullError" and r["rows_full_on_rank0_used_after"] == 0
    assert "needed 3 request rows, 2 free" in results[0]["rows_full_on_rank0"]["message"]
    assert results[1]["rows_full_on_rank0"]["message"].startswith(
        "KV page pool is full: needed 3 request rows, 2 free, 0 evictable (raised on tensor-parallel rank 0 of 2: ")


@pytest.mark.parametrize("failing", [1, 0])
def test_bad_input_on_one_rank_is_raised_on_both(ranks, failing):
    _, results = ranks
    name, other = f"bad_input_on_rank{failing}", 1 - failing
    assert results[failing][name]["error"] == "ValueError"
    assert "not left-padded" in results[failing][name]["message"]
    assert results[other][name]["error"] == "ValueError"
    assert results[other][name]["message"] == (
        f"tensor-parallel rank {failing} of 2 raised ValueError: {results[failing][name]['message']}"
    )


def test_prefix_cache_files_per_rank(ranks):
    reference, results = ranks
    for r in results:
        got = r["persist"]["ok"]
        assert got["saved"] == got["loaded"] > 0 and got["hit"] > 0 and got["out2"] == reference["out2"]
        # rank 1 had room for 3 pages only: the ranks would reuse different prefixes, so both refuse and clear
        assert r["persist_differs"]["error"] == "ValueError"
        assert "number of prefix pages loaded differs" in r["persist_differs"]["message"]
        assert "every rank cleared its prefix cache" in r["persist_differs"]["message"]
        assert r["persist_differs_cached_after"] == 0
    assert results[0]["persist"]["ok"]["loaded"] == results[1]["persist"]["ok"]["loaded"]


def test_ranks_agree_on_pool_geometry(ranks):
    _, results = ranks
    for r in results:
        assert r["pools_differ"]["error"] == "ValueError"
        assert "num_pages from 17 to 33" in r["pools_differ"]["message"]
    assert results[0]["memory_fraction"]["ok"] == results[1]["memory_fraction"]["ok"] >= 1


def test_one_kv_head_over_two_ranks_is_refused(ranks):
    _, results = ranks
    for r in results:
        assert r["mqa"]["error"] == "ValueError"
        assert "1 KV head(s)" in r["mqa"]["message"] and "8 of the 16 output channels" in r["mqa"]["message"]


@pytest.mark.parametrize("arch", FUSED_QKV)
def test_fused_qkv_projections(ranks, arch):
    reference, results = ranks
    for r in results:
        assert r[arch] == {"ok": {"num_kv_heads": FUSED_QKV[arch], "out": reference["families"][arch]["out"]}}


def test_readme_snippet_under_torchrun(tmp_path):
    """The README's tensor-parallel script, as written, under torchrun (2 ranks, gloo) on a tiny Llama with its own
    word-level tokenizer: both ranks print the tokens of one process with stock generate()."""
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reason = _gloo_available()
    if reason:
        pytest.skip(reason)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    (snippet,) = re.findall(r"```python torchrun\n(.*?)```", readme, flags=re.S)
    words = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(60)]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        tmp_path / "model")
    tiny_model("llama").save_pretrained(tmp_path / "model")
    prompts = ["w5 w9 w11 w3", "w7", "w20 w21 w22 w23 w24 w25 w26"]
    script = tmp_path / "generate_tp.py"
    script.write_text(f"path = {str(tmp_path / 'model')!r}\nprompts = {prompts!r}\n" + snippet
                      + "import json, torch.distributed as dist\n"
                      + f"open({str(tmp_path)!r} + f'/rank{{dist.get_rank()}}.json', 'w').write(json.dumps(out.tolist()))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{(e.stderr or b'')[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model", padding_side="left")
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    want = model.generate(**inputs, max_new_tokens=64).tolist()
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == want
