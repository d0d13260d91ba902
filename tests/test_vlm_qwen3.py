"""Qwen3-VL (deepstack features), Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (gated delta nets and attention in the
decoder) train under SP as on one device: an image straddling the shard boundary, two images of different sizes, an
image and a video written per temporal patch with timestamps, padded rows with a text-only one; MoE with the router
loss on; the vision tower's weights included. SGD, fp32, 4 steps against plain transformers on one process."""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.support.vision import assert_trains_as_single_device, train_single_device
from tests.test_parity import rel_diff, update_rel_diff

SUPPORT = "tests.support.vision_qwen3"
RUNS = [("qwen3_vl", 2), ("qwen3_vl_moe", 2), ("qwen3_5", 2), ("qwen3_5_moe", 2), ("qwen3_vl", 3)]
PACKED = [4, 5]  # the packed-row batches (e) and (f)
RUNS_PACKED = [("qwen3_5", 2), ("qwen3_vl", 2)]


@pytest.fixture(scope="module")
def trained():
    return launch(2, "vision_language:run", {
        "runs": RUNS + [(family, stage, PACKED) for family, stage in RUNS_PACKED], "sp_size": 2, "support": SUPPORT,
        "strategy": {"sdpa_per_document": True}})  # packed rows on sdpa: one exact call per sample


@pytest.fixture(scope="module")
def references():
    return {family: train_single_device(family, support=SUPPORT) for family in {family for family, _ in RUNS}}


@pytest.mark.parametrize("family, stage", RUNS, ids=[f"{f}-zero{s}" for f, s in RUNS])
def test_training_matches_single_device(trained, references, family, stage):
    from tests.support.vision_qwen3 import build_model

    reference = references[family]
    initial = dict(build_model(family).named_parameters())
    vision = assert_trains_as_single_device(trained, reference, f"{family}-zero{stage}", initial, ("model.visual",))
    if family.startswith("qwen3_vl"):  # the deepstack mergers learn as on one device
        deepstack = {k: v for k, v in vision.items() if "deepstack_merger_list" in k}
        reference_deepstack = {k: reference["weights"][k] for k in deepstack}
        assert deepstack and update_rel_diff(deepstack, reference_deepstack, initial) <= 1e-4


@pytest.mark.parametrize("family, stage", RUNS_PACKED, ids=[f"{f}-zero{s}" for f, s in RUNS_PACKED])
def test_packed_rows_with_images_and_video_train_as_separate_rows(trained, family, stage):
    """Rows packing an image sample, a text-only sample and an image-and-video sample with ``[4, 1, S]`` positions:
    no sample attends to (Qwen3.5: no gated delta net runs across) another, as the same samples in separate rows on
    one device."""
    from tests.support.vision_qwen3 import build_model

    reference = train_single_device(family, select=PACKED, support=SUPPORT)
    key = f"{family}-zero{stage}-45"
    for rank in trained:
        assert rel_diff(rank[key]["losses"], reference["losses"]) <= 1e-5, (rank[key]["losses"], reference["losses"])
    initial = dict(build_model(family).named_parameters())
    assert update_rel_diff(trained[0][key]["weights"], reference["weights"], initial) <= 1e-4


def test_the_vision_work_is_split_and_every_feature_tensor_travels_in_one_exchange(trained):
    """Each rank encodes its share of the units (a video by temporal patch: its two on two ranks; a rank without a
    unit encodes a 4-row dummy), and the deepstack rows go in the merged rows' all-to-all: one per modality."""
    from tests.support.models import lightning_order
    from tests.support.vision import MERGE, SEED
    from tests.support.vision_qwen3 import batches

    every = batches()
    for step, index in enumerate(lightning_order(4, SEED)):
        batch = every[index]
        grids = [batch[key] for key in ("image_grid_thw", "video_grid_thw") if key in batch]
        calls = [rank["qwen3_vl-zero2"]["vision_steps"][step] for rank in trained]
        assert [rank["qwen3_vl-zero2"]["input_shapes"][step] for rank in trained] == [
            (batch["input_ids"].shape[0], -(-batch["input_ids"].shape[1] // 2))] * 2
        for modality, grid in enumerate(grids):
            encoded = [rank_calls["encoded_rows"][modality] for rank_calls in calls]
            units = [int(h * w) for t, h, w in grid.tolist() for _ in range(int(t))]
            assert sum(encoded) == sum(units) + (2 - min(len(units), 2)) * MERGE ** 2, (step, encoded, units)
            if modality == 1:
                assert encoded == units  # the video's two temporal patches on two ranks
        for rank_calls in calls:
            assert rank_calls["agreements"] == 1 and rank_calls["all_to_all"] == len(grids)


def _prepared_call(batch: dict):
    """A batch cut by the collate step and the step context of one process (sp=1: no exchange)."""
    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.training.step_context import StepContext

    shard = shard_batch(batch, 1, 0)
    info = shard.pop("_ulysses")
    named = dict(shard, position_ids=info.position_ids)
    return named, info, StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_a_single_process_call_places_every_feature_row_as_the_model_does(family):
    """sp=1 through the same path (positions from the whole batch, rows in token order, deepstack rows with them):
    the model's output equals its own forward on every batch."""
    import torch

    from lightning_ulysses.models import vision_language
    from tests.support.vision_qwen3 import batches, build_model

    model = build_model(family).eval()
    for batch in batches():
        named, info, context = _prepared_call(batch)
        vision_language.complete_call(model, named, info, context)
        assert named["position_ids"].shape == (4, *batch["input_ids"].shape)  # text positions first
        with torch.no_grad():
            ours = model(**{k: v for k, v in named.items() if k != "labels"}).logits
            theirs = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_deepstack_rows_reach_the_model_and_matter():
    """Qwen3-VL's call gets one deepstack tensor per tapped vision layer, a row per placeholder of the shard; without
    them (zeros) the logits change, so the parity runs check their placement."""
    import torch

    from lightning_ulysses.models import vision_language
    from tests.support.vision_qwen3 import batches, build_model

    model = build_model("qwen3_vl").eval()
    batch = batches()[2]  # an image and a video
    named, info, context = _prepared_call(batch)
    vision_language.complete_call(model, named, info, context)
    layers = len(model.config.vision_config.deepstack_visual_indexes)
    for modality, token in (("image", model.config.image_token_id), ("video", model.config.video_token_id)):
        output = named["mm_encoder_outputs"][modality]
        assert len(output.deepstack_features) == layers == 2
        for (rows,) in output.deepstack_features:
            assert rows.shape == (int((batch["input_ids"] == token).sum()), model.config.text_config.hidden_size)
    with torch.no_grad():
        ours = model(**{k: v for k, v in named.items() if k != "labels"}).logits
        for modality in ("image", "video"):
            output = named["mm_encoder_outputs"][modality]
            output.deepstack_features = [(torch.zeros_like(rows),) for (rows,) in output.deepstack_features]
        without = model(**{k: v for k, v in named.items() if k != "labels"}).logits
    assert (ours - without).abs().max() > 1e-3


def test_the_families_are_registered_and_unknown_ones_still_refused():
    from types import SimpleNamespace

    from lightning_ulysses.models import vision_language
    from tests.support.vision_qwen3 import batches

    assert {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"} <= set(vision_language.SUPPORTED_FAMILIES)
    named, info, context = _prepared_call(batches()[0])
    model = SimpleNamespace(config=SimpleNamespace(model_type="qwen3_omni_moe", vision_config=object()))
    with pytest.raises(ValueError, match=r"qwen3_omni_moe.*'qwen3_vl', 'qwen3_vl_moe'"):
        vision_language.complete_call(model, named, info, context)
