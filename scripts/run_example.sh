#!/usr/bin/env bash
# Set up .venv if needed, then run the long-context training example; arguments go to the example
# (see `bash scripts/run_example.sh --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${VENV_DIR:-$ROOT/.venv}/bin/python" examples/train_long_context.py "$@"
