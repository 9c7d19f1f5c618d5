#!/usr/bin/env bash
# The whole test suite on the newest supported transformers, then the equivalence and compat tests on the oldest
# (5.17).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv constraints.txt
.venv/bin/python -m pytest -q -p no:cacheprovider
bash scripts/setup.sh .venv-5.17 constraints-5.17.txt
.venv-5.17/bin/python -m pytest -q -p no:cacheprovider -m "equivalence or compat"
