#!/usr/bin/env bash
# Move the tested stack forward: resolve the newest versions pyproject.toml's ranges admit (torch kept at the lock's
# version), run the WHOLE suite on them, and only if it passes rewrite requirements/lock.txt and
# lightning_ulysses/drift/tested_versions.py from what was installed.
#
#   bash scripts/update_lock.sh            # arguments go to pytest (e.g. -x)
#
# To take a new minor release (e.g. transformers 5.25), raise its upper bound in pyproject.toml first, then run this;
# a failing touch point (tests/test_compat.py) names what changed upstream. Runs in its own environment
# (VENV_DIR, default .venv-latest), so .venv keeps the current lock until the next scripts/setup_env.sh. About as long
# as the suite (15 minutes on 2 cores) plus a minute of set-up.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ULYSSES_STACK=latest VENV_DIR="${VENV_DIR:-$ROOT/.venv-latest}"
cd "$ROOT"
bash scripts/run_tests.sh "$@"
"$VENV_DIR/bin/python" - "$ROOT" <<'PY'
import subprocess
import sys
from pathlib import Path

root = Path(sys.argv[1])
lock = root / "requirements" / "lock.txt"
header = [line for line in lock.read_text().splitlines() if line.startswith("#")]
frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                        capture_output=True, text=True).stdout.splitlines()
pins = sorted((line.split("+")[0] for line in frozen if "==" in line and not line.startswith("#")),
              key=str.lower)
lock.write_text("\n".join(header + pins) + "\n")
versions = dict(pin.split("==") for pin in pins)
tested = root / "lightning_ulysses" / "drift" / "tested_versions.py"
text = tested.read_text()
start = text.index("TESTED_VERSIONS = {")
body = "".join(f'    "{name}": "{versions[name]}",\n' for name in ("torch", "lightning", "deepspeed", "transformers"))
tested.write_text(text[:start] + "TESTED_VERSIONS = {\n" + body + "}\n")
print("[update_lock] requirements/lock.txt and tested_versions.py rewritten:",
      ", ".join(f"{n} {versions[n]}" for n in ("torch", "lightning", "deepspeed", "transformers")))
PY
