#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite; arguments go to pytest (e.g. `-k layout`, `-x`, `-q`).
# Exits non-zero on any failure, including pytest's exit code 5 (no tests collected).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
rc=0
"${VENV_DIR:-$ROOT/.venv}/bin/python" -m pytest tests "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "[run_tests] pytest collected no tests: failing." >&2
fi
exit "$rc"
