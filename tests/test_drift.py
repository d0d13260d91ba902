"""The tested stack and the run-time drift check.

* ``requirements/lock.txt``, ``pyproject.toml``'s ranges and ``lightning_ulysses.drift.tested_versions`` agree: the
  lock is what the suite runs on, the ranges stop at the newest minor release tested, the strategy knows the tested
  versions.
* :mod:`lightning_ulysses.drift.guard` in-process: no check at the tested versions; an untested version with its
  touch points unchanged gives one warning; a changed one raises, naming it and the tested versions, unless allowed.
* Through a real Trainer and Fabric on 2 gloo processes: a changed touch point on one rank stops both before any
  forward pass or weight change; untested-but-unchanged trains the same losses as the tested stack.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from lightning_ulysses.drift import guard, touch_points
from lightning_ulysses.drift.tested_versions import TESTED_VERSIONS
from tests.support.launcher import launch

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"


def _lock() -> dict[str, str]:
    return dict(line.strip().split("==") for line in LOCK.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in project["dependencies"]}


# ============================================================================================ the tested stack
def test_tested_versions_are_the_locks():
    lock = _lock()
    assert {package: lock[package] for package in TESTED_VERSIONS} == TESTED_VERSIONS


def test_the_lock_is_installed_here():
    """The suite runs on the lock (scripts/setup_env.sh installs it; the drift lane of .ci/run sets
    ULYSSES_STACK=latest and runs only the in-process tests, where this one is skipped)."""
    import os
    from importlib.metadata import version

    if os.environ.get("ULYSSES_STACK", "locked") != "locked":
        pytest.skip("the drift lane runs on the newest versions the ranges admit, not on the lock")
    wrong = {name: (pin, version(name).split("+")[0]) for name, pin in _lock().items()
             if version(name).split("+")[0] != pin}
    assert not wrong, f"installed versions differ from requirements/lock.txt (lock, installed): {wrong}"


def test_the_lock_pins_every_requirement_of_the_package_and_its_extras():
    lock = _lock()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [Requirement(r).name for r in project["dependencies"]]
    names += [Requirement(r).name for extra in ("test", "bench", "cli") for r in
              project["optional-dependencies"][extra]]
    assert not [name for name in names if name not in lock]


@pytest.mark.parametrize("package", ["transformers", "lightning", "deepspeed", "torch"])
def test_ranges_admit_the_tested_version_and_stop_at_its_minor_release(package):
    """Honest ranges: the tested version is inside, and the next minor release is not (its private APIs are not the
    ones the touch points pin)."""
    requirement = _requirements()[package]
    tested = Version(TESTED_VERSIONS[package])
    assert requirement.specifier.contains(tested), (str(requirement), tested)
    next_minor = Version(f"{tested.major}.{tested.minor + 1}.0")
    assert not requirement.specifier.contains(next_minor), (str(requirement), next_minor)


# ============================================================================================ the guard in-process
def _untested(**versions: str) -> dict[str, str]:
    return {**TESTED_VERSIONS, **versions}


def test_at_the_tested_versions_nothing_is_checked():
    report = guard.check_touch_points("trainer", installed=dict(TESTED_VERSIONS))
    assert report.untested == {} and report.checked == 0 and report.changed == []
    warned = []
    guard.enforce_tested_versions("trainer", None, False, warned.append, report=report)
    assert warned == []


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_an_untested_version_with_unchanged_touch_points_warns_once(front_end):
    report = guard.check_touch_points(front_end, tested=_untested(transformers="5.0.0", deepspeed="0.1.0"))
    points = [p for p in touch_points.REGISTRY if p.package in ("transformers", "deepspeed")
              and front_end in p.front_ends]
    assert report.checked == len(points) > 5 and report.changed == []
    warned = []
    guard.enforce_tested_versions(front_end, None, False, warned.append, report=report)
    assert len(warned) == 1 and "\n" not in warned[0]
    installed = guard.installed_versions()
    assert f"transformers {installed['transformers']} (tested: 5.0.0)" in warned[0]
    assert f"deepspeed {installed['deepspeed']} (tested: 0.1.0)" in warned[0]
    assert "lightning" not in warned[0].split(";")[1]  # only the untested ones are named as installed


def test_only_the_untested_librarys_touch_points_run():
    report = guard.check_touch_points("trainer", tested=_untested(torch="2.0.0"))
    assert report.checked == len([p for p in touch_points.REGISTRY if p.package == "torch"])


@pytest.fixture
def changed_engine_setup(monkeypatch):
    """Lightning's engine set-up as a new release would show it: another source digest."""
    name = "_setup_model_and_optimizer"
    monkeypatch.setitem(touch_points.LIGHTNING_ENGINE_SETUP, name,
                        ("0" * 16, touch_points.LIGHTNING_ENGINE_SETUP[name][1]))
    monkeypatch.delenv(guard.ALLOW_UNTESTED_ENV, raising=False)
    return f"lightning: DeepSpeedStrategy.{name}"


def test_a_changed_touch_point_stops_naming_it_and_the_tested_versions(changed_engine_setup):
    report = guard.check_touch_points("trainer", tested=_untested(lightning="2.5.0"))
    assert [point.name for point, _ in report.changed] == [changed_engine_setup]
    with pytest.raises(guard.UntestedVersionError) as raised:
        guard.enforce_tested_versions("trainer", None, False, lambda message: None, report=report)
    message = str(raised.value)
    assert changed_engine_setup in message and "source digest" in message
    assert "lightning==2.5.0" in message and f"transformers=={TESTED_VERSIONS['transformers']}" in message
    assert "Nothing was trained" in message and "allow_untested_versions=True" in message
    assert guard.ALLOW_UNTESTED_ENV in message and "pip install lightning==2.5.0" in message


def test_a_changed_touch_point_at_the_tested_version_is_the_suites_business(changed_engine_setup):
    """At the tested versions the guard checks nothing (the compat tests do): a run is not slowed by it."""
    assert guard.check_touch_points("trainer").changed == []


def test_the_fabric_front_end_checks_fabrics_touch_points(monkeypatch):
    monkeypatch.setitem(touch_points.FABRIC_OVERRIDDEN, "_initialize_engine", "0" * 16)
    tested = _untested(lightning="2.5.0")
    assert [p.name for p, _ in guard.check_touch_points("fabric", tested=tested).changed] == [
        "lightning: Fabric DeepSpeedStrategy._initialize_engine"]
    assert guard.check_touch_points("trainer", tested=tested).changed == []


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_going_on_at_ones_own_risk(changed_engine_setup, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv(guard.ALLOW_UNTESTED_ENV, "1")
    report = guard.check_touch_points("trainer", tested=_untested(lightning="2.5.0"))
    warned = []
    guard.enforce_tested_versions("trainer", None, how == "argument", warned.append, report=report)
    assert len(warned) == 1 and changed_engine_setup in warned[0] and "own risk" in warned[0]


def test_a_moved_module_is_a_change():
    point = touch_points.TouchPoint("x", "torch", touch_points.BOTH,
                                    lambda: __import__("torch.no_such_module"))
    assert point.problem().startswith("ModuleNotFoundError")


def test_the_check_costs_little():
    """Every touch point of every library, as when all four are untested: well under a second once per process (the
    first call of each imports nothing new: the strategy has imported the libraries already)."""
    all_untested = {package: "0" for package in guard.PACKAGES}
    guard.check_touch_points("trainer", tested=all_untested)  # warm: first-time imports of the checked modules
    report = guard.check_touch_points("trainer", tested=all_untested)
    assert report.checked >= 15 and report.seconds < 2.0, report.seconds


# ============================================================================================ real processes
CASES = [
    {"name": "tested"},
    {"name": "untested_unchanged", "untested": {"transformers": "5.0.0"}},
    {"name": "changed_on_one_rank", "untested": {"lightning": "2.5.0"}, "changed": True, "ranks": [1]},
    {"name": "changed_allowed", "untested": {"lightning": "2.5.0"}, "changed": True, "allow": True},
    {"name": "changed_allowed_by_environment", "untested": {"lightning": "2.5.0"}, "changed": True,
     "allow_env": True},
    {"name": "fabric_changed", "front_end": "fabric", "untested": {"lightning": "2.5.0"}, "changed": True},
]


@pytest.fixture(scope="module")
def drift_runs():
    return launch(2, "drift:run", {"cases": CASES}, timeout=600)


def test_untested_but_unchanged_trains_the_same_with_one_warning(drift_runs):
    for rank, results in enumerate(drift_runs):
        tested, untested = results["tested"], results["untested_unchanged"]
        assert tested["error_type"] is None and untested["error_type"] is None
        assert untested["losses"] == tested["losses"] and len(tested["losses"]) == 2
        assert tested["warnings"] == []
        assert len(untested["warnings"]) == (1 if rank == 0 else 0)  # rank zero's warning
    assert "(tested: 5.0.0)" in drift_runs[0]["untested_unchanged"]["warnings"][0]


def test_a_change_on_one_rank_stops_every_rank_before_any_compute(drift_runs):
    for rank, results in enumerate(drift_runs):
        result = results["changed_on_one_rank"]
        assert result["error_type"] == "UntestedVersionError", result
        assert result["steps"] == 0 and result["forwards"] == 0 and not result["weights_changed"]
    assert "DeepSpeedStrategy._setup_model_and_optimizer" in drift_runs[1]["changed_on_one_rank"]["message"]
    assert "Another rank" in drift_runs[0]["changed_on_one_rank"]["message"]


@pytest.mark.parametrize("case", ["changed_allowed", "changed_allowed_by_environment"])
def test_allowed_goes_on_with_the_changes_named(drift_runs, case):
    for rank, results in enumerate(drift_runs):
        result = results[case]
        assert result["error_type"] is None and result["losses"] == results["tested"]["losses"]
    assert re.search(r"own risk", drift_runs[0][case]["warnings"][0])


def test_fabric_stops_at_launch(drift_runs):
    for results in drift_runs:
        result = results["fabric_changed"]
        assert result["error_type"] == "UntestedVersionError"
        assert "Fabric DeepSpeedStrategy._initialize_engine" in result["message"]


def test_the_readme_states_the_tested_versions():
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("**Tested versions:**"))
    for package, tested in TESTED_VERSIONS.items():
        assert f"{package} {tested}" in line, (package, tested, line)
