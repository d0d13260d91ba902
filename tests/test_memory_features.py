"""ALST memory switches keep gradient parity with the single-device run (SGD, fp32, 4 steps): tiled MLP, tiled
logits + loss, checkpoint offload, and all three together, at ZeRO 2 and 3 with SP=2."""

import pytest

from tests.launcher import launch
from tests.test_parity import STEPS, _run, check_against_reference

FEATURES = {
    "tiled-mlp": {"tiled_mlp": 4},
    "tiled-loss": {"tiled_loss": 4},
    "offload-checkpoints": {"offload_checkpoints": True},
    "all": {"tiled_mlp": 4, "tiled_loss": 4, "offload_checkpoints": True},
}
RUNS = {f"{name}-zero{stage}": _run(stage, 2, sp_size=2, batch_size=1, num_rows=STEPS, strategy=features)
        for stage in (2, 3) for name, features in FEATURES.items()}


@pytest.fixture(scope="module")
def results():
    return launch(2, "parity", {"runs": list(RUNS.values())})


@pytest.mark.parametrize("name", list(RUNS))
def test_memory_feature_keeps_parity(results, name):
    index = list(RUNS).index(name)
    check_against_reference(RUNS[name], [rank["runs"][index] for rank in results], global_batch=1)
    features = RUNS[name]["strategy"]
    active = results[0]["runs"][index]["features_active"]  # during training, on the real model
    assert active == {"tiled_mlps": 2 if features.get("tiled_mlp") else 0,  # both decoder layers
                      "forward_replaced": bool(features.get("tiled_loss") or features.get("offload_checkpoints")),
                      "gradient_checkpointing": bool(features.get("offload_checkpoints"))}
