"""Resume on another cluster size (ZeRO 1 and 2): a checkpoint written by 2 ranks (sp=2) continues on 4 (sp=4), and
the 4-rank checkpoint of that run continues on 2 again, each with the per-step losses, learning rates and sample
order of the uninterrupted single-device run (SGD with momentum and a StepLR, so the optimizer state and the
schedule matter). Three launches: 2, 4, then 2 processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher import launch
from tests.test_checkpoints import BASE, assert_continues, global_steps, single_device_reference

STAGES = (1, 2)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def runs(root):
    """The three launches, in order: each resumes from a checkpoint the previous one wrote."""
    first = launch(2, "tests.scenarios_checkpoint:fits", {"root": str(root), "runs": {
        f"sp2_z{s}": {**BASE, "stage": s, "ckpt_every": 4, "ckpt_dir": f"sp2_z{s}"} for s in STAGES}})
    second = launch(4, "tests.scenarios_checkpoint:fits", {"root": str(root), "runs": {
        f"sp4_from_sp2_z{s}": {**BASE, "sp_size": 4, "stage": s, "resume": f"sp2_z{s}/step=4.ckpt",
                               "ckpt_every": 4, "ckpt_dir": f"sp4_z{s}"} for s in STAGES}}, timeout=900)
    third = launch(2, "tests.scenarios_checkpoint:fits", {"root": str(root), "runs": {
        f"sp2_from_sp4_z{s}": {**BASE, "stage": s, "resume": f"sp4_z{s}/step=8.ckpt"} for s in STAGES}})
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


def test_the_uninterrupted_two_rank_run_is_the_reference(runs, reference):
    name = "sp2_z2"
    assert_continues(global_steps(runs[name], name), reference, 1)
