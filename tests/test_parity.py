"""Training with sp_size=N is the training a single device runs: same per-step losses, same final weights.

SGD (Adam would hide a wrong gradient scale), fp32, several steps, every ZeRO stage, MHA/GQA/MQA, and DP×SP.
The reference is plain PyTorch + transformers on one process (no Lightning, no DeepSpeed), same init, same order.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.launcher import launch
from tests.support.models import TokenDataset, build_llama, tiny_llama_config, train_single_device
from tests.support.training import FitSpec

SEQ_LEN = 32
STEPS = 4
LR = 0.5
REL_TOL = 1e-5
STAGES = (0, 1, 2, 3)
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}


def _run(stage: int, kv_heads: int, sp_size: int, batch_size: int, num_rows: int, **options) -> FitSpec:
    return FitSpec(stage=stage, kv_heads=kv_heads, sp_size=sp_size, batch_size=batch_size, steps=STEPS,
                   seq_len=SEQ_LEN, num_rows=num_rows, lr=LR, **options)


SP2_RUNS = [_run(stage, kv, sp_size=2, batch_size=1, num_rows=STEPS) for stage in STAGES for kv in KV_HEADS.values()]
# A training_step that computes its loss from logits with `strategy.cross_entropy`, and rows whose second half carries
# no target (rank 1's shard has no valid token: it must contribute 0, not NaN), at the two gradient scales.
VARIANT_RUNS = {
    f"{name}-zero{stage}": _run(stage, 2, sp_size=2, batch_size=1, num_rows=STEPS, **options)
    for stage in (2, 3)
    for name, options in {"own-loss": {"own_loss": True}, "empty-shard": {"ignore_after": SEQ_LEN // 2}}.items()
}
# Gradient clipping by norm (DeepSpeed clips inside its engine; the norm must count each gradient once, not sp times).
VARIANT_RUNS.update({f"clip-zero{stage}": _run(stage, 2, sp_size=2, batch_size=1, num_rows=STEPS,
                                               trainer={"gradient_clip_val": 0.05}) for stage in (0, 2, 3)})
DP2_SP2_RUNS = [_run(stage, 2, sp_size=2, batch_size=2, num_rows=4 * STEPS) for stage in (2, 3)]


@pytest.fixture(scope="module")
def sp2_results():
    return launch(2, "parity:run", {"runs": SP2_RUNS})


@pytest.fixture(scope="module")
def variant_results():
    return launch(2, "parity:run", {"runs": list(VARIANT_RUNS.values())})


@pytest.fixture(scope="module")
def dp2_sp2_results():
    return launch(4, "parity:run", {"runs": DP2_SP2_RUNS})


def rel_diff(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).norm() / expected.norm()).item()


def update_rel_diff(weights: dict, reference: dict, initial: dict) -> float:
    """|(w - w0) - (w_ref - w0)| / |w_ref - w0| over all parameters: the error relative to what training changed."""
    num = sum(((weights[k].double() - reference[k].double()) ** 2).sum() for k in reference)
    den = sum(((reference[k].double() - initial[k].double()) ** 2).sum() for k in reference)
    return (num / den).sqrt().item()


def check_against_reference(run: FitSpec, results: list[dict], global_batch: int) -> None:
    config = tiny_llama_config(num_kv_heads=run.kv_heads, num_heads=run.num_heads)
    dataset = TokenDataset(run.num_rows, SEQ_LEN, ignore_after=run.ignore_after)
    clip = run.trainer.get("gradient_clip_val")
    reference = train_single_device(config, dataset, global_batch, STEPS, LR, clip_norm=clip)
    initial = dict(build_llama(config).named_parameters())
    sp = run.sp_size
    for rank, result in enumerate(results):
        assert len(result["losses"]) == STEPS
        # SP peers return the same full-sequence loss (not their shard's).
        assert result["losses"] == results[rank - rank % sp]["losses"], rank
    # Each DP replica's loss is its micro-batch's mean; with equal token counts their mean is the global loss.
    replica_losses = torch.tensor([r["losses"] for r in results[::sp]], dtype=torch.float64).mean(0)
    assert rel_diff(replica_losses, reference["losses"]) <= REL_TOL, (replica_losses, reference["losses"])
    assert abs(results[0]["logged_loss"] - reference["losses"][-1]) <= REL_TOL * reference["losses"][-1]
    assert update_rel_diff(results[0]["weights"], reference["weights"], initial) <= REL_TOL
    # The training actually moved the weights (a no-op run cannot pass the comparison above by accident).
    assert update_rel_diff(initial, reference["weights"], initial) == pytest.approx(1.0)


@pytest.mark.parametrize("index", range(len(SP2_RUNS)),
                         ids=[f"zero{r.stage}-{k}" for r in SP2_RUNS for k, v in KV_HEADS.items()
                              if v == r.kv_heads])
def test_sp2_matches_single_device(sp2_results, index):
    run = SP2_RUNS[index]
    check_against_reference(run, [rank["runs"][index] for rank in sp2_results], global_batch=1)


@pytest.mark.parametrize("name", list(VARIANT_RUNS))
def test_own_loss_helper_and_empty_shards_match_single_device(variant_results, name):
    index = list(VARIANT_RUNS).index(name)
    check_against_reference(VARIANT_RUNS[name], [rank["runs"][index] for rank in variant_results], global_batch=1)


@pytest.mark.parametrize("index", range(len(DP2_SP2_RUNS)), ids=[f"zero{r.stage}" for r in DP2_SP2_RUNS])
def test_dp2_sp2_matches_single_device_with_global_batch(dp2_sp2_results, index):
    run = DP2_SP2_RUNS[index]
    check_against_reference(run, [rank["runs"][index] for rank in dp2_sp2_results], global_batch=2 * 2)


def test_each_rank_holds_only_its_shard_and_attention_sees_the_full_sequence(sp2_results):
    """A strategy that skipped sequence parallelism (every rank computing everything) would pass the loss checks;
    these shapes cannot: inputs are S/sp long, attention runs on all S positions with heads/sp heads."""
    for rank in sp2_results:
        for run, result in zip(SP2_RUNS, rank["runs"]):
            assert set(result["input_shapes"]) == {(1, SEQ_LEN // 2)}
            assert result["attention_query_shapes"] == [(1, 4 // 2, SEQ_LEN, 16)]


def test_mesh_layout_dp2_sp2(dp2_sp2_results):
    meshes = [rank["runs"][0]["mesh"] for rank in dp2_sp2_results]
    assert [m["sp_group"] for m in meshes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [(m["dp_rank"], m["sp_rank"]) for m in meshes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(m["dp_size"] == 2 and m["dim_names"] == ("dp", "ring", "ulysses") for m in meshes)
    assert all(m["sp_mesh_group"] == m["sp_group"] for m in meshes)
    assert all(m["module_mesh_is_strategy_mesh"] for m in meshes)
    # ZeRO's batch arithmetic uses the data-parallel world: micro-batch 2 × accumulation 1 × dp 2.
    assert all(rank["runs"][0]["train_batch_size"] == 4 for rank in dp2_sp2_results)
    for rank in dp2_sp2_results:
        assert set(rank["runs"][0]["input_shapes"]) == {(2, SEQ_LEN // 2)}
