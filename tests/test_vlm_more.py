"""InternVL (tiles of fixed size, a video's frames as tiles) and Mistral 3 (Pixtral over images of different sizes,
break and end tokens) train under SP as on one device: an image whose placeholders straddle the shard boundary,
several images of different sizes, padded rows mixing text-only and image samples; the vision tower's weights
included. SGD, fp32, 4 steps against plain transformers on one process; one 2-process launch for all fits."""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.support.vision import assert_trains_as_single_device, train_single_device

SUPPORT = "tests.support.vision_more"
RUNS = [("internvl", 2), ("mistral3", 2), ("mistral3", 3)]
VISION_PREFIXES = ("model.vision_tower", "model.multi_modal_projector")


@pytest.fixture(scope="module")
def trained():
    return launch(2, "vlm_more:run", {"runs": RUNS, "sp_size": 2, "support": SUPPORT})


@pytest.fixture(scope="module")
def references():
    return {family: train_single_device(family, support=SUPPORT) for family in {family for family, _ in RUNS}}


@pytest.mark.parametrize("family, stage", RUNS, ids=[f"{f}-zero{s}" for f, s in RUNS])
def test_training_matches_single_device(trained, references, family, stage):
    from tests.support.vision_more import build_model

    vision = assert_trains_as_single_device(trained, references[family], f"{family}-zero{stage}",
                                            dict(build_model(family).named_parameters()), VISION_PREFIXES)
    assert any(k.startswith("model.vision_tower") for k in vision)


def _expected_tower_inputs(family: str, batch: dict) -> list[int]:
    """Per rank, the items its vision tower gets in a step: its share of the units (InternVL: one per tile,
    Mistral 3: one per image, balanced by patches), a dummy item where it has none, and for Mistral 3 a blank image
    after a run of one feature row in all (the dummy's too)."""
    from lightning_ulysses.models.vision_language import _owners

    if family == "internvl":
        sizes, rows = [1] * int(batch["pixel_values"].shape[0]), None
    else:
        sizes = [(h // 4) * (w // 4) for h, w in batch["image_sizes"].tolist()]
        rows = [(h // 8) * (w // 8) for h, w in batch["image_sizes"].tolist()]
    owners = _owners(sizes, 2)
    expected = []
    for rank in range(2):
        mine = [unit for unit, owner in enumerate(owners) if owner == rank]
        count, run_rows = (len(mine), sum(rows[u] for u in mine) if rows else None) if mine else (1, 1)
        expected.append(count + int(family == "mistral3" and run_rows == 1))
    return expected


def test_the_vision_units_are_split_over_the_ranks(trained):
    """Each rank's vision tower gets its share of the batch's units only (InternVL's wide image: its five tiles on
    both ranks); one agreement and one feature all-to-all per step."""
    from tests.support.models import lightning_order
    from tests.support.vision import SEED
    from tests.support.vision_more import selected_batches

    for family in ("internvl", "mistral3"):
        every = selected_batches(None, family)
        for step, index in enumerate(lightning_order(4, SEED)):
            calls = [rank[f"{family}-zero2"]["vision_steps"][step] for rank in trained]
            expected = _expected_tower_inputs(family, every[index])
            assert [rank_calls["encoded_rows"] for rank_calls in calls] == [[n] for n in expected], (family, step)
            for rank_calls in calls:
                assert rank_calls["agreements"] == 1 and rank_calls["all_to_all"] == 1
    assert _expected_tower_inputs("internvl", selected_batches([0], "internvl")[0]) == [2, 3]


@pytest.mark.parametrize("family", ["internvl", "mistral3"])
def test_a_single_process_call_places_every_feature_row_as_the_model_does(family):
    """sp=1 through the same path (units, encoding, placement): the logits equal the model's own forward."""
    import torch

    from lightning_ulysses.models import vision_language
    from tests.support.vision_more import build_model, selected_batches
    from tests.test_vision_language import _prepared_call

    model = build_model(family).eval()
    for batch in selected_batches(None, family):
        named, info, context = _prepared_call(family, batch)
        vision_language.complete_call(model, named, info, context)
        assert "pixel_values" not in named and "image_sizes" not in named
        with torch.no_grad():
            ours = model(**{k: v for k, v in named.items() if k != "labels"}).logits
            theirs = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_units_are_independent_in_the_vision_tower():
    """Encoding a run of units equals encoding each alone (InternVL's tiles, Mistral 3's images; for Mistral 3 also
    an image of a single feature row, which transformers' own call cannot take alone)."""
    import torch

    from lightning_ulysses.families.vision import IMAGE, family_of
    from tests.support.vision_more import build_model, selected_batches

    for family in ("internvl", "mistral3"):
        model = build_model(family).eval()
        adapter, inner = family_of(family), model.model
        batch = selected_batches([1], family)[0]  # several images of different sizes
        count = int(batch["pixel_values"].shape[0])
        with torch.no_grad():
            whole = adapter.encode_inputs(inner, IMAGE, adapter.slice_inputs(inner, IMAGE, batch, 0, count))
            alone = [adapter.encode_inputs(inner, IMAGE, adapter.slice_inputs(inner, IMAGE, batch, k, k + 1))
                     for k in range(count)]
        torch.testing.assert_close(torch.cat([a.tensors[0] for a in alone]), whole.tensors[0], rtol=1e-5,
                                   atol=1e-6)


def test_mistral3_rows_per_image_follow_image_sizes_and_a_mismatch_is_refused():
    import torch

    from lightning_ulysses.families.vision import IMAGE, family_of
    from tests.support.vision_more import build_model, selected_batches
    from tests.test_vision_language import _prepared_call

    model = build_model("mistral3")
    batch = selected_batches([1], "mistral3")[0]
    named, info, _ = _prepared_call("mistral3", batch)
    units = family_of("mistral3").units(model.model, IMAGE, named, info)
    sizes = batch["image_sizes"].tolist()
    assert units.rows == [(h // 8) * (w // 8) for h, w in sizes]
    assert units.sizes == [(h // 4) * (w // 4) for h, w in sizes]
    named["image_sizes"] = torch.tensor([[h + 8, w] for h, w in sizes])
    with pytest.raises(ValueError, match="placeholder tokens where its image_sizes give"):
        family_of("mistral3").units(model.model, IMAGE, named, info)


def test_both_families_are_listed_where_another_family_is_refused():
    from types import SimpleNamespace

    from lightning_ulysses.models import vision_language
    from tests.support.vision_more import selected_batches
    from tests.test_vision_language import _prepared_call

    assert {"internvl", "mistral3"} <= set(vision_language.SUPPORTED_FAMILIES)
    named, info, context = _prepared_call("internvl", selected_batches([0], "internvl")[0])
    model = SimpleNamespace(config=SimpleNamespace(model_type="fuyu", vision_config=object()))
    with pytest.raises(ValueError, match=r"'fuyu'.*'internvl'.*'mistral3'"):
        vision_language.complete_call(model, named, info, context)
