"""Sequence mixers exchange their projected channels as Ulysses attention does (one all-to-all in, one back), not the
whole ``[B, S, H]`` input and output: per mixer layer every family sends about an attention layer's bytes of the same
width (at most 1.25×, less per rank as sp grows), a whole training step of the Qwen3.5-shaped hybrid of
``benchmarks/sweep.py`` about the Llama's, and no rank holds a ``[B, S, H]`` tensor. One launch per process count
(sp = 2 and 4); exactness of the full training runs stays with ``tests/test_mixers.py`` and
``tests/test_architectures.py``; here every layer is also compared with itself whole (output, input and every
parameter gradient).

Bytes per rank, ring accounting (``tests/support/mixer_exchange.py``): an all-to-all sends ``(sp - 1)/sp`` of its
input, an all-gather / reduce-scatter ``(sp - 1)/sp`` of the full tensor, an all-reduce twice that. An MHA layer of
width ``H`` sends ``8 · (sp - 1)/sp · s · H`` values (q, k, v and o, forward and backward).
"""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.support.mixer_exchange import FAMILY_CONFIGS, WITHIN_ATTENTION

SPS = (2, 4)


@pytest.fixture(scope="module")
def by_sp():
    return {2: launch(2, "mixer_exchange:run", {"toys": True}, timeout=600),
            4: launch(4, "mixer_exchange:run", {}, timeout=600)}


def _layers(by_sp, sp: int, rank: int = 0) -> dict:
    return by_sp[sp][rank]["layers"]


def _ratio(by_sp, sp: int, name: str, rank: int = 0) -> float:
    family = _layers(by_sp, sp, rank)["families"][name]
    return sum(family["sent"].values()) / _layers(by_sp, sp, rank)["attention"][family["hidden"]]


@pytest.mark.parametrize("sp", SPS)
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_layer_is_exact_and_exchanges_its_channels(by_sp, sp, name):
    """Output, input gradient and every parameter gradient as the layer whole; all-to-alls only (Mamba1: and its
    x_proj all-reduce), no fallback to the gather path."""
    for rank in range(sp):
        family = _layers(by_sp, sp, rank)["families"][name]
        assert not family["missing"] and not family["warnings"], family
        worst = max(family["differences"].values())
        assert worst <= 1e-4, family["differences"]
        expected_ops = {"all_to_all", "all_reduce"} if name.startswith("Mamba1") else {"all_to_all"}
        assert set(family["sent"]) == expected_ops, family["sent"]


@pytest.mark.parametrize("name", WITHIN_ATTENTION)
def test_layer_bytes_within_attention(by_sp, name):
    ratios = {sp: max(_ratio(by_sp, sp, name, rank) for rank in range(sp)) for sp in SPS}
    sent = {sp: sum(_layers(by_sp, sp)["families"][name]["sent"].values()) for sp in SPS}
    print(f"[measured] {name}: bytes per rank per layer sp=2 {sent[2]}, sp=4 {sent[4]};"
          f" × attention {ratios[2]:.3f}, {ratios[4]:.3f}")
    assert all(ratio <= 1.25 for ratio in ratios.values()), ratios
    assert sent[4] < sent[2]  # per rank, falling with sp


@pytest.mark.parametrize("sp", SPS)
def test_norm_less_falcon_h1_bytes(by_sp, sp):
    """The exception, pinned: Falcon-H1 without its gated norm multiplies by ``silu(gate)`` inline, so its gate rows
    travel too (``2H`` more channels); from sp = 4 on still fewer bytes than the gather path (``sp/2`` ×)."""
    ratio = _ratio(by_sp, sp, "Mamba2 (falcon_h1, no norm)")
    print(f"[measured] Falcon-H1 without norm, sp={sp}: × attention {ratio:.3f}")
    assert ratio <= 1.65
    assert ratio < sp / 2 + 0.01 or sp == 2  # the gather path's sp/2 × attention


@pytest.mark.parametrize("sp", SPS)
def test_packed_documents_exact_with_one_exchange(by_sp, sp):
    """Packed documents: one exchange for the whole batch (the same bytes as one sequence), the mixer per document."""
    layers = _layers(by_sp, sp)
    packed, whole = layers["packed"], layers["families"]["gated delta net (qwen3_5)"]
    assert max(packed["differences"].values()) <= 1e-4 and not packed["warnings"]
    assert packed["sent"] == whole["sent"]


@pytest.mark.parametrize("name", ["gated delta net (qwen3_5)", "short convolution (lfm2)", "Mamba2 (bamba)"])
def test_largest_saved_tensor_is_a_channel_shard(by_sp, name):
    """Over 2048 tokens at width 128 the largest tensor autograd keeps is this rank's projected channels over the
    sequence (``S · D/sp``: the narrowed projection's output), falling as 1/sp; never the ``[B, S, H]`` input."""
    largest = {}
    for sp in SPS:
        saved = _layers(by_sp, sp)["saved"][name]
        nbytes, shape = saved["largest"]
        largest[sp] = nbytes
        assert max(saved["differences"].values()) <= 1e-4
        bound = 2048 * max(saved["narrowed"], saved["hidden"] // sp * 2) * 4
        print(f"[measured] {name} sp={sp}: largest saved {nbytes} bytes {shape}; S·H = {2048 * saved['hidden'] * 4}")
        assert nbytes <= bound, (shape, saved)
    assert largest[4] <= 0.6 * largest[2]
    if name != "Mamba2 (bamba)":  # Mamba2's projection is 2·d + ... = 4H wide: at sp=4 its shard is ~H
        assert largest[4] < 2048 * _layers(by_sp, 4)["saved"][name]["hidden"] * 4


@pytest.mark.parametrize("sp", SPS)
def test_training_step_bytes_within_llama(by_sp, sp):
    """A whole training step (forward and backward) of the sweep's Qwen3.5-shaped hybrid (3 gated-delta-net layers
    to 1 attention layer) sends at most 1.25× the Llama's exchange bytes."""
    steps = by_sp[sp][0]["steps"]
    for arch in ("qwen3_5", "llama"):
        assert steps[arch]["error"] is None, steps[arch]["error"]
        assert not [w for w in steps[arch]["warnings"] if "gather path" in w]
    hybrid, llama = sum(steps["qwen3_5"]["sent"].values()), sum(steps["llama"]["sent"].values())
    print(f"[measured] training step sp={sp}: Qwen3.5-shaped {hybrid} bytes, Llama {llama} bytes per rank"
          f" ({hybrid / llama:.3f}×)")
    assert llama > 0 and hybrid <= 1.25 * llama


def test_mixer_that_transforms_its_input_runs_the_gather_path_loudly(by_sp):
    """A mixer whose forward scales its input before projecting it cannot take the exchange: it says so and runs the
    gather path, training as the unmodified model does."""
    toys = by_sp[2][0]["toys"]
    plain, transforms = toys["plain"], toys["transforms"]
    assert plain["error"] is None and transforms["error"] is None, (plain["error"], transforms["error"])
    assert not [w for w in plain["warnings"] if "gather path" in w]
    assert [w for w in transforms["warnings"] if "gather path" in w and "transformed its input" in w]
    for a, b in zip(plain["losses"], transforms["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_mixer_that_reads_its_input_is_stopped_by_the_model_form_check(by_sp):
    """A mixer that uses its input's content beyond its projections gets NaN from the placeholder: the model-form
    check stops the fit before the first step, naming the module."""
    for rank in by_sp[2]:
        reads = rank["toys"]["reads"]
        assert reads["error"] is not None and "conv" in reads["error"], reads["error"]
        assert reads["losses"] == []
