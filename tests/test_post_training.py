"""Post-training objectives under SP: DPO, IPO, SimPO, KTO, distillation from a frozen teacher of another width, a
reward model on a value head, embeddings with mean and last-token pooling (in-batch InfoNCE), and GRPO-style losses
with sequence-mean and token-mean normalisation: written with the strategy's sequence-level API, each trains exactly
as one device does (SGD, fp32, 4 steps, losses ≤ 1e-5 and updates ≤ 1e-4 relative) at ZeRO 2 and at ZeRO 3 with
parameters really partitioned. Written the one-device way (TRL's ``get_batch_logps`` on the shard), DPO and SimPO
stop on every rank before a weight changes, at the first step. So do row weights built from this rank's count,
``sequence_sum(ratio, mask * (adv / mask.sum(1))[:, None])``, which without the check train silently wrong weights
(measured); legitimate float weights pass the check (a direct test over a real gloo group).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.launcher import launch
from tests.support.models import lightning_order
from tests.support.objectives import (LEARNING_RATES, OBJECTIVES, OneDevice, build_models, collate_pairs,
                                      preference_rows, trainable, trained_weights)

LR = 0.2  # IPO's squared loss takes larger steps: tests/support/objectives.py's LEARNING_RATES
STEPS = 4
LOSS_TOL = 1e-5
UPDATE_TOL = 1e-4

PARITY = [(name, stage) for name in OBJECTIVES for stage in (2, 3)]
REFUSED = ["dpo_one_device_code", "simpo_one_device_code", "nan_everywhere", "row_weight_from_shard", "inf_everywhere",
           "token_weight_from_shard", "grpo_local_count"]
# refused before the loss exists
SHARD_WEIGHTS = ("row_weight_from_shard", "token_weight_from_shard", "grpo_local_count")
UNCHECKED = {"name": "grpo_local_count_unchecked", "objective": "grpo_local_count", "stage": 2,
             "strategy": {"check_sp_agreement": False}}


class Holder(torch.nn.Module):
    def __init__(self, objective: str) -> None:
        super().__init__()
        for name, model in build_models(classifier=objective.startswith("classifier")).items():
            setattr(self, name, model)


def one_device(objective: str, shuffled: bool = True) -> dict:
    """The objective on whole rows, plain PyTorch SGD over the same batches in the same order (the Trainer's
    shuffling sampler; ``shuffled=False``: the loader's order, as Fabric keeps it)."""
    module = Holder(objective)
    optimizer = torch.optim.SGD(trainable(module), lr=LEARNING_RATES.get(objective, LR))
    pairs = preference_rows()
    order = lightning_order(len(pairs)) if shuffled else list(range(len(pairs)))
    losses = []
    for step in range(STEPS):
        batch = collate_pairs([pairs[i] for i in order[2 * step: 2 * step + 2]])
        loss = OBJECTIVES[objective](OneDevice(), module, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    weights = {k: v.detach().clone() for k, v in trained_weights(module).items()}
    return {"losses": losses, "weights": weights}


@pytest.fixture(scope="module")
def runs():
    cases = [{"name": f"{name}_zero{stage}", "objective": name, "stage": stage} for name, stage in PARITY]
    cases += [{"name": name, "objective": name, "stage": 2} for name in REFUSED] + [UNCHECKED]
    return launch(2, "post_training:run", {"cases": cases}, timeout=1200)


def _initial_weights(objective: str) -> dict:
    return {k: v.detach().clone() for k, v in trained_weights(Holder(objective)).items()}


@pytest.mark.parametrize("objective,stage", PARITY)
def test_objective_trains_as_one_device(runs, objective, stage):
    _assert_one_device(runs, f"{objective}_zero{stage}", objective, stage, one_device(objective))


FABRIC = [("dpo", 3), ("reward", 2), ("grpo_sequence", 2)]


@pytest.fixture(scope="module")
def fabric_runs():
    cases = [{"name": f"{name}_zero{stage}", "objective": name, "stage": stage} for name, stage in FABRIC]
    return launch(2, "post_training:run_fabric", {"cases": cases}, timeout=900)


@pytest.mark.parametrize("objective,stage", FABRIC)
def test_objective_under_fabric_trains_as_one_device(fabric_runs, objective, stage):
    """The same API on Fabric's front end (``fabric.strategy.sequence_sum`` ...)."""
    _assert_one_device(fabric_runs, f"{objective}_zero{stage}", objective, stage,
                       one_device(objective, shuffled=False))


def _assert_one_device(runs, name, objective, stage, reference):
    for rank, results in enumerate(runs):
        result = results[name]
        assert result["error_type"] is None, result["message"]
        assert len(result["losses"]) == STEPS
        for ours, theirs in zip(result["losses"], reference["losses"]):
            assert abs(ours - theirs) <= LOSS_TOL * max(1.0, abs(theirs)), (rank, result["losses"],
                                                                             reference["losses"])
    moved, worst, worst_name = _update_error(runs[0][name]["weights"], reference, objective)
    assert moved > 10 and worst <= UPDATE_TOL, (objective, stage, moved, worst, worst_name)


def _update_error(weights, reference, objective) -> tuple[int, float, str]:
    """How many parameters the reference moves, and the worst relative difference of ``weights``' update to its."""
    initial = _initial_weights(objective)
    worst, moved, worst_name = 0.0, 0, None
    for name, theirs in reference["weights"].items():
        update_theirs = theirs - initial[name]
        update_ours = weights[name] - initial[name]
        scale = float(update_theirs.norm())
        if scale < 1e-6:  # unused by the objective (DPO's value head, a reward's LM head; the value head's bias,
            # which a difference of two scores cancels): only rounding moves it
            assert float(update_ours.norm()) <= 1e-6, name
            continue
        moved += 1
        error = float((update_ours - update_theirs).norm()) / scale
        if error > worst:
            worst, worst_name = error, name
    return moved, worst, worst_name


def test_the_loss_check_walks_a_handful_of_nodes(runs):
    """The shard-local-loss check visits the nodes between the loss and the SP reductions: a few dozen."""
    walked = {name: max(runs[0][f"{name}_zero2"]["walked"]) for name in OBJECTIVES}
    print(f"[measured] graph nodes the shard-local-loss check visits per step: {walked}")
    assert max(walked.values()) < 200, walked


def test_the_frozen_reference_runs_on_the_shard(runs):
    """The frozen reference of DPO is prepared like the policy: its decoder layers hold this rank's S/sp tokens, so its
    activation memory per rank is 1/sp of one device's (fp32 bytes of one layer's output printed)."""
    for rank in runs:
        result = rank["dpo_zero2"]
        shapes = [shape for shape in result["frozen_layer_outputs"] if shape[0] > 1]  # the model-form probe aside
        assert len(shapes) == STEPS
        for shape, padded in zip(shapes, result["step_lengths"]):
            assert shape[1] == padded // 2, (shape, padded)
    result = runs[0]["dpo_zero2"]
    shape = [s for s in result["frozen_layer_outputs"] if s[0] > 1][0]
    padded = result["step_lengths"][0]
    ours, whole = 4 * shape[0] * shape[1] * shape[2], 4 * shape[0] * padded * shape[2]
    print(f"[measured] frozen reference, one decoder layer's output per rank: {shape} = {ours} bytes at sp=2;"
          f" one device: [{shape[0]}, {padded}, {shape[2]}] = {whole} bytes")


@pytest.mark.parametrize("name", REFUSED)
def test_one_device_code_is_refused_on_every_rank_before_a_weight_changes(runs, name):
    for results in runs:
        result = results[name]
        expected = "ValueError" if name in SHARD_WEIGHTS else "SPLossMismatchError"
        assert result["error_type"] == expected, result
        assert result["weights_unchanged"], name
        # the first step (DPO's loss is log 2 on every rank there); the shard's weights stop before the loss exists
        assert len(result["losses"]) == (0 if name in SHARD_WEIGHTS else 1)
        assert "sequence_sum" in result["message"] and "sequence_mean" in result["message"]
    if name in SHARD_WEIGHTS:
        assert "sequence_count" in runs[0][name]["message"]
    if name == "dpo_one_device_code":  # its value is log 2 on every rank: only the graph shows it is shard-local
        assert "through local operations only" in runs[0][name]["message"]
    if name in ("nan_everywhere", "inf_everywhere"):
        assert "never counted as agreement" in runs[0][name]["message"]
        assert ("is inf on every rank" if name == "inf_everywhere" else "is nan on every rank") in runs[0][name]["message"]


def test_row_weights_from_the_shard_train_wrong_weights_without_the_check(runs):
    """What the row-weight check stops (issue 61): with the checks off, GRPO's row weights from this rank's count
    train without a sign of trouble (the same finite loss on both ranks), and the update is far from one device's
    with the whole row's count (the right form, ``grpo_row_weights``, is exact: the parity matrix)."""
    result = runs[0][UNCHECKED["name"]]
    assert result["error_type"] is None and len(result["losses"]) == STEPS, result["message"]
    assert runs[0][UNCHECKED["name"]]["losses"] == runs[1][UNCHECKED["name"]]["losses"]
    _, worst, worst_name = _update_error(result["weights"], one_device("grpo_row_weights"), "grpo_row_weights")
    print(f"[measured] GRPO row weights from this rank's count, checks off: update {worst:.3g} off one device's"
          f" (relative, worst parameter {worst_name})")
    assert worst > 0.1, worst


ROW_WEIGHTS_PASS = ("bool_mask", "float_mask", "mask_times_adv", "whole_row_count", "whole_row_count_float64",
                    "rounding_apart", "per_token", "lone_weights", "empty_on_one_rank", "local_count_equal_counts")
ROW_WEIGHTS_REFUSED = {"local_count": [0, 1, 3], "local_count_bf16": [0, 1, 3], "local_count_one_side_row": [1, 3]}


def test_row_weight_check_refuses_shard_counts_and_passes_the_rest():
    """``check_row_weights`` over a real gloo group of 2 (``tests/scenarios/post_training.py``'s cases): weights that
    are one value per row on each rank but a different one on each rank are refused on both ranks, naming the rows
    and the fix; bool and 0/1 masks, ``mask * adv[:, None]``, the whole row's count (also a rounding apart),
    per-token weights, lone weights and rows only one rank holds weights of pass."""
    by_rank = launch(2, "post_training:row_weights")
    assert by_rank[0].keys() == set(ROW_WEIGHTS_PASS) | set(ROW_WEIGHTS_REFUSED)
    for results in by_rank:
        for name in ROW_WEIGHTS_PASS:
            assert results[name] is None, (name, results[name])
        for name, rows in ROW_WEIGHTS_REFUSED.items():
            message = results[name]
            assert message is not None, name
            assert f"rows {', '.join(map(str, rows))};" in message, (name, message)
            assert "sequence_count(mask)" in message and "sequence_mean" in message, message
    assert by_rank[0] == by_rank[1]  # the same verdict and message on both ranks
