"""Say which releases of torch, Lightning, DeepSpeed and transformers are newer than what pyproject.toml admits:
upstream drift that the ranges keep out today and that the next ``scripts/update_lock.sh`` (after raising a bound)
would take in. Information only: always exits 0; a registry that cannot be asked is said so.

    .venv/bin/python scripts/upstream_releases.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]


def available(package: str) -> list[Version]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True, text=True,
                         timeout=120).stdout
    match = re.search(r"Available versions: (.*)", out)
    versions = []
    for text in (match.group(1).split(", ") if match else []):
        try:
            versions.append(Version(text))
        except InvalidVersion:
            pass
    return versions


def main() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = {Requirement(r).name: Requirement(r) for r in dependencies}
    for package in ("torch", "lightning", "deepspeed", "transformers"):
        try:
            versions = [v for v in available(package) if not v.is_prerelease]
        except (OSError, subprocess.SubprocessError) as err:
            print(f"[upstream] {package}: the registry could not be asked ({err})")
            continue
        if not versions:
            print(f"[upstream] {package}: the registry could not be asked")
            continue
        specifier = requirements[package].specifier
        admitted = max((v for v in versions if specifier.contains(v)), default=None)
        beyond = sorted(v for v in versions if admitted is None or v > admitted)
        note = (f"newer, outside the range (untested): {', '.join(map(str, beyond))}" if beyond
                else "nothing newer")
        print(f"[upstream] {package}{specifier}: newest admitted {admitted}; {note}")


if __name__ == "__main__":
    main()
