"""The communication cost of Ulysses attention, counted with PyTorch's CommDebugMode on real gloo processes and pinned:
per attention layer, one all-to-all for q/k/v (packed) and one for the output in forward, the same two in backward;
one all-reduce per step for the loss (sum and token count of the SP group). Per step, what the strategy's own code does
besides the model (entries, host syncs, collectives), counted by ``benchmarks/step_overhead.py``'s tracer."""

import pytest

from tests.support.launcher import launch

LAYERS = (2, 3)


@pytest.fixture(scope="module")
def counts():
    results = launch(2, "collectives:run", {"layers": list(LAYERS), "kv_heads": 2, "stage": 2})
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("layers", LAYERS)
def test_forward_collectives_per_layer(counts, layers):
    assert counts[layers]["forward"] == {"alltoall_base_": 2 * layers, "allreduce_": 1}


@pytest.mark.parametrize("layers", LAYERS)
def test_backward_all_to_all_per_layer(counts, layers):
    # DeepSpeed's own gradient reduction runs after backward hooks; the exchange's part is the all-to-alls.
    assert counts[layers]["backward"]["alltoall_base_"] == 2 * layers


@pytest.fixture(scope="module")
def step_counts():
    results = launch(2, "collectives:step_overhead", {"ring_sizes": [1, 2], "extra_forwards": [0, 2]})
    return results


# Per rank (ring ranks hold 1 or 2 contiguous runs of the row: the halo plan reads one more value on rank 0). Host
# syncs: the collate step's reads of the batch (largest position, packing, the halo plan's run starts on CPU), the
# loss check's reads, the parameter check's one read; none per model call (the batch's own positions and mask are recognised by their memory). Entries: Lightning's calls into the strategy (its hooks, 7 reads of
# handles_gradient_accumulation), the model's call completion (pre-hook, backbone hooks), the loss and its
# gradient-factor nodes (the attention function counts as the SP attention, not here).
EXPECTED_HOST_SYNCS = {1: [{"_local_scalar_dense": 7, "tolist": 8}] * 2,
                       2: [{"_local_scalar_dense": 9, "tolist": 8}, {"_local_scalar_dense": 8, "tolist": 8}]}
EXPECTED_ENTRIES = {"SequenceParallelLossFunction.__call__": 1, "StepState.__iter__": 1,
                    "UlyssesDeepSpeedStrategy.backward": 1, "UlyssesDeepSpeedStrategy.handles_gradient_accumulation": 7,
                    "UlyssesDeepSpeedStrategy.optimizer_step": 1, "UlyssesDeepSpeedStrategy.training_step": 1,
                    "ValueWithGradientOf.backward": 1, "_ScaledGradient.backward": 1, "_complete_hf_call": 1,
                    "_refuse_router_aux_loss": 1, "install_backbone_call_completion.<locals>.complete": 1,
                    "install_backbone_call_completion.<locals>.enter": 1,
                    "install_backbone_call_completion.<locals>.leave": 1}


def test_per_step_overhead_counts(step_counts):
    """What the strategy's own code does in a steady training step besides the model (counted by
    ``benchmarks/step_overhead.py``'s tracer, not timed), pinned: a new hook, host sync or collective in every step
    shows here first. Its time is measured by ``python benchmarks/step_overhead.py`` (≤ 1% of a step at S=4096 on the
    project's CPU, docs/performance.md); change these numbers only with a new measurement there."""
    for ring_size in (1, 2):
        for rank, result in enumerate(step_counts):
            c = result[ring_size]
            # the SP-peer batch check before the step, the strategy's loss (sum and count of the group), the check
            # that the peers' losses reach the same parameters (before backward), the loss check (after it)
            assert c["own_collectives"] == {"allreduce_": 4}, (ring_size, rank, c)
            assert c["own_host_syncs"] == EXPECTED_HOST_SYNCS[ring_size][rank], (ring_size, rank, c)
            assert c["own_entries"] == EXPECTED_ENTRIES, (ring_size, rank, c)


def test_host_syncs_and_collectives_do_not_grow_with_forward_calls(step_counts):
    """Two more forward passes in the step (without labels, given ``**batch``'s own positions and mask): the strategy's
    host syncs and collectives per step stay those of one forward (no per-call check reads the device)."""
    for ring_size in (1, 2):
        for rank, result in enumerate(step_counts):
            one, three = result[ring_size], result[(ring_size, 2)]
            assert three["own_host_syncs"] == one["own_host_syncs"], (ring_size, rank, one, three)
            assert three["own_collectives"] == one["own_collectives"], (ring_size, rank, one, three)
            assert three["own_entries"]["_complete_hf_call"] == 3  # the three calls were completed


def test_sp_attention_collectives_per_step(step_counts):
    """The SP attention's collectives in a whole step of 2 layers: Ulysses 2 all-to-alls per layer forward and 2
    backward; ring attention alone (ring_size = sp_size = 2) none (a Ulysses group of one rank exchanges nothing) and
    its passes: forward R - 1 = 1 K/V pass per layer, backward 1 K/V pass and R = 2 key/value-gradient passes, two
    tensors each."""
    for result in step_counts:
        assert result[1]["attention_collectives"] == {"alltoall_base_": 8}
        assert result[2]["attention_collectives"] == {"recv_": 16, "send": 16}
        # the ring's blocks are chosen from ring ranks, not from positions on the device: no host sync per block
        assert result[1]["attention_host_syncs"] == result[2]["attention_host_syncs"] == {}
