#!/usr/bin/env bash
# The whole test suite on the newest supported transformers (5.25), then the equivalence and compat tests on 5.24
# and on the oldest (5.17).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv constraints.txt
.venv/bin/python -m pytest -q -p no:cacheprovider
for release in 5.24 5.17; do
  bash scripts/setup.sh ".venv-$release" "constraints-$release.txt"
  ".venv-$release/bin/python" -m pytest -q -p no:cacheprovider -m "equivalence or compat"
done
