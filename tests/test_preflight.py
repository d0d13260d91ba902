"""The pre-flight memory check (``memory_budget``, ``preflight``): before the first training step computes anything,
a step planned above the budget stops every rank with the plan and the changes that would fit; ``"warn"`` trains
with a warning; a budget above the plan trains untouched. One launch of 2 gloo processes (SP=2)."""

from __future__ import annotations

import pytest

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.plan import plan_memory
from tests.support.launcher import launch
from tests.support.models import tiny_llama_config

pytestmark = pytest.mark.multiprocess


def _planned_peak(stage: int) -> int:
    return plan_memory(tiny_llama_config(num_kv_heads=2), 64, sp_size=2, stage=stage, precision="32-true",
                       optimizer="sgd").peak


CASES = [
    {"name": "stop_zero2", "stage": 2, "strategy": {"memory_budget": 1 << 20}},
    {"name": "warn_zero3", "stage": 3, "strategy": {"memory_budget": 1 << 20, "preflight": "warn"}},
    {"name": "fits_zero2", "stage": 2, "strategy": {"memory_budget": 2 * _planned_peak(2)}},
]


@pytest.fixture(scope="module")
def results():
    by_rank = launch(2, "preflight:run", {"cases": CASES})
    return {case["name"]: [r[case["name"]] for r in by_rank] for case in CASES}


def test_a_step_over_the_budget_stops_every_rank_before_any_compute(results):
    for result in results["stop_zero2"]:
        assert result["error_type"] == "PreflightMemoryError", result["message"]
        message = result["message"]
        assert "more than the 0.00 GiB budget" in message and "| **peak** |" in message, message
        assert "Changes that fit:" in message and "sp_size" in message.split("Changes that fit:")[1], message
        assert result["losses"] == [] and result["unchanged"]


def test_warn_trains_and_says_so_once(results):
    rank0 = results["warn_zero3"][0]
    assert rank0["error_type"] is None, rank0["message"]
    assert len(rank0["losses"]) == 3 and not rank0["unchanged"]
    assert len(rank0["warnings"]) == 1 and "planned at" in rank0["warnings"][0], rank0["warnings"]


def test_a_step_within_the_budget_trains_untouched(results):
    for result in results["fits_zero2"]:
        assert result["error_type"] is None, result["message"]
        assert len(result["losses"]) == 3 and result["warnings"] == []


def test_bad_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match="preflight must be one of"):
        UlyssesDeepSpeedStrategy(sp_size=2, preflight="maybe")
    with pytest.raises(ValueError, match="memory_budget must be a positive number"):
        UlyssesDeepSpeedStrategy(sp_size=2, memory_budget=-1)
