"""Post-training objectives under SP: DPO, IPO, SimPO, KTO, distillation from a frozen teacher of another width, a
reward model on a value head, embeddings with mean and last-token pooling (in-batch InfoNCE), and GRPO-style losses
with sequence-mean and token-mean normalisation: written with the strategy's sequence-level API, each trains exactly
as one device does (SGD, fp32, 4 steps, losses ≤ 1e-5 and updates ≤ 1e-4 relative) at ZeRO 2 and at ZeRO 3 with
parameters really partitioned. Written the one-device way (TRL's ``get_batch_logps`` on the shard), DPO and SimPO
stop on every rank before a weight changes, at the first step.
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
           "token_weight_from_shard"]
SHARD_WEIGHTS = ("row_weight_from_shard", "token_weight_from_shard")  # refused before the loss exists


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
    cases += [{"name": name, "objective": name, "stage": 2} for name in REFUSED]
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
    initial = _initial_weights(objective)
    for rank, results in enumerate(runs):
        result = results[name]
        assert result["error_type"] is None, result["message"]
        assert len(result["losses"]) == STEPS
        for ours, theirs in zip(result["losses"], reference["losses"]):
            assert abs(ours - theirs) <= LOSS_TOL * max(1.0, abs(theirs)), (rank, result["losses"],
                                                                             reference["losses"])
    weights = runs[0][name]["weights"]
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
    assert moved > 10 and worst <= UPDATE_TOL, (objective, stage, moved, worst, worst_name)


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
