"""Vision-language models train under SP as on one device: images whose placeholder tokens straddle the shard
boundary, several images of different sizes, a video, padded rows mixing text-only and image samples; the vision
tower's weights included. SGD, fp32, 4 steps against plain transformers on one process."""

from __future__ import annotations

import pytest

from tests.support.launcher import launch
from tests.support.vision import assert_trains_as_single_device, train_single_device
from tests.test_parity import rel_diff, update_rel_diff

RUNS = [("qwen2_vl", 2), ("qwen2_5_vl", 2), ("qwen2_vl", 3), ("qwen2_5_vl", 3), ("llava", 2), ("llava", 3)]
RUNS_SP4 = [("qwen2_5_vl", 2)]
PACKED = [4, 5]  # the packed-row batches (e) and (f)
RUNS_PACKED = [("qwen2_vl", 2), ("llava", 3)]


@pytest.fixture(scope="module")
def trained():
    return launch(2, "vision_language:run",
                  {"runs": RUNS + [(family, stage, PACKED) for family, stage in RUNS_PACKED], "sp_size": 2,
                   "strategy": {"sdpa_per_document": True}})  # packed rows on sdpa: one exact call per sample


DP_SP = ("qwen2_vl", 3, [0, 1, 2, 3, 4, 5], 2)  # 4 processes: sp=2 × dp=2, batches (a)-(f), 3 steps


@pytest.fixture(scope="module")
def trained_sp4():
    return launch(4, "vision_language:run", {"runs": RUNS_SP4 + [DP_SP], "sp_size": 4, "processes": 4,
                                             "strategy": {"sdpa_per_document": True}})


@pytest.fixture(scope="module")
def references():
    return {family: train_single_device(family) for family in {family for family, _ in RUNS}}


@pytest.mark.parametrize("sp, family, stage", [(2, *run) for run in RUNS] + [(4, *run) for run in RUNS_SP4],
                         ids=[f"sp2-{f}-zero{s}" for f, s in RUNS] + [f"sp4-{f}-zero{s}" for f, s in RUNS_SP4])
def test_vision_language_training_matches_single_device(request, references, sp, family, stage):
    from tests.support.vision import build_model

    trained = request.getfixturevalue("trained" if sp == 2 else "trained_sp4")
    prefix = "model.vision_tower" if family == "llava" else "model.visual"
    assert_trains_as_single_device(trained, references[family], f"{family}-zero{stage}",
                                   dict(build_model(family).named_parameters()), (prefix,))


@pytest.mark.parametrize("family, stage", RUNS_PACKED, ids=[f"{f}-zero{s}" for f, s in RUNS_PACKED])
def test_packed_rows_with_images_train_as_on_one_device(trained, family, stage):
    """Rows packing image, video and text-only samples: Qwen2-VL with the ``[4, 1, S]`` positions a user gives one
    device (text positions restarting per sample, each sample's M-RoPE rows), LLaVA with restarting ``[1, S]``
    positions. Packing's promise is that no sample attends to another (flash-attention's varlen path on one device;
    plain transformers on ``sdpa`` lets them mix), so the reference runs the same samples as separate rows."""
    reference = train_single_device(family, select=PACKED)
    key = f"{family}-zero{stage}-45"
    for rank in trained:
        assert rel_diff(rank[key]["losses"], reference["losses"]) <= 1e-5, (rank[key]["losses"], reference["losses"])
    from tests.support.vision import build_model

    initial = dict(build_model(family).named_parameters())
    assert update_rel_diff(trained[0][key]["weights"], reference["weights"], initial) <= 1e-4


def test_data_parallel_replicas_with_different_modalities_train_as_one_device(trained_sp4):
    """sp=2 × dp=2 at ZeRO 3: in a step one replica may hold images and a video while the other holds only text or a
    packed row; the world agrees on the modalities, a replica without them encodes a dummy, and the step is one
    device's step on the global batch (the loss a mean over all its target tokens)."""
    from tests.support.vision import build_model, train_data_parallel_reference

    family, stage, select, sp = DP_SP
    reference = train_data_parallel_reference(family, select, replicas=2)
    key = f"{family}-zero{stage}-{''.join(map(str, select))}-sp{sp}"
    assert sorted(result[key]["dp_rank"] for result in trained_sp4) == [0, 0, 1, 1]
    for result in trained_sp4:
        assert rel_diff(result[key]["losses"], reference["losses"]) <= 1e-5, (result[key]["losses"],
                                                                             reference["losses"])
    initial = dict(build_model(family).named_parameters())
    assert update_rel_diff(trained_sp4[0][key]["weights"], reference["weights"], initial) <= 1e-4


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


def _prepared_call(family: str, batch: dict, sp: int = 1):
    """A batch cut by the collate step and the step context of one process (no exchange: sp=1)."""
    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.training.step_context import StepContext

    shard = shard_batch(batch, sp, 0)
    info = shard.pop("_ulysses")
    named = dict(shard)
    named["position_ids"] = info.position_ids
    return named, info, StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True)


def test_images_for_an_unsupported_family_are_refused_with_the_supported_list():
    import re
    from types import SimpleNamespace

    from lightning_ulysses.models import vision_language
    from tests.support.vision import batches

    named, info, context = _prepared_call("qwen2_vl", batches()[0])
    model = SimpleNamespace(config=SimpleNamespace(model_type="fuyu", vision_config=object()))
    supported = sorted(vision_language.SUPPORTED_FAMILIES)
    assert {"llava", "qwen2_5_vl", "qwen2_vl"} <= set(supported) and "fuyu" not in supported
    with pytest.raises(ValueError, match=re.escape("('fuyu')") + ".*" + re.escape(str(supported))):
        vision_language.complete_call(model, named, info, context)


def test_flat_packed_positions_on_an_m_rope_decoder_are_refused_with_the_four_row_fix():
    """Restarting ``[B, S]`` positions on a Qwen-VL decoder: one device would let the packed samples attend to each
    other (its packed mask is built from ``[4, B, S]`` positions only), so they are refused, also text-only; LLaVA
    (a Llama decoder packs from ``[B, S]``) and ``[4, B, S]`` positions pass."""
    import torch

    from lightning_ulysses.families.multimodal_positions import refuse_flat_packed_positions
    from tests.support.vision import batches, build_model, packed_batches

    for batch in (dict(batches()[0]), {"input_ids": batches()[3]["input_ids"][1:]}):
        length = batch["input_ids"].shape[1]
        batch["position_ids"] = torch.cat([torch.arange(10), torch.arange(length - 10)])[None]  # two samples
        _, info, _ = _prepared_call("qwen2_vl", batch)
        with pytest.raises(ValueError, match=r"pack several samples.*\[4, B, S\]"):
            refuse_flat_packed_positions(build_model("qwen2_vl"), info)
        refuse_flat_packed_positions(build_model("llava"), info)
    _, info, _ = _prepared_call("qwen2_vl", packed_batches("qwen2_vl")[0])
    assert info.packed
    refuse_flat_packed_positions(build_model("qwen2_vl"), info)


def test_four_row_positions_are_cut_with_the_tokens():
    """The collate step keeps the batch's ``[4, B, S]`` positions whole for the model and cuts their text row like
    any ``[B, S]`` tensor; the model's call gets its shard's columns of all four rows."""
    import torch

    from lightning_ulysses.data.sharding import shard_batch
    from lightning_ulysses.families.multimodal_positions import multimodal_call_positions
    from tests.support.vision import packed_batches

    batch = packed_batches("qwen2_vl")[0]
    whole = batch["position_ids"]  # [4, 1, S]
    S = whole.shape[2]
    for rank in range(2):
        shard = shard_batch(batch, 2, rank)
        info = shard.pop("_ulysses")
        columns = multimodal_call_positions(shard["position_ids"], info.multimodal["position_ids"], info, 1)
        half = -(-S // 2)
        real = min(half, S - rank * half)  # the rest of the shard is the padding to the SP multiple
        assert torch.equal(columns[0], shard["position_ids"])  # [1, s] the text row, cut like the tokens
        assert torch.equal(columns[:, :, :real], whole[:, :, rank * half:rank * half + real])


def test_a_single_process_call_places_every_feature_row_as_the_model_does():
    """sp=1 through the same path: the model's output equals its own forward on the batch."""
    import torch

    from lightning_ulysses.models import vision_language
    from tests.support.vision import batches, build_model

    model = build_model("qwen2_vl").eval()
    for batch in batches():
        named, info, context = _prepared_call("qwen2_vl", batch)
        vision_language.complete_call(model, named, info, context)
        with torch.no_grad():
            ours = model(**{k: v for k, v in named.items() if k != "labels"}).logits
            theirs = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_example_fine_tunes_from_the_command_line():
    """``python examples/finetune_vlm.py`` as a user runs it: one process, Lightning starts the second; a few steps
    (the other family's flag in the in-process check below)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_launchers import clean_env

    root = Path(__file__).resolve().parents[1]
    for family in ("qwen2_5_vl",):
        proc = subprocess.run([sys.executable, "examples/finetune_vlm.py", "--family", family, "--steps", "3"],
                              cwd=root, env=clean_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"{family}: 3 steps under sp_size=2, final train_loss=" in proc.stdout


def test_the_example_builds_both_families():
    from examples.finetune_vlm import SyntheticVisionText, build_model, collate

    for family in ("qwen2_5_vl", "qwen2_vl", "qwen3_5"):
        batch = collate([SyntheticVisionText(2, frames=4, family=family)[i] for i in range(2)])
        model = build_model(family)
        assert model.config.model_type == family
        assert model(**batch).loss.isfinite()


@pytest.mark.multiprocess
def test_the_preflight_check_plans_the_batchs_images_and_stops_over_the_budget():
    """The pre-flight memory check for a vision-language model (Qwen2-VL): the first batch's image grids reach the plan
    (the vision tower's kept activations are a part of it); over the budget both ranks stop before any weight
    changes, with a roomy budget it trains."""
    found = launch(2, "vision_language:preflight", {"runs": [("qwen2_vl", 2, 1 << 20), ("qwen2_vl", 2, 1 << 40)]})
    for rank in found:
        stopped, trained = rank["qwen2_vl-1048576"], rank[f"qwen2_vl-{1 << 40}"]
        assert stopped["error_type"] == "PreflightMemoryError", stopped["message"]
        assert "| step: vision tower (kept for backward) |" in stopped["message"], stopped["message"]
        assert stopped["losses"] == [] and stopped["unchanged"]
        assert trained["error_type"] is None, trained["message"]
        assert len(trained["losses"]) == 1 and not trained["unchanged"]


def test_the_decoders_own_cache_is_off_while_prepared_and_given_back():
    """A vision-language model's decoder reads its own config's ``use_cache``: off while prepared (a cache there
    carried a gated delta net's state from one packed sample's run to the next: Qwen3.5's packed rows failed in
    backward), given back after."""
    from lightning_ulysses.models.hf import prepare_model, restore_model
    from lightning_ulysses.training.step_context import StepContext
    from tests.support.vision import build_model

    model = build_model("qwen2_vl")
    assert model.config.text_config.use_cache is True
    prepare_model(model, StepContext(sp_group=None, ulysses_group=None, ring_group=None))
    assert model.config.text_config.use_cache is False
    restore_model(model)
    assert model.config.text_config.use_cache is True
