"""Vision-language models train under SP as on one device: images whose placeholder tokens straddle the shard
boundary, several images of different sizes, a video, padded rows mixing text-only and image samples; the vision
tower's weights included. SGD, fp32, 4 steps against plain transformers on one process."""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.support.vision import train_single_device
from tests.test_parity import rel_diff, update_rel_diff

RUNS = [("qwen2_vl", 2), ("qwen2_5_vl", 2), ("qwen2_vl", 3)]


@pytest.fixture(scope="module")
def trained():
    return launch(2, "vision_language:run", {"runs": RUNS, "sp_size": 2})


@pytest.fixture(scope="module")
def references():
    return {family: train_single_device(family) for family in {family for family, _ in RUNS}}


@pytest.mark.parametrize("family, stage", RUNS, ids=[f"{f}-zero{s}" for f, s in RUNS])
def test_vision_language_training_matches_single_device(trained, references, family, stage):
    from tests.support.vision import build_model

    reference = references[family]
    for rank in trained:
        result = rank[f"{family}-zero{stage}"]
        assert rel_diff(result["losses"], reference["losses"]) <= 1e-5, (result["losses"], reference["losses"])
        assert result["vision_attention"] == "sdpa"  # given back after fit
    weights = trained[0][f"{family}-zero{stage}"]["weights"]
    initial = dict(build_model(family).named_parameters())
    assert any(name.startswith("model.visual") for name in weights)
    assert update_rel_diff(weights, reference["weights"], initial) <= 1e-4
    vision = {k: v for k, v in weights.items() if k.startswith("model.visual")}
    assert update_rel_diff(vision, {k: reference["weights"][k] for k in vision}, initial) <= 1e-4


def test_every_batch_is_cut_in_two(trained):
    from tests.support.models import lightning_order
    from tests.support.vision import SEED, batches

    every = batches()
    expected = [(every[i]["input_ids"].shape[0], -(-every[i]["input_ids"].shape[1] // 2)) for i in lightning_order(4, SEED)]
    for rank in trained:
        assert rank["qwen2_vl-zero2"]["input_shapes"] == expected
