"""Resume on another cluster size: a checkpoint written by 2 ranks (sp=2) continues on 4 (sp=4), and the 4-rank
checkpoint of that run continues on 2 again, at ZeRO 1, 2 and 3; a dp2×sp2 run on 4 ranks continues as dp1×sp2 on 2
with the same global batch (ZeRO 3, mid-epoch); and the ZeRO stage changes 2 -> 3, 3 -> 2 and 1 -> 3, with and
without a change of the number of ranks. Each resumed run has the per-step losses, learning rates and sample
rows of the uninterrupted run (SGD with momentum and a StepLR, so the optimizer state and the schedule matter).
Three launches: 2, 4, then 2 processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launcher import launch
from tests.test_checkpoints import BASE, assert_continues, global_steps, single_device_reference

STAGES = (1, 2, 3)
DP2_SP2 = dict(BASE, sp_size=2, batch_size=1)  # on 4 ranks: 2 samples a step
DP1_SP2_B2 = dict(BASE, sp_size=2, batch_size=2)  # on 2 ranks: the same 2 samples a step
BF16 = {"precision": "bf16-true"}  # DeepSpeed names the optimizer shards bf16_zero_pp_rank_*
VALIDATIONS = [(2, 2), (3, 3), (2, 3)]
FROZEN = ["embed_tokens", "layers.0."]  # frozen parameters at ZeRO 3 (a LoRA fine-tune's frozen base)  # (saved ZeRO stage on 2 ranks, validating stage on 4 ranks)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def runs(root):
    """The three launches, in order: each resumes from checkpoints the previous one wrote."""
    first = launch(2, "checkpoints:fits", {"root": str(root), "runs": {
        **{f"sp2_z{s}": {**BASE, "stage": s, "ckpt_every": 4, "ckpt_dir": f"sp2_z{s}"} for s in STAGES},
        "sp2_bf16": {**BASE, "stage": 2, "ckpt_every": 4, "ckpt_dir": "sp2_bf16", "trainer": BF16},
        "sp2_z3_frozen": {**BASE, "stage": 3, "frozen": FROZEN, "ckpt_every": 4, "ckpt_dir": "sp2_z3_frozen"}}})
    second = launch(4, "checkpoints:fits", {"root": str(root), "runs": {
        **{f"sp4_from_sp2_z{s}": {**BASE, "sp_size": 4, "stage": s, "resume": f"sp2_z{s}/step=4.ckpt",
                                  "ckpt_every": 4, "ckpt_dir": f"sp4_z{s}"} for s in STAGES},
        "dp2_sp2_z3": {**DP2_SP2, "stage": 3, "ckpt_every": 2, "ckpt_dir": "dp2_sp2_z3"},
        "sp4_from_sp2_bf16": {**BASE, "sp_size": 4, "stage": 2, "resume": "sp2_bf16/step=4.ckpt", "trainer": BF16},
        "sp4_z3_frozen_from_sp2": {**BASE, "sp_size": 4, "stage": 3, "frozen": FROZEN, "scramble": FROZEN,
                                   "resume": "sp2_z3_frozen/step=4.ckpt"},
        "ring2x2_from_sp2_z2": {**BASE, "sp_size": 4, "stage": 2, "strategy": {"ring_size": 2},
                                "resume": "sp2_z2/step=4.ckpt"},
        "sp4_z3_from_sp2_z2": {**BASE, "sp_size": 4, "stage": 3, "resume": "sp2_z2/step=4.ckpt",
                               "ckpt_every": 4, "ckpt_dir": "sp4_z3_from_z2"},
        **{f"validate_sp2_z{s}_on_sp4_z{t}": {**BASE, "sp_size": 4, "stage": t, "validate": f"sp2_z{s}/step=4.ckpt"}
           for s, t in VALIDATIONS}}}, timeout=900)
    third = launch(2, "checkpoints:fits", {"root": str(root), "runs": {
        **{f"sp2_from_sp4_z{s}": {**BASE, "stage": s, "resume": f"sp4_z{s}/step=8.ckpt"} for s in STAGES},
        "dp1_sp2_from_dp2_sp2_z3": {**DP1_SP2_B2, "stage": 3, "resume": "dp2_sp2_z3/step=4.ckpt"},
        "sp2_z2_from_sp4_z3": {**BASE, "stage": 2, "resume": "sp4_z3_from_z2/step=8.ckpt"},
        "sp2_z3_from_sp2_z1": {**BASE, "stage": 3, "resume": "sp2_z1/step=4.ckpt"},
        "sp2_z2_frozen_from_sp2_z3": {**BASE, "stage": 2, "frozen": FROZEN, "scramble": FROZEN,
                                      "resume": "sp2_z3_frozen/step=4.ckpt"},
        **{f"validate_sp2_z{s}_on_sp2_z{s}": {**BASE, "stage": s, "validate": f"sp2_z{s}/step=4.ckpt"}
           for s in {s for s, _ in VALIDATIONS}},
        "another_model": {**BASE, "stage": 2, "layers": 3, "resume": "sp4_z3/step=8.ckpt", "may_fail": True}}})
    return {**{k: first for k in first[0]}, **{k: second for k in second[0]}, **{k: third for k in third[0]}}


@pytest.fixture(scope="module")
def reference():
    return single_device_reference()["steps"]


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_continue_on_four(runs, reference, stage):
    """sp=2 on 2 ranks, checkpoint at step 4 (mid-epoch 0) -> sp=4 on 4 ranks: steps 5..12 as uninterrupted."""
    name = f"sp4_from_sp2_z{stage}"
    assert_continues(global_steps(runs[name], name), reference, 5)


@pytest.mark.parametrize("stage", STAGES)
def test_four_ranks_continue_on_two(runs, reference, stage):
    """The 4-rank run's checkpoint at step 8 (mid-epoch 1) -> sp=2 on 2 ranks: steps 9..12 as uninterrupted."""
    name = f"sp2_from_sp4_z{stage}"
    assert_continues(global_steps(runs[name], name), reference, 9)


def test_frozen_parameters_at_zero3_continue_on_four_ranks_and_at_zero2(runs, reference):
    """With frozen parameters (embeddings and the first layer, as a LoRA fine-tune's base) at ZeRO 3, the 2-rank
    checkpoint continues on 4 ranks, and at ZeRO 2 on 2, as the uninterrupted 2-rank run (its frozen weights loaded: the resumed run starts
    from scrambled frozen weights, so only a load gives these losses; its optimizer state re-partitioned); the frozen
    run really differs from the all-trainable one. (DeepSpeed itself stops here: it copies the saved rank's fragment
    of each frozen parameter into a partition of another size.)"""
    full = global_steps(runs["sp2_z3_frozen"], "sp2_z3_frozen")
    assert_continues(global_steps(runs["sp4_z3_frozen_from_sp2"], "sp4_z3_frozen_from_sp2"), full, 5)
    assert_continues(global_steps(runs["sp2_z2_frozen_from_sp2_z3"], "sp2_z2_frozen_from_sp2_z3"), full, 5)
    assert full[0][1] == pytest.approx(reference[0][1], rel=1e-5)  # the same model and first batch
    assert all(abs(a[1] - b[1]) > 1e-4 * abs(b[1]) for a, b in zip(full[2:], reference[2:]))  # then other training


def test_the_uninterrupted_two_rank_run_is_the_reference(runs, reference):
    name = "sp2_z2"
    assert_continues(global_steps(runs[name], name), reference, 1)


def test_data_parallel_replicas_fold_into_a_larger_micro_batch(runs):
    """dp2×sp2 on 4 ranks (micro-batch 1) -> dp1×sp2 on 2 ranks (micro-batch 2) from step 4 (epoch 1, batch 1 of
    3), ZeRO 3: the same rows per step and the losses of the uninterrupted 4-rank run."""
    full = global_steps(runs["dp2_sp2_z3"], "dp2_sp2_z3")
    resumed = global_steps(runs["dp1_sp2_from_dp2_sp2_z3"], "dp1_sp2_from_dp2_sp2_z3")
    assert_continues(resumed, full, 5)


@pytest.mark.parametrize("name, first_step", [("sp4_z3_from_sp2_z2", 5), ("sp2_z2_from_sp4_z3", 9),
                                              ("sp2_z3_from_sp2_z1", 5), ("ring2x2_from_sp2_z2", 5)])
def test_zero_stage_changes_with_or_without_the_number_of_ranks(runs, reference, name, first_step):
    """ZeRO 2 on 2 ranks -> ZeRO 3 on 4 (step 4), that run's step 8 -> ZeRO 2 on 2, ZeRO 1 -> ZeRO 3 on the same
    2 ranks, and sp=2 (Ulysses) on 2 ranks -> ring 2 × Ulysses 2 on 4: the steps of the uninterrupted run."""
    assert_continues(global_steps(runs[name], name), reference, first_step)


@pytest.mark.parametrize("saved, stage", VALIDATIONS)
def test_validate_a_checkpoint_of_another_layout(runs, saved, stage):
    """validate(ckpt_path=...) on 4 ranks (sp=4, ZeRO ``stage``) of a 2-rank checkpoint (sp=2, ZeRO ``saved``):
    the validation loss of the same checkpoint validated on its own layout."""
    other = [r[f"validate_sp2_z{saved}_on_sp4_z{stage}"]["val_loss"] for r in runs[f"validate_sp2_z{saved}_on_sp4_z{stage}"]]
    own = runs[f"validate_sp2_z{saved}_on_sp2_z{saved}"][0][f"validate_sp2_z{saved}_on_sp2_z{saved}"]["val_loss"]
    print(f"[measured] ZeRO {saved} on 2 ranks validated at ZeRO {stage} on 4: {other[0]:.6f} vs {own:.6f}")
    assert all(abs(v - own) <= 1e-6 * abs(own) for v in other), (other, own)


def test_export_a_checkpoint_written_after_a_layout_change(runs, root, tmp_path):
    """The 4-rank ZeRO-3 checkpoint of the resumed run exports to the weights of the uninterrupted 2-rank run at the
    same step (export runs on one process, whatever the layout that wrote the checkpoint)."""
    from lightning_ulysses import export_checkpoint

    resumed = export_checkpoint(root / "sp4_z3" / "step=8.ckpt", tmp_path / "resumed")
    uninterrupted = export_checkpoint(root / "sp2_z3" / "step=8.ckpt", tmp_path / "uninterrupted")
    a = torch.load(resumed["state_dict"], weights_only=False)["state_dict"]
    b = torch.load(uninterrupted["state_dict"], weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and len(a) > 10
    worst = max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item() for k in b)
    print(f"[measured] exported weights, resumed on 4 ranks vs uninterrupted: worst relative difference {worst:.1e}")
    assert worst <= 1e-6


def test_another_model_is_refused_before_loading(runs):
    """A model with a third layer resuming a 2-layer checkpoint of another layout: a ValueError naming the
    parameters, before any weight is loaded."""
    for rank in runs["another_model"]:
        kind, message = rank["another_model"]["error"]
        assert kind == "ValueError", message
        assert "other trainable parameters than this model" in message and "layers.2" in message
        assert "export_checkpoint" in message


def test_loading_on_another_layout_writes_nothing(runs, root):
    """Re-partitioning happens in memory at load: the checkpoints that were resumed on other layouts (several times)
    are byte for byte what their run wrote, so a crash while loading leaves nothing half-converted to reuse."""
    from lightning_ulysses.checkpoint.markers import MARKER, checkpoint_status, verify_digests

    for stage in STAGES:
        checkpoint = root / f"sp2_z{stage}" / "step=4.ckpt"
        assert checkpoint_status(checkpoint) == (True, "")
        assert verify_digests(checkpoint) == []
        written = {str(f.relative_to(checkpoint)) for f in checkpoint.rglob("*") if f.is_file()} - {MARKER}
        assert written == set(json.loads((checkpoint / MARKER).read_text())["files"])


def test_bf16_checkpoint_continues_on_four_ranks(runs, root):
    """bf16 weights, ZeRO 2: the 2-rank checkpoint (its optimizer shards are ``bf16_zero_pp_rank_*``) continues on 4
    ranks. The first resumed step's loss is bitwise the uninterrupted run's (the weights load exactly); later steps
    differ by bf16 rounding between the layouts' gradient reductions (measured ≤ 2e-4; without the re-partitioned
    momentum the fp32 runs above are 2.4% off)."""
    assert (root / "sp2_bf16" / "step=4.ckpt" / "checkpoint" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    full = [s for s in global_steps(runs["sp2_bf16"], "sp2_bf16") if s[0] >= 5]
    resumed = global_steps(runs["sp4_from_sp2_bf16"], "sp4_from_sp2_bf16")
    assert [s[0] for s in resumed] == [s[0] for s in full] and [s[3] for s in resumed] == [s[3] for s in full]
    assert resumed[0][1] == full[0][1]
    worst = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(resumed, full))
    print(f"[measured] bf16 sp=2 -> sp=4, steps 5..12: max relative loss difference {worst:.1e}")
    assert worst <= 2e-3
