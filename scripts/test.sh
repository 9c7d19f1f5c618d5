#!/usr/bin/env bash
# The whole test suite on the newest supported transformers (5.25), then the equivalence and compat tests on 5.24
# and on the oldest (5.17).
set -euo pipefail
cd "$(dirname "$0")/.."
# each environment takes about 2.5 GB (torch and Triton the most); a full disk shows up as pip's OSError
missing=0
for v in .venv .venv-5.24 .venv-5.17; do [ -x "$v/bin/python" ] || missing=$((missing + 1)); done
free_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
if [ "$missing" -gt 0 ] && [ "$free_mb" -lt $((missing * 2600)) ]; then
  echo "test.sh: warning: $missing test environment(s) to create need about $((missing * 2600)) MB; $free_mb MB free" >&2
fi
bash scripts/setup.sh .venv constraints.txt
.venv/bin/python -m pytest -q -p no:cacheprovider
for release in 5.24 5.17; do
  bash scripts/setup.sh ".venv-$release" "constraints-$release.txt"
  ".venv-$release/bin/python" -m pytest -q -p no:cacheprovider -m "equivalence or compat"
done
