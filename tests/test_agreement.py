"""Nothing silent: SP peers that would train on different data stop with a clear error on every rank within seconds
(no hang); user hooks cannot drop the step state; the loss value is bitwise the same on every rank.

One launch of 2 real gloo processes (sp_size=2) runs every case through ``trainer.fit``
(``tests/scenarios/agreement.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.launcher import launch

CASES = [
    {"name": "baseline"},
    {"name": "own_world_sampler", "loader": "own_world_sampler"},
    {"name": "own_world_sampler_no_injection", "loader": "own_world_sampler",
     "trainer": {"use_distributed_sampler": False}},
    {"name": "own_dp_sampler", "loader": "own_dp_sampler"},
    {"name": "stream_equal", "loader": "stream_equal"},
    {"name": "stream_lengths", "loader": "stream_lengths"},
    {"name": "stream_counts", "loader": "stream_counts", "max_steps": 10},
    {"name": "crops_seeded_workers", "loader": "crops_seeded_workers", "seed_workers": True},
    {"name": "crops_global_rank_init", "loader": "crops_global_rank_init"},
    {"name": "crops_check_off", "loader": "crops_global_rank_init", "strategy": {"check_sp_agreement": False}},
    {"name": "unbatched", "loader": "unbatched"},
    {"name": "no_attention", "module": "no_attention"},
    {"name": "dataloader_iter", "module": "dataloader_iter"},
    {"name": "mask_4d", "loader": "mask_4d"},
    {"name": "accumulate2", "trainer": {"accumulate_grad_batches": 2}},
    {"name": "accumulate4", "max_steps": 2, "trainer": {"accumulate_grad_batches": 4}},
    {"name": "accumulate2_rebuilt_batch", "trainer": {"accumulate_grad_batches": 2}, "rebuild_batch": True},
    {"name": "accumulate4_zero3", "stage": 3, "max_steps": 2, "trainer": {"accumulate_grad_batches": 4}},
    {"name": "accumulate2_zero3", "stage": 3, "trainer": {"accumulate_grad_batches": 2}},
    # an MoE whose experts each rank's shard reaches differently: skipping an expert without tokens leaves its weights
    # out of one rank's graph (refused before backward); running it on an empty slice keeps them in (trains)
    {"name": "experts_skipped", "module": "experts_by_token", "skip_empty": True},
    {"name": "experts_skipped_zero3", "module": "experts_by_token", "skip_empty": True, "stage": 3},
    {"name": "experts_skipped_zero3_unchecked", "module": "experts_by_token", "skip_empty": True, "stage": 3,
     "strategy": {"check_model_form": False}},
    {"name": "experts_all_run", "module": "experts_by_token", "skip_empty": False},
]
WITHIN_SECONDS = 60  # a hang would last until gloo's 30-minute timeout (the launch itself is capped)


@pytest.fixture(scope="module")
def results():
    by_rank = launch(2, "agreement:run", {"cases": CASES}, timeout=900)
    return {case["name"]: [r[case["name"]] for r in by_rank] for case in CASES}


def _assert_trained(ranks, steps=4):
    for r in ranks:
        assert r["error_type"] is None, r["message"]
        assert r["global_step"] == steps
    assert ranks[0]["fingerprints"] == ranks[1]["fingerprints"]  # SP peers trained on the same full batches


def _assert_stopped(ranks, error_type, *phrases, max_steps_run=0):
    for r in ranks:
        assert r["error_type"] == error_type, (r["error_type"], r["message"])
        for phrase in phrases:
            assert phrase in r["message"], r["message"]
        assert r["steps"] <= max_steps_run
        assert r["seconds"] < WITHIN_SECONDS


def test_peers_agree_on_lightnings_own_sampler(results):
    _assert_trained(results["baseline"])
    assert len(set(results["baseline"][0]["fingerprints"])) == 4  # 4 different batches, each the same on both


def test_own_sampler_over_the_world_is_refused_before_compute(results):
    for name in ("own_world_sampler", "own_world_sampler_no_injection"):
        _assert_stopped(results[name], "ValueError", "splits the data over 2 replicas",
                        "num_replicas=trainer.strategy.dp_size, rank=trainer.strategy.dp_rank")


def test_own_sampler_over_the_dp_replicas_trains(results):
    _assert_trained(results["own_dp_sampler"])


def test_stream_split_by_global_rank_stops_every_rank(results):
    _assert_stopped(results["stream_equal"], "SPPeerMismatchError", "different full batches of the same shape",
                    "DistributedSampler", "IterableDataset", "check_sp_agreement=False")


def test_unequal_lengths_stop_before_the_exchange(results):
    # Without the check: gloo aborted in C++ inside the all-to-all ("Received data size doesn't match").
    _assert_stopped(results["stream_lengths"], "SPPeerMismatchError", "different shapes", "[1, 12]", "[1, 16]")


def test_unequal_batch_counts_stop_instead_of_hanging(results):
    _assert_stopped(results["stream_counts"], "SPPeerMismatchError", "ran out of batches", max_steps_run=2)


def test_seeded_workers_draw_the_same_random_crops_on_sp_peers(results):
    _assert_trained(results["crops_seeded_workers"])


def test_workers_seeded_by_global_rank_are_caught(results):
    _assert_stopped(results["crops_global_rank_init"], "SPPeerMismatchError", "different full batches")


def test_the_check_can_be_turned_off(results):
    ranks = results["crops_check_off"]
    for r in ranks:
        assert r["error_type"] is None and r["global_step"] == 4
        assert r["fingerprints"] == [None] * 4  # not even computed


# Setups refused before compute with a ValueError naming what to change: (case, phrases of the message).
REFUSALS = {
    "unbatched": ("batch_size=None", "batch_size=1"),
    "mask_4d": ("`attention_mask` is 4-D", "position_ids` that restart at 0"),  # from the user's collate_fn
    "no_attention": ("found no Hugging Face PreTrainedModel and no attention core", "attention_modules=[...]",
                     "sp_size=1"),
    "dataloader_iter": ("`dataloader_iter`", "Take `batch`"),  # a step that pulls batches itself
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_unsupported_setups_are_refused_before_compute(results, name):
    _assert_stopped(results[name], "ValueError", *REFUSALS[name])


def test_hook_that_rebuilds_the_batch_keeps_exact_accumulation(results):
    plain, rebuilt = results["accumulate2"], results["accumulate2_rebuilt_batch"]
    _assert_trained(plain)
    _assert_trained(rebuilt)
    assert rebuilt[0]["loss_bits"] == plain[0]["loss_bits"]
    for name, value in plain[0]["weights"].items():
        assert torch.equal(rebuilt[0]["weights"][name], value), name


@pytest.mark.parametrize("name, steps", [("accumulate2", 4), ("accumulate4", 2), ("accumulate2_zero3", 4),
                                         ("accumulate4_zero3", 2)])
def test_loss_value_is_bitwise_the_same_on_every_rank(results, name, steps):
    ranks = results[name]
    _assert_trained(ranks, steps)
    assert len(ranks[0]["loss_bits"]) == steps * (4 if "accumulate4" in name else 2)
    assert ranks[0]["loss_bits"] == ranks[1]["loss_bits"]


@pytest.mark.parametrize("name", ["experts_skipped", "experts_skipped_zero3_unchecked"])
def test_parameters_some_ranks_do_not_reach_stop_every_rank_before_backward(results, name):
    """Expert 1 gets no token of rank 0's shard and expert 0 none of rank 1's: without the check DeepSpeed's gradient
    buckets would differ between the ranks (summing different parameters' gradients, or aborting). At ZeRO 3 too, with
    the model-form check off (it stops the model first there, below)."""
    _assert_stopped(results[name], "SPLossMismatchError", "reaches different trainable parameters",
                    "run every expert", max_steps_run=1)
    assert all(r["global_step"] == 0 for r in results[name])  # no optimizer step
    assert "model.layers.0.mlp.experts.1.weight" in results[name][0]["message"]
    assert "model.layers.0.mlp.experts.0.weight" in results[name][1]["message"]


def test_skipped_experts_at_zero3_stop_before_any_weight_changes(results):
    """At ZeRO 3 the same model is stopped earlier, by the model-form check: its sharded probe (each rank calls one
    expert) differs from the whole one (both) by 1.0-1.2 at the experts, with ZeRO-3 gathering the parameters of a
    module call order that changes with the data (running every expert trains: `experts_all_run` at ZeRO 3 by hand).
    Stopped, not silent; the message's attribution to positions is not the cause (left open)."""
    for r in results["experts_skipped_zero3"]:
        assert r["error_type"] in ("SPLossMismatchError", "FormCheckFailed"), (r["error_type"], r["message"])
        assert r["global_step"] == 0


def test_every_expert_run_on_every_rank_trains(results):
    _assert_trained(results["experts_all_run"])
