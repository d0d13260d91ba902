#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in <repo>/.venv and install everything the example, the tests
# and the benchmarks need: exactly the tested stack of requirements/lock.txt.
#
#   bash scripts/setup_env.sh        # set up (a no-op when nothing changed)
#   source scripts/setup_env.sh      # set up, then activate .venv in the current shell
#
# Two stacks (ULYSSES_STACK):
#   locked (default)  requirements/lock.txt, version for version: any day gives the stack the suite passed on.
#                     1. torch at the lock's version first: on a GPU machine that pin resolves to the CUDA build from
#                        PyPI (with its nvidia-* packages); on a machine whose pip has a local CPU wheel (pip
#                        find-links) it resolves to that. An unpinned torch would pull the multi-GB CUDA wheels on a
#                        CPU-only machine: torch is never resolved freely.
#                     2. every other line of the lock with --no-deps (nothing is resolved: the lock is the closure);
#                     3. the package itself, editable, with --no-deps.
#   latest            the newest versions pyproject.toml's ranges admit (torch still pinned to the lock's): what a user
#                     who runs `pip install lightning-ulysses` today gets. Used by .ci/run's drift lane and by
#                     scripts/update_lock.sh, each in its own VENV_DIR; re-resolved on every run (no stamp).
#
# pip runs with -qq: errors still print, warnings (e.g. about unreachable extra index pages) do not.
# Re-runs of the locked stack are fast: $VENV_DIR/.setup-stamp holds a hash of pyproject.toml, the lock, the torch
# pin and the Python version, and the installs are skipped while it matches. Delete the stamp (or .venv) to force a
# reinstall.
# Environment: PYTHON (interpreter that creates the venv, default python3), ULYSSES_STACK, VENV_DIR, TORCH_VERSION
# (default: the lock's).
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
LOCK="$ROOT/requirements/lock.txt"
STACK="${ULYSSES_STACK:-locked}"
LOCKED_TORCH="$(sed -n 's/^torch==//p' "$LOCK")"
TORCH_VERSION="${TORCH_VERSION:-$LOCKED_TORCH}"
LITGPT_VERSION="$(sed -n 's/^litgpt==//p' "$LOCK")"
LITDATA_MINIMUM="0.2.76"  # the oldest litdata tests/test_litdata.py passed on
VENV_DIR="${VENV_DIR:-$ROOT/.venv}"
STAMP="$VENV_DIR/.setup-stamp"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ "$STACK" != "locked" && "$STACK" != "latest" ]]; then
    echo "[setup_env] ULYSSES_STACK must be 'locked' or 'latest', not '$STACK'" >&2
    exit 2
fi

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    echo "[setup_env] creating $VENV_DIR with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV_DIR"
fi
VPY="$VENV_DIR/bin/python"

want="$( { cat "$ROOT/pyproject.toml" "$LOCK"; echo "torch==$TORCH_VERSION $STACK"; "$VPY" --version 2>&1; } \
    | sha256sum | cut -d' ' -f1)"
if [[ "$STACK" == "locked" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
rm -f "$STAMP"

start=$SECONDS
echo "[setup_env] installing torch==$TORCH_VERSION ..." >&2
"$VPY" -m pip install -qq "torch==$TORCH_VERSION"
if [[ "$STACK" == "locked" ]]; then
    echo "[setup_env] installing the tested stack (requirements/lock.txt, --no-deps) ..." >&2
    grep -vE '^(torch|litgpt)==' "$LOCK" | "$VPY" -m pip install -qq --no-deps -r /dev/stdin
    echo "[setup_env] installing lightning-ulysses (editable, --no-deps) ..." >&2
    "$VPY" -m pip install -qq --no-deps -e "$ROOT"
else
    echo "[setup_env] installing lightning-ulysses[test,bench,cli] (editable) at the newest versions pyproject.toml" \
         "admits ..." >&2
    "$VPY" -m pip install -qq --upgrade --upgrade-strategy eager -c <(echo "torch==$TORCH_VERSION") \
        -e "$ROOT[test,bench,cli]"
    # litdata (tests/test_litdata.py): the newest release, without torchvision, which it declares but imports only for
    # images. PyPI's torchvision is built for the CUDA torch; next to a CPU torch it breaks `import lightning`
    # (torchmetrics imports it when present). Its other requirements first (the locked stack pins them), then itself.
    echo "[setup_env] installing litdata>=$LITDATA_MINIMUM (test dependency) without torchvision ..." >&2
    report="$(mktemp)"
    "$VPY" -m pip install -qq --dry-run --no-deps --ignore-installed --report "$report" "litdata>=$LITDATA_MINIMUM"
    mapfile -t litdata < <("$VPY" - "$report" <<'PY'
import json
import sys
from packaging.requirements import Requirement
metadata = json.load(open(sys.argv[1]))["install"][0]["metadata"]
print("litdata==" + metadata["version"])
for line in metadata.get("requires_dist", []):
    requirement = Requirement(line)
    wanted = requirement.marker is None or requirement.marker.evaluate()  # not an extra's requirement
    if wanted and requirement.name not in ("torch", "torchvision"):
        print(line)
PY
)
    rm -f "$report"
    "$VPY" -m pip install -qq -c <(echo "torch==$TORCH_VERSION") "${litdata[@]:1}"
    "$VPY" -m pip install -qq --no-deps "${litdata[0]}"
fi
# LitGPT is a test dependency (tests/test_model_forms.py trains its GPT under SP). Installed without its own
# requirements: litgpt 0.5.13 pins huggingface_hub<1.4, which transformers 5.23 outgrew; its model code needs only
# torch and lightning, which are here.
echo "[setup_env] installing litgpt==$LITGPT_VERSION (test dependency, --no-deps) ..." >&2
"$VPY" -m pip install -qq --no-deps "litgpt==$LITGPT_VERSION"
# Fail loudly if anything replaced the pinned torch, or (locked) if any installed version is not the lock's.
"$VPY" - "$TORCH_VERSION" "$STACK" "$LOCK" <<'PY'
import sys
from importlib.metadata import version
torch_pin, stack, lock = sys.argv[1:]
torch_version = version("torch").split("+")[0]
if torch_version != torch_pin:
    sys.exit(f"[setup_env] expected torch {torch_pin}, found {torch_version}")
if stack == "locked":
    pins = dict(line.strip().split("==") for line in open(lock) if "==" in line and not line.startswith("#"))
    pins.pop("torch")
    wrong = {name: (pin, version(name)) for name, pin in pins.items() if version(name) != pin}
    if wrong:
        sys.exit(f"[setup_env] installed versions differ from requirements/lock.txt (lock, installed): {wrong}")
PY
echo "$want" > "$STAMP"
echo "[setup_env] done in $((SECONDS - start)) s ($STACK stack: $("$VPY" - <<'PY'
from importlib.metadata import version
print(", ".join(f"{name} {version(name)}" for name in ("torch", "lightning", "deepspeed", "transformers")))
PY
))" >&2
