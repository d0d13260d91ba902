"""The run-time drift check: before the first step, a library installed at a version the suite never passed on has
its private touch points checked (:mod:`lightning_ulysses.drift.touch_points`), and a changed one stops the run.

* Every installed version is the tested one: nothing is checked (reading four versions costs microseconds).
* Some version is untested and every touch point of those libraries is unchanged: one warning line names the
  versions, and the run goes on.
* Some touch point changed: every rank stops (agreed through one all-reduce, so a node with another install stops its
  peers too) before any weight changes, naming each changed touch point and the tested versions.

``allow_untested_versions=True`` on the strategy, or ``LIGHTNING_ULYSSES_ALLOW_UNTESTED=1`` in the environment, turns
the stop into a warning: the run goes on at the user's own risk.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import torch

from lightning_ulysses.drift.tested_versions import TESTED_VERSIONS
from lightning_ulysses.drift.touch_points import PACKAGES, REGISTRY, TouchPoint

ALLOW_UNTESTED_ENV = "LIGHTNING_ULYSSES_ALLOW_UNTESTED"
SET_UP_COMMAND = "bash scripts/setup_env.sh (installs requirements/lock.txt)"


class UntestedVersionError(RuntimeError):
    """An installed library is at a version the suite never passed on and a private API the strategy relies on
    changed in it."""


def installed_versions() -> dict[str, str]:
    """The installed versions of torch, Lightning, DeepSpeed and transformers (local labels such as ``+cpu`` left
    out)."""
    found = {}
    for package in PACKAGES:
        try:
            found[package] = version(package).split("+")[0]
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def allowed_by_environment() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class DriftReport:
    """What the drift check found in this process."""

    installed: dict[str, str]
    tested: dict[str, str]
    changed: list[tuple[TouchPoint, str]] = field(default_factory=list)
    checked: int = 0
    seconds: float = 0.0

    @property
    def untested(self) -> dict[str, str]:
        """``{package: installed version}`` for every package not at its tested version."""
        return {p: v for p, v in self.installed.items() if v != self.tested.get(p)}

    def versions_line(self) -> str:
        return ", ".join(f"{p} {self.installed[p]} (tested: {self.tested.get(p)})" for p in self.untested)

    def tested_line(self) -> str:
        return ", ".join(f"{p}=={v}" for p, v in self.tested.items())

    def warning(self) -> str:
        return (f"lightning-ulysses was tested with {self.tested_line()}; installed here: {self.versions_line()}. "
                f"The {self.checked} private touch points the strategy uses in them are unchanged, so it goes on.")

    def error(self, allowed: bool) -> str:
        lines = "\n".join(f"  - {point.name}: {problem}" for point, problem in self.changed)
        head = (f"lightning-ulysses was tested with {self.tested_line()}; installed here: {self.versions_line()}. "
                f"{len(self.changed)} of the {self.checked} private touch points the strategy uses in them changed:\n"
                f"{lines}\n")
        if allowed:
            return head + f"Going on at your own risk ({ALLOW_UNTESTED_ENV} / allow_untested_versions=True): the " \
                          "training may be wrong without an error."
        return head + ("Nothing was trained. Install the tested versions (" + SET_UP_COMMAND + ", or pip install "
                       + " ".join(f"{p}=={v}" for p, v in self.tested.items() if p in self.untested)
                       + "), or, at your own risk, pass allow_untested_versions=True to the strategy or set "
                       + f"{ALLOW_UNTESTED_ENV}=1.")


def check_touch_points(front_end: str, installed: Optional[dict[str, str]] = None,
                       tested: Optional[dict[str, str]] = None,
                       registry: Optional[list[TouchPoint]] = None) -> DriftReport:
    """Run the touch-point checks of ``front_end`` (``"trainer"`` or ``"fabric"``) for every library whose installed
    version is not the tested one. In-process only: no collective."""
    report = DriftReport(installed if installed is not None else installed_versions(),
                         dict(tested if tested is not None else TESTED_VERSIONS))
    untested = report.untested
    if not untested:
        return report
    start = time.perf_counter()
    for point in registry if registry is not None else REGISTRY:
        if point.package in untested and front_end in point.front_ends:
            report.checked += 1
            problem = point.problem()
            if problem is not None:
                report.changed.append((point, problem))
    report.seconds = time.perf_counter() - start
    return report


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of the world (one all-reduce of one integer; ``flag`` alone without a
    process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    count = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(count)
    return bool(count.item())


def enforce_tested_versions(front_end: str, device: torch.device, allow_untested: bool,
                            warn, report: Optional[DriftReport] = None) -> DriftReport:
    """The drift check of one process, agreed over the world: raises :class:`UntestedVersionError` on every rank when
    any rank found a changed touch point (unless allowed); ``warn(message)`` (rank zero's warning) otherwise, once,
    when a version is untested. Every rank must call it: one all-reduce of one integer, also where every version is
    the tested one (another node may have other versions)."""
    report = report if report is not None else check_touch_points(front_end)
    allowed = allow_untested or allowed_by_environment()
    changed_somewhere = any_rank(bool(report.changed), device)
    if report.changed:
        if not allowed:
            raise UntestedVersionError(report.error(allowed=False))
        warn(report.error(allowed=True))
    elif changed_somewhere:
        if not allowed:
            raise UntestedVersionError(
                "Another rank found private touch points changed in its installed libraries (its error names them);"
                f" this rank's libraries are {', '.join(f'{p} {v}' for p, v in report.installed.items())}. Nothing"
                " was trained: install the same tested versions on every node (" + SET_UP_COMMAND + ").")
    elif report.untested:
        warn(report.warning())
    return report
