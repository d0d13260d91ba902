"""Hybrid models (gated delta nets, Mamba2, short convolutions, lightning attention next to attention layers) and the
MoE router's load-balancing loss under SP: exact against one device at ZeRO 2 and 3, with packed documents, with
DP × SP, and the exchange of a mixer layer counted (one all-to-all of its projected channels in, one of its per-head
output back, each way; bytes are pinned in ``tests/test_mixer_exchange.py``).

The architecture matrix (``tests/test_architectures.py``) trains every family at ZeRO 2; this file adds the
harder settings, through the harness of ``tests/test_steps.py`` (same references, same tolerances).
"""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.test_steps import check_exact


def _case(arch: str, stage: int, name: str = "", **extra) -> dict:
    return {"name": f"{arch}{name}-zero{stage}", "arch": arch, "step": "model_loss", "stage": stage,
            "reference": "model_loss", **extra}


PACKED = dict(data="packed", reference="mask_and_labels", strategy={"sdpa_per_document": True})
CASES = [
    _case("qwen3_next", 3), _case("qwen3_5_text", 3), _case("olmo_hybrid", 3), _case("lfm2", 3), _case("minimax", 3),
    _case("bamba", 3), _case("mamba", 3), _case("falcon_h1", 3), _case("kimi_linear", 3), _case("jamba", 3),
    # every recurrence and convolution restarts at each packed document, as separate rows on one device
    _case("qwen3_next", 2, "-packed", **PACKED), _case("lfm2", 2, "-packed", **PACKED),
    _case("bamba", 2, "-packed", **PACKED), _case("jamba", 2, "-packed", **PACKED),
    _case("falcon_h1", 2, "-packed", **PACKED, lr=0.1), _case("falcon_h1_no_norm", 2, "-packed", **PACKED),
    # the ways users call the model (positions and shifted labels filled in) reach the mixers too
    _case("qwen3_next", 2, "-labels-no-positions", step="labels_no_positions"),
    # the MoE router's load-balancing loss from the whole batch (tests/support/architectures.py: coefficient 0.5)
    _case("qwen3_moe_aux_loss", 3), _case("granitemoehybrid", 3),
]
DP_CASES = [_case("qwen3_next", 2, "-dp2", global_batch=2), _case("lfm2", 3, "-dp2", global_batch=2),
            _case("qwen3_moe_aux_loss", 2, "-dp2", global_batch=2)]


@pytest.fixture(scope="module")
def results():
    by_rank = launch(2, "combined:run", {
        "fits": ["steps:run", {"cases": CASES}],
        "counts": ["architectures:mixer_collectives",
                   {"arch": "qwen3_next", "mixer_kind": "linear_attention", "mixer_layers": [1, 2]}],
        "counts_mamba2": ["architectures:mixer_collectives",
                          {"arch": "bamba", "mixer_layers": [1, 2], "recurrence": ("mamba2_chunk_scan", 0)}],
        "counts_lightning": ["architectures:mixer_collectives",
                             {"arch": "minimax", "mixer_kind": "linear_attention", "mixer_layers": [1, 2],
                              "recurrence": None}],
        "counts_mamba2_zero3": ["architectures:mixer_collectives",
                                {"arch": "bamba", "mixer_layers": [1, 2], "recurrence": ("mamba2_chunk_scan", 0),
                                 "stage": 3}],
        "counts_short_conv": ["architectures:mixer_collectives",
                              {"arch": "lfm2", "mixer_kind": "conv", "mixer_layers": [1, 2],
                               "recurrence": ("causal_conv1d_fn", 0)}],
        "counts_mamba1": ["architectures:mixer_collectives",
                          {"arch": "mamba", "mixer_layers": [1, 2], "recurrence": ("mamba_selective_scan", 0)}],
        "counts_zero3": ["architectures:mixer_collectives",
                         {"arch": "qwen3_next", "mixer_kind": "linear_attention", "mixer_layers": [1, 2],
                          "stage": 3}],
    }, timeout=900)
    return by_rank


@pytest.fixture(scope="module")
def dp_results():
    by_rank = launch(4, "steps:run", {"cases": DP_CASES}, timeout=900)
    return {name: [r[name] for r in by_rank] for name in by_rank[0]}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_hybrid_trains_like_one_device(results, index):
    case = CASES[index]
    check_exact(case, [rank["fits"][case["name"]] for rank in results])


@pytest.mark.parametrize("index", range(len(DP_CASES)), ids=[c["name"] for c in DP_CASES])
def test_hybrid_trains_like_one_device_with_data_parallel_replicas(dp_results, index):
    case = DP_CASES[index]
    check_exact(case, dp_results[case["name"]])


def _per_mixer_layer(counts: dict) -> tuple[dict, dict]:
    one, two = counts[1], counts[2]
    forward = {op: two["forward"].get(op, 0) - one["forward"].get(op, 0) for op in two["forward"]}
    backward = {op: two["backward"].get(op, 0) - one["backward"].get(op, 0) for op in two["backward"]}
    return {op: n for op, n in forward.items() if n}, {op: n for op, n in backward.items() if n}


def _agreed_per_layer_counts(results, name: str, label: str) -> tuple[list, dict, dict]:
    """Both ranks' counts of launch part ``name`` (equal on both), and the collectives one mixer layer adds."""
    counts = [rank[name] for rank in results]
    assert counts[0] == counts[1]
    forward, backward = _per_mixer_layer(counts[0])
    print(f"[measured] {label}, per mixer layer: forward {forward}, backward {backward}")
    return counts, forward, backward


def test_head_parallel_mixer_layer_collectives_and_heads(results):
    """ZeRO 0-2: a gated-delta-net layer runs half of its heads per rank over the whole sequence: one all-to-all of
    its projected channels in and one of its per-head output back forward, the same two backward (its gated norm
    runs on the shard after the exchange back); the recurrence sees 2 of the 4 value heads and all 32 positions."""
    counts, forward, backward = _agreed_per_layer_counts(results, "counts", "head-parallel gated delta net")
    assert forward == {"alltoall_base_": 2}
    assert backward.get("alltoall_base_") == 2 and "_allgather_base_" not in backward
    assert counts[0][1]["forward"]["alltoall_base_"] == 4  # the attention layer's two and the mixer's two
    assert counts[0][1]["recurrence_value_shapes"] == [(1, 32, 2, 16)]  # [B, S, heads of this rank, head dim]


@pytest.mark.parametrize("name, shape", [("counts_zero3", (1, 32, 2, 16)), ("counts_mamba2_zero3", (1, 32, 4, 16))])
def test_head_parallel_mixer_layer_at_zero3(results, name, shape):
    """ZeRO-3: the mixer's submodule weights are external parameters of the mixer (gathered for its whole forward and
    backward), so the recipes slice them and the full projections run on the shard as at the other stages: the
    recurrence sees half of the heads over all 32 positions, the channels travel by two all-to-alls (ZeRO-3's own
    parameter gathers are all-gathers, so those are not counted)."""
    counts = [rank[name] for rank in results]
    forward, _ = _per_mixer_layer(counts[0])
    assert forward.get("alltoall_base_") == 2 and "_reduce_scatter_base_" not in forward
    assert counts[0][1]["recurrence_value_shapes"] == [shape]


def test_head_parallel_mamba2_layer(results):
    """ZeRO 0-2: a Mamba2 layer with one head group (bamba) runs 4 of its 8 SSM heads per rank over all 32
    positions; B and C travel whole to every rank in the same all-to-all, and the gated norm over all heads runs on
    the shard after the exchange back (every channel there: no all-reduce)."""
    counts, forward, backward = _agreed_per_layer_counts(results, "counts_mamba2", "head-parallel Mamba2 (bamba)")
    assert forward == {"alltoall_base_": 2}
    assert backward.get("alltoall_base_") == 2 and "allreduce_" not in backward
    assert counts[0][1]["recurrence_value_shapes"] == [(1, 32, 4, 16)]  # [B, S, SSM heads of this rank, head dim]


def test_head_parallel_lightning_attention_layer(results):
    """Lightning attention (minimax) runs half of its heads per rank; its RMSNorm over every head's channels and the
    output gate run on the shard after the exchange back (a local norm on half of the heads is 37% off, checked by
    hand)."""
    counts, forward, backward = _agreed_per_layer_counts(results, "counts_lightning", "head-parallel lightning attention")
    assert forward == {"alltoall_base_": 2}
    assert backward.get("alltoall_base_") == 2 and "allreduce_" not in backward


def test_head_parallel_short_convolution_layer(results):
    """A short convolution (lfm2) runs half of its channels per rank over all 32 positions: two all-to-alls each way,
    nothing else."""
    counts, forward, backward = _agreed_per_layer_counts(results, "counts_short_conv", "head-parallel short conv")
    assert forward == {"alltoall_base_": 2}
    assert backward.get("alltoall_base_") == 2
    assert counts[0][1]["recurrence_value_shapes"] == [(1, 32, 32)]  # [B, channels of this rank of 64, S]


def test_head_parallel_mamba1_layer(results):
    """A Mamba1 layer runs half of its 128 inner channels per rank over all 32 positions; its x_proj contracts over
    every channel, so the ranks' partial products are all-reduced (one all-reduce each way) besides the two
    all-to-alls; its gate multiplies the scan's output on the shard after the exchange back."""
    counts, forward, backward = _agreed_per_layer_counts(results, "counts_mamba1", "head-parallel Mamba1")
    assert forward == {"alltoall_base_": 2, "allreduce_": 1}
    assert backward.get("alltoall_base_") == 2 and backward.get("allreduce_") == 1
    assert counts[0][1]["recurrence_value_shapes"] == [(1, 64, 32)]  # [B, channels of this rank, S]
