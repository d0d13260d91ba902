"""ALST memory switches keep gradient parity with the single-device run (SGD, fp32, 4 steps): tiled MLP, tiled
logits + loss, checkpoint offload, and all three together, at ZeRO 2 and 3 with SP=2; more tiles than
``torch.chunk`` would return; ``"auto"`` tile counts under ZeRO-3 with two replicas holding different lengths."""

import pytest
import torch

from lightning_ulysses.models import memory
from tests.support.launcher import launch
from tests.support.models import VarLenDataset, tiny_llama_config, train_on_batches
from tests.test_parity import STEPS, _run, check_against_reference
from tests.test_realdata import assert_same_training, ordered_batches

FEATURES = {
    "tiled-mlp": {"tiled_mlp": 4},
    "tiled-loss": {"tiled_loss": 4},
    "offload-checkpoints": {"offload_checkpoints": True},
    "all": {"tiled_mlp": 4, "tiled_loss": 4, "offload_checkpoints": True},
    # 12 tiles of a 16-token shard: torch.chunk would give 8 chunks (DeepSpeed's TiledMLP then never marks the
    # weight gradients ready for ZeRO's reduction); tensor_split gives exactly 12 (1-2 tokens each)
    "twelve-tiles": {"tiled_mlp": 12, "tiled_loss": 12},
}
RUNS = {f"{name}-zero{stage}": _run(stage, 2, sp_size=2, batch_size=1, num_rows=STEPS, strategy=features)
        for stage in (2, 3) for name, features in FEATURES.items()}

# Two replicas (dp=2, sp=1) reading rows of different lengths at ZeRO-3, every weight gathered per use
# (stage3_param_persistence_threshold=0): "auto" gives each rank ceil(len / hidden_size=64) MLP tiles, so the ranks must
# agree on the longest shard or they issue different numbers of ZeRO-3 gathers (a hang or garbage).
VARLEN = VarLenDataset([150, 40, 130, 70, 200, 20, 90, 60])
AUTO_CASES = {"dp2_auto_zero3": {"dataset": VARLEN, "sp_size": 1, "stage": 3,
                                 "strategy": {"tiled_mlp": "auto", "tiled_loss": "auto", "config": {
                                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                     "zero_allow_untested_optimizer": True}}}}


@pytest.fixture(scope="module")
def results():
    return launch(2, "parity:run", {"runs": list(RUNS.values())})


@pytest.fixture(scope="module")
def auto_results():
    return launch(2, "realdata:run", {"cases": AUTO_CASES})


@pytest.mark.parametrize("name", list(RUNS))
def test_memory_feature_keeps_parity(results, name):
    index = list(RUNS).index(name)
    check_against_reference(RUNS[name], [rank["runs"][index] for rank in results], global_batch=1)
    features = RUNS[name].strategy
    active = results[0]["runs"][index]["features_active"]  # during training, on the real model
    assert active == {"tiled_mlps": 2 if features.get("tiled_mlp") else 0,  # both decoder layers
                      "forward_replaced": bool(features.get("tiled_loss") or features.get("offload_checkpoints")),
                      "gradient_checkpointing": bool(features.get("offload_checkpoints"))}


def test_auto_tiles_agree_across_replicas_under_zero3(auto_results):
    reference = train_on_batches(tiny_llama_config(num_kv_heads=2), ordered_batches(VARLEN, 2))
    result = auto_results[0]["dp2_auto_zero3"]
    assert_same_training(result, reference)
    lengths = [[shape[1] for shape in rank["dp2_auto_zero3"]["input_shapes"]] for rank in auto_results]
    assert lengths[0] != lengths[1]  # the replicas really hold different lengths ...
    agreed = [max(pair) for pair in zip(*lengths)]
    for rank in auto_results:  # ... and tiled by the step's longest shard
        assert rank["dp2_auto_zero3"]["tile_shard_lens"] == agreed
    assert len({memory.tile_count("auto", n, 64) for n in agreed}) > 1  # several tile counts were exercised


def test_tile_counts():
    assert [memory.tile_count("auto", n, 64) for n in (1, 64, 65, 1000)] == [1, 1, 2, 16]
    assert memory.tile_count(6, 10, 64) == 6
    assert memory.tile_count(0, 10, 64) == 0


def test_tiled_mlp_matches_the_mlp_for_any_tile_count():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2)
    for batch, length, tiles in [(2, 10, 6), (1, 3, 5), (2, 17, 4), (1, 40, "auto")]:  # fewer tokens than tiles too
        reference, tiled = LlamaMLP(config).double(), LlamaMLP(config).double()
        tiled.load_state_dict(reference.state_dict())
        memory._tile_mlp(tiled, tiles, 16, None)
        x = torch.randn(batch, length, 16, dtype=torch.float64, requires_grad=True)
        x_tiled = x.detach().clone().requires_grad_()
        grad = torch.randn(batch, length, 16, dtype=torch.float64)
        reference(x).backward(grad)
        tiled(x_tiled).backward(grad)
        assert torch.allclose(x_tiled.grad, x.grad, rtol=0, atol=1e-12)
        for p_ref, p_tiled in zip(reference.parameters(), tiled.parameters()):
            assert torch.allclose(p_tiled.grad, p_ref.grad, rtol=0, atol=1e-12)
            assert p_tiled.ds_grad_is_ready  # the last tile released the gradient to ZeRO


@pytest.mark.parametrize("value", [-1, "all", True, 2.0])
def test_bad_tile_settings_fail_at_construction(value):
    with pytest.raises(ValueError, match=r"tiled_loss=.*number of tiles .* \"auto\""):
        memory.MemoryFeatures(tiled_loss=value)
