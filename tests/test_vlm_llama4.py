"""Llama 4 with images trains under SP as on one device: its image tiles are units of the vision tower, split over
the SP ranks and their feature rows exchanged (:mod:`lightning_ulysses.families.vision.llama4`), the text
model with chunked attention (8-token chunks, shorter than the shards) and a NoPE layer with temperature tuning. An
image whose placeholders straddle the shard boundary, several images, padded rows, text only; the vision tower and
projector included. SGD, fp32, 4 steps against plain transformers on one process, at ZeRO 2 and at ZeRO 3 with
every parameter partitioned; one 2-process launch."""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.support.vision import assert_trains_as_single_device, train_single_device

SUPPORT = "tests.support.vision_llama4"
RUNS = [("llama4", 2), ("llama4", 3)]
VISION_PREFIXES = ("vision_model", "multi_modal_projector")


@pytest.fixture(scope="module")
def trained():
    return launch(2, "vlm_more:run", {"runs": RUNS, "sp_size": 2, "support": SUPPORT, "partitioned": True})


@pytest.fixture(scope="module")
def reference():
    return train_single_device("llama4", support=SUPPORT)


@pytest.mark.parametrize("family, stage", RUNS, ids=[f"{f}-zero{s}" for f, s in RUNS])
def test_training_matches_single_device(trained, reference, family, stage):
    from tests.support.vision_llama4 import build_model

    vision = assert_trains_as_single_device(trained, reference, f"{family}-zero{stage}",
                                            dict(build_model(family).named_parameters()), VISION_PREFIXES)
    assert any(k.startswith("vision_model") for k in vision)


def test_the_tiles_are_split_over_the_ranks(trained):
    """Batch (a) has 5 tiles: the ranks encode them between them (3 + 2), not each all 5."""
    from tests.support.models import lightning_order
    from tests.support.vision_llama4 import selected_batches

    order = lightning_order(4, 0)
    step = order.index(0)  # the step that trains batch (a)
    tiles = int(selected_batches([0])[0]["pixel_values"].shape[0])
    encoded = [rank["llama4-zero2"]["vision_steps"][step]["encoded_rows"] for rank in trained]
    assert sum(sum(calls) for calls in encoded) == tiles, encoded
    assert all(sum(calls) < tiles for calls in encoded), encoded


def test_llama4_is_a_supported_family():
    from lightning_ulysses.models import vision_language

    assert "llama4" in vision_language.SUPPORTED_FAMILIES
