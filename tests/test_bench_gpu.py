"""The GPU benchmark script runs end to end (on CPU, a 2-layer model) and writes its table and JSON."""

import json

from astrai_hf.bench_gpu import main


def test_gpu_bench_smoke_run(tmp_path):
    assert main(["--out", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--tiny", "--batches", "1,3",
                 "--prompt-len", "8", "--new-tokens", "4", "--prefill-batch", "3"]) == 0
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    rows = {(r["batch"], r["setup"]) for r in data["decode"]}
    assert {(1, "DynamicCache eager"), (3, "PagedCache eager")} <= rows
    assert all(r["same_tokens"] for r in data["decode"] if r["setup"] != "generate_batch (end to end)")
    assert data["prefill"]["PagedCache, packed prefill"]["same_tokens"]
    assert "| 3 | PagedCache eager |" in (tmp_path / "gpu_bench.md").read_text()
