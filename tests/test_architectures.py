"""The architecture matrix: every tiny architecture of ``tests/architectures.py`` either trains at SP=2 exactly like
a plain single process (per-step losses within 1e-5, every parameter's weight update within 1e-4, relative) or
stops with a clear error before compute. One launch of 2 gloo processes runs them all."""

from __future__ import annotations

import pytest
import torch

from tests.architectures import ARCHITECTURES, train_plain
from tests.launcher import launch

STEPS, LR = 3, 0.5
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-4
EXACT = [n for n, e in ARCHITECTURES.items() if "expect" not in e]
REFUSED = [n for n, e in ARCHITECTURES.items() if "expect" in e]


@pytest.fixture(scope="module")
def results():
    by_rank = launch(2, "tests.scenarios_architectures:run",
                     {"names": list(ARCHITECTURES), "steps": STEPS, "lr": LR}, timeout=900)
    return {name: [r[name] for r in by_rank] for name in ARCHITECTURES}


def test_the_matrix_is_wide():
    assert len(ARCHITECTURES) >= 25 and len(EXACT) >= 25


@pytest.mark.parametrize("name", EXACT)
def test_architecture_trains_exactly(results, name):
    ranks = results[name]
    for r in ranks:
        assert r["error"] is None, r["error"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    reference = train_plain(name, STEPS, LR)
    got, want = torch.tensor(ranks[0]["losses"]), torch.tensor(reference["losses"])
    loss_diff = ((got - want).abs() / want.abs()).max().item()
    assert loss_diff <= LOSS_TOL, (got, want)
    worst, worst_name = 0.0, None
    for param, initial in reference["initial"].items():
        expected = reference["final"][param] - initial
        actual = ranks[0]["final"][param] - initial
        scale = expected.norm().item()
        diff = (actual - expected).norm().item()
        # An update that is numerically zero (e.g. a key bias: softmax ignores it) is compared absolutely.
        rel = diff / scale if scale > 1e-6 else diff / 1e-6
        if rel > worst:
            worst, worst_name = rel, param
    print(f"[measured] {name}: loss {loss_diff:.1e}, weight update {worst:.1e} ({worst_name})")
    assert worst <= UPDATE_TOL, (worst_name, worst)


@pytest.mark.parametrize("name", REFUSED)
def test_architecture_is_refused_before_compute(results, name):
    for r in results[name]:
        assert r["error"] is not None, f"{name} trained instead of being refused"
        assert r["error"].startswith("ValueError"), r["error"]
        assert ARCHITECTURES[name]["expect"] in r["error"], r["error"]
        assert "losses" not in r  # stopped before any step
