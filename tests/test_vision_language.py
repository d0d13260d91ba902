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


def test_the_vision_work_is_split_over_the_ranks_and_exchanged_once_per_modality(trained):
    """Each rank encodes its share of the batch's vision units (an image whole, a video by temporal patch; a rank
    without a unit encodes a 4-row dummy), so the ranks' encoded rows add up to the batch's patches plus the dummies;
    the two temporal patches of the video go to different ranks. Per step the vision path issues one agreement
    all-reduce and one feature all-to-all per modality present."""
    from tests.support.models import lightning_order
    from tests.support.vision import MERGE, SEED, batches

    every = batches()
    for step, index in enumerate(lightning_order(4, SEED)):
        batch = every[index]
        grids = [batch[key] for key in ("image_grid_thw", "video_grid_thw") if key in batch]
        calls = [rank["qwen2_vl-zero2"]["vision_steps"][step] for rank in trained]
        for modality, grid in enumerate(grids):
            encoded = [rank_calls["encoded_rows"][modality] for rank_calls in calls]
            units = [int(h * w) for t, h, w in grid.tolist() for _ in range(int(t))]
            dummies = 2 - min(len(units), 2)  # ranks without a unit of their own
            assert sum(encoded) == sum(units) + dummies * MERGE ** 2, (step, encoded, units)
            if "video_grid_thw" in batch and modality == 1:
                assert encoded == [units[0], units[1]]  # the video's two temporal patches on two ranks
        for rank_calls in calls:
            assert rank_calls["agreements"] == 1 and rank_calls["all_to_all"] == len(grids)
