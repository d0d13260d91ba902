#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite; arguments go to pytest (e.g. `-k layout`, `-x`, `-q`).
# Exits non-zero on any failure, including pytest's exit code 5 (no tests collected).
# The test files run on ULYSSES_TEST_WORKERS pytest workers (default 2, pytest-xdist, one file per worker at a time so
# that a file's shared launches run once); `-n 0` among the arguments runs them in this process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
rc=0
"${VENV_DIR:-$ROOT/.venv}/bin/python" -m pytest tests -n "${ULYSSES_TEST_WORKERS:-2}" --dist loadfile "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "[run_tests] pytest collected no tests: failing." >&2
fi
exit "$rc"
