#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in <repo>/.venv and install everything the example, the tests
# and the benchmarks need.
#
#   bash scripts/setup_env.sh        # set up (a no-op when nothing changed)
#   source scripts/setup_env.sh      # set up, then activate .venv in the current shell
#
# torch is installed FIRST with an exact pin (TORCH_VERSION, default 2.13.0): on a GPU machine that pin resolves to
# the CUDA build from PyPI; on a machine whose pip has a local CPU wheel (pip find-links) it resolves to that. Only
# then is the package installed (`pip install -e ".[test,bench,cli]"`), so its unpinned `torch>=2.4` requirement is
# already satisfied and never pulls the multi-GB CUDA wheels on a CPU-only machine.
#
# pip runs with -qq: errors still print, warnings (e.g. about unreachable extra index pages) do not.
# Re-runs are fast: .venv/.setup-stamp holds a hash of pyproject.toml, the torch pin and the Python version, and the
# installs are skipped while it matches. Delete the stamp (or .venv) to force a reinstall.
# Environment: PYTHON (interpreter that creates the venv, default python3), TORCH_VERSION, VENV_DIR.

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # Sourced: do the work in a child bash (so `set -euo pipefail` does not leak into the caller's shell), then
    # activate the venv here.
    _ulysses_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if bash "${BASH_SOURCE[0]}"; then
        # shellcheck disable=SC1091
        source "${VENV_DIR:-$_ulysses_root/.venv}/bin/activate"
        unset _ulysses_root
        return 0
    else
        _ulysses_rc=$?
        unset _ulysses_root
        return "$_ulysses_rc"
    fi
fi

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV_DIR="${VENV_DIR:-$ROOT/.venv}"
STAMP="$VENV_DIR/.setup-stamp"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    echo "[setup_env] creating $VENV_DIR with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV_DIR"
fi
VPY="$VENV_DIR/bin/python"

want="$( { cat "$ROOT/pyproject.toml"; echo "torch==$TORCH_VERSION litgpt==0.5.13"; "$VPY" --version 2>&1; } \
    | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

start=$SECONDS
echo "[setup_env] installing torch==$TORCH_VERSION ..." >&2
"$VPY" -m pip install -qq "torch==$TORCH_VERSION"
echo "[setup_env] installing lightning-ulysses[test,bench,cli] (editable) ..." >&2
"$VPY" -m pip install -qq -e "$ROOT[test,bench,cli]"
# LitGPT is a test dependency (tests/test_model_forms.py trains its GPT under SP). Installed without its own
# requirements: litgpt 0.5.13 pins huggingface_hub<1.4, which transformers 5.23 outgrew; its model code needs only
# torch and lightning, which are here.
echo "[setup_env] installing litgpt==0.5.13 (test dependency, --no-deps) ..." >&2
"$VPY" -m pip install -qq --no-deps "litgpt==0.5.13"
# Fail loudly if anything replaced the pinned torch.
"$VPY" - "$TORCH_VERSION" <<'PY'
import sys
import torch
if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"[setup_env] expected torch {sys.argv[1]}, found {torch.__version__}")
PY
echo "$want" > "$STAMP"
echo "[setup_env] done in $((SECONDS - start)) s ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))" >&2
