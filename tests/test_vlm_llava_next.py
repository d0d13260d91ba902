"""LLaVA-NeXT and LLaVA-OneVision train under SP as on one device: any-resolution images cut into tiles, each giving
as many feature rows as its unpadded grid (with image-newline rows) makes, one straddling the shard boundary, images
of different tile counts, OneVision's multi-image rows (base tiles only) and a video spread over the ranks by frame,
padded rows with a text-only one; the vision tower's weights included. SGD, fp32, 4 steps against plain transformers
on one process; all fits in one 2-process launch."""

from __future__ import annotations

import pytest
import torch

from tests.support.launcher import launch
from tests.support.vision import assert_trains_as_single_device, train_single_device
from tests.support.vision_llava_next import FAMILIES, batches, build_model

SUPPORT = "tests.support.vision_llava_next"
RUNS = [("llava_next", 2), ("llava_onevision", 2), ("llava_onevision", 3)]


@pytest.fixture(scope="module")
def trained():
    return launch(2, "vision_language:run", {"runs": RUNS, "sp_size": 2, "support": SUPPORT})


@pytest.fixture(scope="module")
def references():
    return {family: train_single_device(family, support=SUPPORT) for family in FAMILIES}


@pytest.mark.parametrize("family, stage", RUNS, ids=[f"{f}-zero{s}" for f, s in RUNS])
def test_training_matches_single_device(trained, references, family, stage):
    reference = references[family]
    initial = dict(build_model(family).named_parameters())
    vision = assert_trains_as_single_device(trained, reference, f"{family}-zero{stage}", initial,
                                            ("model.vision_tower", "model.image_newline"))
    assert len(vision) > 10 and "model.image_newline" in vision
    assert (reference["weights"]["model.image_newline"] - initial["model.image_newline"]).abs().max() > 0


def test_the_images_and_frames_are_split_and_the_collectives_pinned(trained):
    """Per step, per rank: one agreement all-reduce; for images one row-count all-reduce (an image's rows are known
    only after encoding) and one all-to-all; for OneVision's video one all-to-all (a frame's rows are fixed). The
    tiles the two ranks encode add up to the batch's units' (an image's tiles; OneVision's row of two images: their
    base tiles), plus a blank image's on a rank without a unit; (b)'s two images of different tile counts go to
    different ranks, and the video's three frames are spread (2 + 1)."""
    from lightning_ulysses.families.vision import IMAGE, family_of
    from tests.support.models import lightning_order
    from tests.support.vision import SEED

    for family, stage in RUNS:
        inner, adapter, every = build_model(family).model, family_of(family), batches(family)
        blank = int(adapter.dummy_inputs(inner, IMAGE)["pixel_values"].shape[1])
        for step, index in enumerate(lightning_order(4, SEED)):
            batch = every[index]
            named, info, _ = _prepared_call(batch)
            tiles = adapter.units(inner, IMAGE, named, info).sizes
            calls = [rank[f"{family}-zero{stage}"]["vision_steps"][step] for rank in trained]
            video = "pixel_values_videos" in batch
            for rank_calls in calls:
                assert (rank_calls["agreements"], rank_calls["row_counts"], rank_calls["all_to_all"]) == (
                    1, 1, 1 + video), (family, step, rank_calls)
            encoded = [rank_calls["encoded_rows"][0] for rank_calls in calls]  # images first, then the video
            assert sum(encoded) == sum(tiles) + blank * (len(tiles) < 2), (family, step, encoded, tiles)
            if index == 1:  # (b)
                assert sorted(encoded) == sorted(tiles) and tiles[0] != tiles[1], (family, encoded, tiles)
            if video:
                assert sorted(rank_calls["encoded_rows"][1] for rank_calls in calls) == [1, 2]


# ---- in-process


def _prepared_call(batch: dict):
    """A batch cut by the collate step and the step context of one process (sp=1: no exchange)."""
    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.training.step_context import StepContext

    shard = shard_batch(batch, 1, 0)
    info = shard.pop("_ulysses")
    named = dict(shard)
    named["position_ids"] = info.position_ids
    return named, info, StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True)


def _tiles_flattened(family: str, model: torch.nn.Module, batch: dict) -> dict:
    """The batch with ``pixel_values`` ``[all tiles, C, H, W]`` (each image's tiles the model takes, in turn), the
    model's other form."""
    from lightning_ulysses.families.vision.llava_next import tiles_of

    per_row = batch.get("batch_num_images") if family == "llava_onevision" else None
    images = batch["pixel_values"].shape[0]
    base_only = [n > 1 for n in per_row.tolist() for _ in range(n)] if per_row is not None else [False] * images
    tiles = [1 if only else tiles_of(model.model, size) for size, only in zip(batch["image_sizes"].tolist(),
                                                                               base_only)]
    return {**batch, "pixel_values": torch.cat([pixels[:n] for pixels, n in zip(batch["pixel_values"], tiles)])}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_single_process_call_places_every_feature_row_as_the_model_does(family):
    """sp=1 through the same path (units, encoding, placement): the model's output equals its own forward, for both
    forms of ``pixel_values``, also with the call's own ``vision_feature_layer`` (not the config's), which reaches
    the features as the forward passes it."""
    from lightning_ulysses.models import vision_language

    model = build_model(family).eval()
    other_layer = {"llava_next": -1, "llava_onevision": -2}[family]
    for options in ({}, {"vision_feature_layer": other_layer}):
        for batch in batches(family) + [_tiles_flattened(family, model, b) for b in batches(family)]:
            batch = {k: v for k, v in batch.items() if k != "labels"}
            named, info, context = _prepared_call(batch)
            named.update(options)
            vision_language.complete_call(model, named, info, context)
            assert "pixel_values" not in named and "pixel_values_videos" not in named
            with torch.no_grad():
                ours = model(**named).logits
                theirs = model(**batch, **options).logits
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        if options:
            with torch.no_grad():
                assert not torch.allclose(model(**batch).logits, theirs)  # the option changes the features


@pytest.mark.parametrize("family", FAMILIES)
def test_runs_of_units_encode_to_the_rows_of_the_whole(family):
    """Every run of units (images, OneVision's multi-image rows as one, a video's frames; both forms of
    ``pixel_values``) encodes to its slice of the whole batch's feature rows, with the row counts the exchange is
    told."""
    from lightning_ulysses.families.vision import IMAGE, VIDEO, family_of

    model = build_model(family).eval()
    inner, adapter = model.model, family_of(family)
    for batch in batches(family) + [_tiles_flattened(family, model, b) for b in batches(family)]:
        named, info, _ = _prepared_call(batch)
        for modality in adapter.modalities:
            if named.get(modality.pixels_key) is None:
                continue
            units = adapter.units(inner, modality, named, info)
            with torch.no_grad():
                whole = adapter.encode_inputs(inner, modality, adapter.slice_inputs(inner, modality, named, 0,
                                                                                    len(units.sizes)))
                alone = [adapter.encode_inputs(inner, modality, adapter.slice_inputs(inner, modality, named, k, k + 1))
                         for k in range(len(units.sizes))]
                token = IMAGE.token_attr if modality is IMAGE else VIDEO.token_attr
                assert whole.tensors[0].shape[0] == int((batch["input_ids"] == getattr(model.config, token)).sum())
            counts = units.rows if units.rows is not None else whole.rows_per_unit
            assert [a.tensors[0].shape[0] for a in alone] == counts
            if units.rows is None:
                assert [a.rows_per_unit[0] for a in alone] == counts
            torch.testing.assert_close(torch.cat([a.tensors[0] for a in alone]), whole.tensors[0],
                                       rtol=1e-5, atol=1e-6)


def test_a_dummy_encoding_takes_the_calls_feature_options():
    """A rank without an image of its own encodes a blank one with the call's ``vision_feature_layer`` too, so its
    vision tower touches the same weights as the ranks with images (ZeRO's reductions stay in step)."""
    from lightning_ulysses.models import vision_language
    from lightning_ulysses.families.vision import IMAGE, VIDEO, family_of
    from lightning_ulysses.training.step_context import StepContext

    model = build_model("llava_onevision")
    seen = []
    for name in ("get_image_features", "get_video_features"):
        original = getattr(model.model, name)
        setattr(model.model, name, lambda *a, _original=original, **k: seen.append(k) or _original(*a, **k))
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True)
    adapter = family_of("llava_onevision")
    assert adapter.call_options({"vision_feature_layer": -2, "vision_aspect_ratio": "x", "input_ids": 0}) == {
        "vision_feature_layer": -2}
    for modality in (IMAGE, VIDEO):
        rows = vision_language._exchanged_features(model.model, adapter, modality, None, 0, None, 1, context,
                                                   {"vision_feature_layer": -2})
        assert rows[0].shape[0] == 0 and rows[0].requires_grad
    assert [k["vision_feature_layer"] for k in seen] == [-2, -2]


def test_the_per_image_keys_are_never_cut():
    from lightning_ulysses.data.sharding import VISION_KEYS

    assert {"image_sizes", "image_sizes_videos", "batch_num_images", "pixel_values_videos"} <= set(VISION_KEYS)


def test_images_that_batch_num_images_does_not_count_are_refused_before_encoding():
    from lightning_ulysses.families.vision import IMAGE, family_of

    model = build_model("llava_onevision")
    batch = dict(batches("llava_onevision")[1])  # two rows of one image each
    batch["batch_num_images"] = torch.tensor([1])
    named, info, _ = _prepared_call(batch)
    with pytest.raises(ValueError, match=r"batch_num_images \[1\] count 1 images where image_sizes holds 2"):
        family_of("llava_onevision").units(model.model, IMAGE, named, info)
