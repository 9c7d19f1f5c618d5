#!/usr/bin/env bash
# The GPU check, on one CUDA machine with nothing from the network: the CUDA tests (tests/gpu), then the GPU
# benchmark (python -m astrai_hf.bench_gpu). Writes versions.txt, gpu_tests.log, gpu_bench.log, gpu_bench.md and
# gpu_bench.json to OUT_DIR.
#   bash benchmarks/gpu_check.sh OUT_DIR
# Uses the machine's own torch, Triton and transformers (tested with torch 2.11, Triton 3.6, transformers 5.17).
# Wheels it lacks can be put in .whl/ beside this repository's files; they are installed into a temporary folder.
# Takes at most 8 minutes (the tests at most 3 min 20 s, the benchmark at most 4 min 20 s).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}" && cd "$1" && pwd)"
py="${PYTHON:-python3}"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT  # (the copy of the package and the wheels installed for this run)
# astrai-hf as installed, without building a wheel: the package plus patches/ as astrai_hf.patches
cp -r "$repo/astrai_hf" "$site/astrai_hf" && rm -rf "$site/astrai_hf/patches" && cp -r "$repo/patches" "$site/astrai_hf/patches"
if compgen -G "$repo/.whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$repo"/.whl/*.whl || exit 1
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" - <<'PY' | tee "$out/versions.txt"
import torch, transformers
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "absent"
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"{name}; torch {torch.__version__}; CUDA {torch.version.cuda}; Triton {tv}; transformers {transformers.__version__}")
PY
# a machine whose torch cannot see its GPU would skip every CUDA test and look like a pass
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: torch sees no CUDA device")' \
  2>&1 | tee -a "$out/versions.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
status=0
# from a neutral folder, so the repository's astrai_hf (without astrai_hf.patches) does not shadow the copy
# -rA: the tests' own printed numbers (rows identical per batch, capture seconds) reach the log; a run out of time
# gets Ctrl-C (SIGINT), so pytest still writes the summary of the tests that ran
(cd "$site" && timeout -s INT -k 20 200 "$py" -m pytest -q -rA -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" \
    "$repo/tests/gpu" 2>&1 | tee "$out/gpu_tests.log") || status=1
# the benchmark writes gpu_bench.md / .json after every phase, so a run cut short keeps what it measured
(cd "$site" && timeout 260 "$py" -m astrai_hf.bench_gpu --out "$out" --budget-s 245 --eager-new-tokens 64 2>&1 | tee "$out/gpu_bench.log") || status=1
exit $status
