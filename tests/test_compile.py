"""``torch.compile`` of the model a user trains with the strategy (issue 61): ``model.compile()`` in the
LightningModule, 2 ranks, sp 2, against one uncompiled device (SGD, 3 steps, fp32): the same losses and weights. With
``aot_eager`` (dynamo and AOTAutograd, where the strategy's attention functions, all-to-alls, loss and hooks meet the
compiler) at ZeRO 2 and at ZeRO 3 with every parameter partitioned and ``offload_attention`` with the ALST switches;
with ``inductor`` (this CPU's C++ compiler) at ZeRO 2. The strategy's own code runs where dynamo breaks the graph: the
graphs compiled are counted (more than none)."""

from __future__ import annotations

import pytest
import torch

from tests.scenarios import compiled as scenario
from tests.support.launcher import launch
from tests.support.models import TokenDataset, build_llama, tiny_llama_config

SETTINGS = {
    "aot_eager zero2": {"backend": "aot_eager", "stage": 2},
    "aot_eager zero3 + offload_attention + ALST": {
        "backend": "aot_eager", "stage": 3, "offload_attention": 8, "tiled_mlp": 2, "offload_checkpoints": True,
        "config": {"stage3_param_persistence_threshold": 0}},
    "inductor zero2": {"backend": "inductor", "stage": 2},
}


def _one_device() -> dict:
    """Plain PyTorch and transformers, uncompiled: the same rows every step (one batch of both rows)."""
    model = build_llama(tiny_llama_config(num_kv_heads=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = TokenDataset(scenario.ROWS, scenario.SEQ_LEN)
    batch = {key: torch.stack([rows[i][key] for i in range(scenario.ROWS)]) for key in rows[0]}
    losses = []
    for _ in range(scenario.STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


@pytest.fixture(scope="module")
def trained():
    return launch(2, "compiled:run", {"settings": SETTINGS}, timeout=600), _one_device()


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_compiled_model_trains_as_one_uncompiled_device(trained, setting):
    by_rank, reference = trained
    for rank in by_rank:
        got = rank[setting]
        assert "error" not in got, got.get("error")
        assert got["graphs"] > 0  # dynamo compiled graphs of the model
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    weights = by_rank[0][setting]["weights"]
    worst = max(float((weights[k] - w).norm() / w.norm()) for k, w in reference["weights"].items())
    print(f"[measured] {setting}: losses {by_rank[0][setting]['losses']}, worst weight {worst:.1e},"
          f" graphs {by_rank[0][setting]['graphs']}")
    assert worst <= 1e-5, worst
