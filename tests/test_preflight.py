"""The pre-flight memory check (``memory_budget``, ``preflight``): before the first training step computes anything,
a step planned above the budget stops every rank with the plan and the changes that would fit; ``"warn"`` trains
with a warning; a budget above the plan trains untouched. One launch of 2 gloo processes (SP=2)."""

from __future__ import annotations

import pytest

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.plan import plan_memory
from tests.support.launcher import launch
from tests.support.models import TokenDataset, tiny_llama_config, tiny_qwen3_config, train_single_device

pytestmark = pytest.mark.multiprocess


def _planned_peak(stage: int) -> int:
    return plan_memory(tiny_llama_config(num_kv_heads=2), 64, sp_size=2, stage=stage, precision="32-true",
                       optimizer="sgd").peak


SEQ_LEN = 64  # the scenario's rows


def _between_sp1_and_sp2(config, stage: int) -> int:
    """A budget the plan at sp=2 fits and the plan at sp=1 does not (2 ranks, the row's length, Adam's states as the
    automatic choice counts them)."""
    peaks = [plan_memory(config, SEQ_LEN, sp_size=sp, world_size=2, stage=stage, precision="32-true",
                         optimizer="adamw").peak for sp in (1, 2)]
    assert peaks[1] < peaks[0], peaks
    return (peaks[0] + peaks[1]) // 2


AUTO_CASES = [
    {"name": "auto_llama_zero2", "stage": 2, "model": "llama", "strategy": {
        "sp_size": "auto", "sequence_length": SEQ_LEN,
        "memory_budget": _between_sp1_and_sp2(tiny_llama_config(num_kv_heads=2), 2)}},
    {"name": "auto_qwen3_zero3", "stage": 3, "model": "qwen3", "strategy": {
        "sp_size": "auto", "sequence_length": SEQ_LEN, "memory_budget": _between_sp1_and_sp2(tiny_qwen3_config(), 3)}},
    {"name": "auto_roomy_budget", "stage": 2, "model": "llama", "strategy": {
        "sp_size": "auto", "sequence_length": SEQ_LEN, "memory_budget": 1 << 40}},
    {"name": "auto_nothing_fits", "stage": 2, "model": "llama", "strategy": {
        "sp_size": "auto", "sequence_length": SEQ_LEN, "memory_budget": 1 << 20}},
]
RING_ALST = {"ring_size": 2, "tiled_mlp": "auto", "tiled_loss": "auto", "offload_checkpoints": True}


def _planned_ring_alst_peak(stage: int) -> int:
    return plan_memory(tiny_llama_config(num_kv_heads=2), 64, sp_size=2, ring_size=2, stage=stage, precision="32-true",
                       optimizer="sgd", tiled_mlp="auto", tiled_loss="auto", offload_checkpoints=True).peak


def _planned_hybrid_peak() -> int:
    from tests.support.architectures import build_config

    return plan_memory(build_config("qwen3_5_text"), 64, sp_size=2, stage=2, precision="32-true", optimizer="sgd").peak


CASES = [
    {"name": "stop_zero2", "stage": 2, "strategy": {"memory_budget": 1 << 20}},
    {"name": "stop_hybrid", "stage": 2, "model": "hybrid", "strategy": {"memory_budget": 1 << 20}},
    {"name": "fits_hybrid", "stage": 2, "model": "hybrid", "strategy": {"memory_budget": 2 * _planned_hybrid_peak()}},
    {"name": "stop_ring_alst", "stage": 2, "strategy": {**RING_ALST, "memory_budget": 1 << 20}},
    {"name": "fits_ring_alst", "stage": 3, "strategy": {**RING_ALST, "memory_budget": 2 * _planned_ring_alst_peak(3)}},
    {"name": "warn_zero3", "stage": 3, "strategy": {"memory_budget": 1 << 20, "preflight": "warn"}},
    {"name": "fits_zero2", "stage": 2, "strategy": {"memory_budget": 2 * _planned_peak(2)}},
    *AUTO_CASES,
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


def test_ring_attention_and_the_memory_switches_are_planned_and_checked(results):
    """With ring attention and the ALST switches the check plans the step as the run takes it (ring 2, tiled MLP and
    loss, offloaded checkpoints): over the budget it stops both ranks before any compute, within it trains."""
    for result in results["stop_ring_alst"]:
        assert result["error_type"] == "PreflightMemoryError", result["message"]
        assert "(ring 2)" in result["message"] and result["losses"] == [] and result["unchanged"], result["message"]
    for result in results["fits_ring_alst"]:
        assert result["error_type"] is None, result["message"]
        assert len(result["losses"]) == 3 and result["warnings"] == []


def test_a_hybrid_of_gated_delta_nets_is_checked_too(results):
    """A Qwen3.5-like hybrid (gated delta net and attention layers) is planned and checked like a dense model: over
    the budget both ranks stop before any compute, naming what fits; within it, it trains without a word."""
    for result in results["stop_hybrid"]:
        assert result["error_type"] == "PreflightMemoryError", result["message"]
        assert "Changes that fit:" in result["message"] and result["losses"] == [] and result["unchanged"]
    for result in results["fits_hybrid"]:
        assert result["error_type"] is None, result["message"]
        assert len(result["losses"]) == 3 and result["warnings"] == []


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


@pytest.mark.parametrize("name,model", [("auto_llama_zero2", "llama"), ("auto_qwen3_zero3", "qwen3")])
def test_auto_chooses_the_size_that_fits_and_trains_exactly(results, name, model):
    """sp_size="auto" under a budget that sp=2 fits and sp=1 does not: every rank chooses 2, and the training is the
    single device's (losses within 1e-5, weights within 1e-4, relative)."""
    config = tiny_qwen3_config() if model == "qwen3" else tiny_llama_config(num_kv_heads=2)
    reference = train_single_device(config, TokenDataset(3, SEQ_LEN), global_batch=1, steps=3)
    for result in results[name]:
        assert result["error_type"] is None, result["message"]
        assert result["chosen_sp_size"] == 2
        for got, want in zip(result["losses"], reference["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (result["losses"], reference["losses"])
    weights = results[name][0]["weights"]
    for key, want in reference["weights"].items():
        assert (weights[key] - want).norm() <= 1e-4 * want.norm(), key


def test_auto_takes_the_smallest_size_when_a_whole_row_fits(results):
    for result in results["auto_roomy_budget"]:
        assert result["error_type"] is None, result["message"]
        assert result["chosen_sp_size"] == 1  # two data-parallel replicas: the quickest estimate


def test_auto_with_nothing_fitting_stops_every_rank_before_any_weight_changes(results):
    for result in results["auto_nothing_fits"]:
        assert result["error_type"] == "ValueError", result["message"]
        assert "found no SP size that fits 64 tokens per row" in result["message"], result["message"]
        assert result["losses"] == [] and result["unchanged"]


def test_auto_settings_are_checked_at_construction():
    with pytest.raises(ValueError, match="pass `sequence_length=<tokens per row>` too"):
        UlyssesDeepSpeedStrategy(sp_size="auto")
    with pytest.raises(ValueError, match="chooses a Ulysses size only"):
        UlyssesDeepSpeedStrategy(sp_size="auto", sequence_length=4096, ring_size=2)
    with pytest.raises(ValueError, match="`sp_size` must be a positive integer, None or 'auto', got 'max'"):
        UlyssesDeepSpeedStrategy(sp_size="max")
    with pytest.raises(ValueError, match="sequence_length must be a positive number"):
        UlyssesDeepSpeedStrategy(sp_size="auto", sequence_length=0)
    strategy = UlyssesDeepSpeedStrategy(sp_size="auto", sequence_length=4096)
    with pytest.raises(RuntimeError, match="once the model is known"):
        strategy.sp_size
