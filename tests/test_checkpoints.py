"""Checkpoints under SP: exact resume (optimizer, LR scheduler, position in the epoch) at ZeRO 0-3, a dp×sp layout
change, a portable export that plain transformers loads, and a rank killed while saving.

Three launches: a run whose rank 1 is SIGKILLed while writing its second checkpoint; 2 processes at ZeRO 2 (resumes,
``trainer.save_checkpoint``, resume after the kill, layout change, refusals); 2 processes at ZeRO 3 (+ ZeRO 0/1
resumes, layout change). Every run: SGD with momentum, a StepLR stepped per step, two shuffled epochs of 6 batches,
fp32.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_ulysses import (
    checkpoint_status,
    export_checkpoint,
    find_last_complete_checkpoint,
)
from lightning_ulysses.checkpoint.markers import MARKER, validate_for_loading
from tests.support.launcher import launch
from tests.support.models import SEED, build_llama, tiny_llama_config
from tests.scenarios.checkpoints import KV_HEADS, LR, LR_GAMMA, LR_STEP, MOMENTUM, RowDataset, predict_inputs

ROWS, SEQ_LEN, EPOCHS = 6, 16, 2
STEPS = ROWS * EPOCHS  # batch 1, dp 1: 6 steps per epoch
BASE = dict(num_rows=ROWS, seq_len=SEQ_LEN, batch_size=1, sp_size=2, max_epochs=EPOCHS)
REL_TOL = 1e-6
# Layout change: the same 2 processes as dp2×sp1 (micro-batch 1) and as dp1×sp2 (micro-batch 2): 2 samples a step.
DP2 = dict(BASE, sp_size=1, batch_size=1)
SP2_B2 = dict(BASE, sp_size=2, batch_size=2)
LAYOUT_STEPS = ROWS // 2 * EPOCHS


def _full(stage: int, ckpt_dir: str, **extra) -> dict:
    return {**BASE, "stage": stage, "ckpt_every": 4, "ckpt_dir": ckpt_dir, **extra}


def _resume(stage: int, path: str, **extra) -> dict:
    return {**BASE, "stage": stage, "resume": path, **extra}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def killed(root):
    """ZeRO 2, SP 2, checkpoints every 4 steps; rank 1 is SIGKILLed while writing the second one (step 8, in the
    middle of epoch 1): rank 0 has written its files and DeepSpeed's ``latest``, rank 1's shard is missing."""
    victim = _full(2, "killed", kill_rank=1, kill_at_save=2)
    with pytest.raises(RuntimeError) as failure:
        launch(2, "checkpoints:fits", {"root": str(root), "runs": {"victim": victim}})
    return {"log": str(failure.value), "dir": root / "killed"}


@pytest.fixture(scope="module")
def zero2(root, killed):
    after_kill = find_last_complete_checkpoint(killed["dir"])
    runs = {
        "full": _full(2, "z2", save_to="z2_final.ckpt", predict=True),
        "resume4": _resume(2, "z2/step=4.ckpt"),  # epoch 0, batch 4 of 6
        "resume8": _resume(2, "z2/step=8.ckpt"),  # epoch 1, batch 2 of 6
        "stop5": {**BASE, "stage": 2, "max_steps": 5, "save_to": "stop5.ckpt"},  # trainer.save_checkpoint
        "resume5": _resume(2, "stop5.ckpt"),
        "after_kill": _resume(2, str(after_kill.relative_to(root)) if after_kill else "missing"),
        "dp2_full": {**DP2, "stage": 2, "ckpt_every": 2, "ckpt_dir": "dp2"},
        "sp2_b2_full": {**SP2_B2, "stage": 2, "ckpt_every": 2, "ckpt_dir": "sp2_b2"},
        "sp2_from_dp2": {**SP2_B2, "stage": 2, "resume": "dp2/step=4.ckpt"},  # epoch 1, batch 1 of 3
        "dp2_from_sp2": {**DP2, "stage": 2, "resume": "sp2_b2/step=2.ckpt"},  # epoch 0, batch 2 of 3
        # Refusals last (a failed fit is followed by nothing in these processes).
        "partial": _resume(2, "killed/step=8.ckpt", may_fail=True),
        "other_batch": {**SP2_B2, "stage": 2, "resume": "z2/step=4.ckpt"},
    }
    return launch(2, "checkpoints:fits", {"root": str(root), "runs": runs})


@pytest.fixture(scope="module")
def zero3(root):
    runs = {
        "full": _full(3, "z3", predict=True),
        "resume4": _resume(3, "z3/step=4.ckpt"),
        "resume8": _resume(3, "z3/step=8.ckpt"),
        "z0_full": _full(0, "z0"),
        "z0_resume8": _resume(0, "z0/step=8.ckpt"),
        "z1_full": _full(1, "z1"),
        "z1_resume4": _resume(1, "z1/step=4.ckpt"),
        "z3_dp2_full": {**DP2, "stage": 3, "ckpt_every": 2, "ckpt_dir": "z3_dp2"},
        "z3_sp2_from_dp2": {**SP2_B2, "stage": 3, "resume": "z3_dp2/step=4.ckpt"},
    }
    return launch(2, "checkpoints:fits", {"root": str(root), "runs": runs})


def rel_diff(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).norm() / expected.norm()).item()


def global_steps(results: list[dict], name: str) -> list[tuple[int, float, float, list[int]]]:
    """Per step over the whole world: (step, mean loss of the dp replicas, lr, rows of all replicas)."""
    per_rank = [r[name]["steps"] for r in results]
    assert all(len(s) == len(per_rank[0]) for s in per_rank)
    out = []
    for records in zip(*per_rank):
        steps, losses, lrs = {r[0] for r in records}, [r[1] for r in records], {r[2] for r in records}
        assert len(steps) == 1 and len(lrs) == 1
        rows = sorted({row for r in records for row in r[3]})
        out.append((steps.pop(), sum(losses) / len(losses), lrs.pop(), rows))
    return out


def assert_continues(resumed: list, reference: list, first_step: int) -> float:
    """The resumed run's steps are the reference's steps ``first_step..`` (same rows, lr, losses); returns the
    largest relative loss difference."""
    expected = [s for s in reference if s[0] >= first_step]
    assert [s[0] for s in resumed] == [s[0] for s in expected]
    assert [s[3] for s in resumed] == [s[3] for s in expected], "another position in the epoch"
    assert [s[2] for s in resumed] == [s[2] for s in expected], "another learning rate"
    worst = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(resumed, expected))
    assert worst <= REL_TOL, (resumed, expected)
    print(f"[measured] steps {first_step}..{expected[-1][0]}: max relative loss difference {worst:.2e}")
    return worst


def single_device_reference() -> dict:
    """Plain PyTorch + transformers: the same init, SGD with momentum, StepLR, and the sampler's shuffled orders."""
    model = build_llama(tiny_llama_config(num_kv_heads=KV_HEADS))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP, gamma=LR_GAMMA)
    dataset = RowDataset(ROWS, SEQ_LEN)
    steps = []
    for epoch in range(EPOCHS):
        for row in torch.randperm(ROWS, generator=torch.Generator().manual_seed(SEED + epoch)).tolist():
            sample = dataset[row]
            loss = model(input_ids=sample["input_ids"][None], labels=sample["labels"][None]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            # The lr as StepLog reads it at on_train_batch_end: after this step's scheduler step.
            steps.append((len(steps) + 1, loss.item(), optimizer.param_groups[0]["lr"], [row]))
    return {"steps": steps}


# ----------------------------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("launch_name", ["zero2", "zero3"])
def test_uninterrupted_run_is_the_single_device_run(launch_name, request):
    """The reference the resumes are held to trains for real: momentum and the scheduler act (lr halves every 3
    steps), the epochs are shuffled differently, and it is the single-device training."""
    full = global_steps(request.getfixturevalue(launch_name), "full")
    reference = single_device_reference()["steps"]
    assert [s[0] for s in full] == list(range(1, STEPS + 1))
    assert [s[3] for s in full] == [s[3] for s in reference]
    assert [s[3] for s in full[:ROWS]] != [s[3] for s in full[ROWS:]]
    assert [s[2] for s in full] == pytest.approx([s[2] for s in reference], rel=1e-12)
    assert rel_diff([s[1] for s in full], [s[1] for s in reference]) <= 1e-5


RESUMES = {
    "zero2-mid-epoch0": ("zero2", "resume4", 5),
    "zero2-mid-epoch1": ("zero2", "resume8", 9),
    "zero2-trainer.save_checkpoint-after-max_steps": ("zero2", "resume5", 6),
    "zero3-mid-epoch0": ("zero3", "resume4", 5),
    "zero3-mid-epoch1": ("zero3", "resume8", 9),
    "zero0-mid-epoch1": ("zero3", "z0_resume8", 9),
    "zero1-mid-epoch0": ("zero3", "z1_resume4", 5),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_continues_the_uninterrupted_run(case, request):
    launch_name, name, first_step = RESUMES[case]
    results = request.getfixturevalue(launch_name)
    reference = "full" if case.startswith(("zero2", "zero3")) else name.split("_")[0] + "_full"
    assert_continues(global_steps(results, name), global_steps(results, reference), first_step)


def test_stopped_run_trained_the_first_steps(zero2):
    assert assert_continues(global_steps(zero2, "stop5"), global_steps(zero2, "full")[:5], 1) == 0.0


def test_checkpoints_are_marked_complete_with_the_layout(zero2, root):
    marker = json.loads((root / "z2" / "step=4.ckpt" / MARKER).read_text())
    assert marker["complete"] is True
    assert (marker["world_size"], marker["sp_size"], marker["dp_size"], marker["zero_stage"]) == (2, 2, 1, 2)
    assert marker["global_step"] == 4
    assert {"checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(marker["files"])
    assert sorted(p.name for p in (root / "z2").iterdir()) == ["step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert find_last_complete_checkpoint(root / "z2") == root / "z2" / "step=12.ckpt"


# ----------------------------------------------------------------------------------------------- layout change
def test_layout_change_dp2_sp1_to_dp1_sp2_and_back(zero2):
    dp2, sp2 = global_steps(zero2, "dp2_full"), global_steps(zero2, "sp2_b2_full")
    assert len(dp2) == LAYOUT_STEPS and all(len(s[3]) == 2 for s in dp2)
    assert_continues(sp2, dp2, 1)  # the two layouts train the same (2 samples a step)
    assert_continues(global_steps(zero2, "sp2_from_dp2"), dp2, 5)
    assert_continues(global_steps(zero2, "dp2_from_sp2"), sp2, 3)


def test_layout_change_at_zero3(zero3):
    assert_continues(global_steps(zero3, "z3_sp2_from_dp2"), global_steps(zero3, "z3_dp2_full"), 5)


def test_resume_with_another_global_batch_continues_at_the_same_sample(zero2):
    """A checkpoint 4 samples into epoch 0 at 1 sample per step, resumed at 2 per step (dp1×sp2, micro-batch 2): the
    epoch continues with its samples 5-6 (Lightning's batch count follows, so the epoch ends with the data), then
    epoch 1 in steps of 2; the global step and the schedule go on from step 4."""
    steps = global_steps(zero2, "other_batch")
    permutations = [torch.randperm(ROWS, generator=torch.Generator().manual_seed(SEED + e)).tolist() for e in (0, 1)]
    expected_rows = [sorted(permutations[0][4:6])] + [sorted(permutations[1][i:i + 2]) for i in (0, 2, 4)]
    assert [s[0] for s in steps] == [5, 6, 7, 8]
    assert [s[3] for s in steps] == expected_rows
    for rank in zero2:  # Lightning's batch index follows the loader: batch 2 of epoch 0's 3, then 0, 1, 2
        assert [s[4] for s in rank["other_batch"]["steps"]] == [2, 0, 1, 2]


def test_checkpoints_of_another_number_of_ranks_pass_the_checks(zero2, zero3, root):
    """Another world size or ZeRO stage (1-3) is no longer refused (the state is re-partitioned at load:
    tests/test_resume_layouts.py); between ZeRO 0 and the others it still is."""
    validate_for_loading(root / "z3" / "step=4.ckpt", world_size=1, zero_stage=3)
    validate_for_loading(root / "z2" / "step=4.ckpt", world_size=4, zero_stage=2)
    validate_for_loading(root / "z2" / "step=4.ckpt", world_size=4, zero_stage=3)
    with pytest.raises(ValueError, match="saved at ZeRO stage 2 and this run uses stage 0"):
        validate_for_loading(root / "z2" / "step=4.ckpt", world_size=2, zero_stage=0)


# ----------------------------------------------------------------------------------------------- killed rank
def test_rank_killed_while_saving_leaves_the_last_complete_checkpoint(killed, zero2):
    assert "--- rank 1 (exit -9)" in killed["log"]
    directory = killed["dir"]
    partial, complete = directory / "step=8.ckpt", directory / "step=4.ckpt"
    # What the kill left: DeepSpeed's `latest` and rank 0's shard, but not rank 1's.
    assert (partial / "latest").is_file()
    assert (partial / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    assert not (partial / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
    assert checkpoint_status(partial) == (False, f"{partial} is incomplete: its writing started but never finished"
                                                 " (the run stopped while saving, e.g. a rank was killed)")
    assert checkpoint_status(complete) == (True, "")
    assert find_last_complete_checkpoint(directory) == complete
    # Resuming from it gives the uninterrupted run's steps 5..12.
    assert_continues(global_steps(zero2, "after_kill"), global_steps(zero2, "full"), 5)
    # The partial one is refused by the strategy before DeepSpeed reads it, on every rank.
    for rank in zero2:
        kind, message = rank["partial"]["error"]
        assert kind == "ValueError" and "is incomplete" in message and "find_last_complete_checkpoint" in message


# ----------------------------------------------------------------------------------------------- export
def _plain_transformers_logits(model_dir: Path, inputs: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """Logits from a fresh process that imports only torch and transformers."""
    torch.save(inputs, tmp_path / "inputs.pt")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation='sdpa').eval()\n"
        "assert not any(m.startswith('lightning') or m.startswith('deepspeed') for m in sys.modules)\n"
        "with torch.no_grad():\n"
        "    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(model_dir), str(tmp_path / "inputs.pt"),
                    str(tmp_path / "logits.pt")], check=True, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1",
                                                                                  "PATH": "/usr/bin:/bin"})
    return torch.load(tmp_path / "logits.pt")


def test_export_zero3_checkpoint_loads_in_plain_transformers_with_the_sp_logits(zero3, root, tmp_path):
    # step=12 was written by ModelCheckpoint during fit, while the model ran Ulysses attention without a KV cache.
    exported = export_checkpoint(root / "z3" / "step=12.ckpt", tmp_path / "export")
    assert exported["global_step"] == STEPS and set(exported["hf"]) == {"model"}
    config = json.loads((exported["hf"]["model"] / "config.json").read_text())
    assert config["use_cache"] is True and "ulysses" not in json.dumps(config)
    assert config["architectures"] == ["LlamaForCausalLM"]

    sp_logits = zero3[0]["full"]["logits"]
    assert torch.equal(sp_logits, zero3[1]["full"]["logits"])
    # The SP model's logits: each rank ran the forward on its half of the sequence, gathered to the full length.
    assert all(rank["full"]["predict_shapes"] == [(2, 12)] for rank in zero3)
    assert all(rank["full"]["attn_after"] == "sdpa" for rank in zero3)
    assert sp_logits.shape == (2, 24, tiny_llama_config().vocab_size)
    logits = _plain_transformers_logits(exported["hf"]["model"], predict_inputs(), tmp_path)
    print(f"[measured] exported (ZeRO 3) vs SP logits: relative {rel_diff(logits, sp_logits):.2e},"
          f" max abs {(logits - sp_logits).abs().max().item():.2e}")
    assert rel_diff(logits, sp_logits) <= 1e-5
    assert (logits - sp_logits).abs().max().item() <= 1e-4


def test_export_zero2_state_dict_loads_into_the_lightning_module(zero2, root, tmp_path):
    # z2_final.ckpt was written by trainer.save_checkpoint after fit (the model plain again).
    exported = export_checkpoint(root / "z2_final.ckpt", tmp_path / "export")
    checkpoint = torch.load(exported["state_dict"], weights_only=False)
    assert checkpoint["global_step"] == STEPS and checkpoint["epoch"] == EPOCHS
    assert all(v.dtype == torch.float32 for v in checkpoint["state_dict"].values())
    model = build_llama(tiny_llama_config(num_kv_heads=KV_HEADS), init_seed=1)
    model.load_state_dict({k[len("model."):]: v for k, v in checkpoint["state_dict"].items()}, strict=True)
    with torch.no_grad():
        logits = model(predict_inputs()).logits
    sp_logits = zero2[0]["full"]["logits"]
    print(f"[measured] exported (ZeRO 2) vs SP logits: relative {rel_diff(logits, sp_logits):.2e},"
          f" max abs {(logits - sp_logits).abs().max().item():.2e}")
    assert rel_diff(logits, sp_logits) <= 1e-5
    # Lightning loads the exported file as an ordinary checkpoint.
    from tests.scenarios.checkpoints import MomentumLM

    loaded = MomentumLM.load_from_checkpoint(exported["state_dict"], config=tiny_llama_config(num_kv_heads=KV_HEADS),
                                             map_location="cpu")
    assert all(torch.equal(v, model.state_dict()[k[len("model."):]]) for k, v in loaded.state_dict().items())
    # The save_pretrained copy holds the same weights.
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(exported["hf"]["model"])
    assert all(torch.equal(p, model.state_dict()[k]) for k, p in pretrained.state_dict().items())


def test_export_refuses_an_incomplete_checkpoint(killed, tmp_path):
    with pytest.raises(ValueError, match="Cannot export: .* is incomplete"):
        export_checkpoint(killed["dir"] / "step=8.ckpt", tmp_path / "export")


# ----------------------------------------------------------------------------------------------- trust
def _flip_a_byte(path: Path) -> None:
    """Same-size corruption in the middle of the file (what a size check cannot see)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tampered(root, zero2):
    """Copies of the ZeRO-2 step-4 checkpoint with one flipped byte in the model shard / an optimizer shard, and
    resumes from them (and from the intact one at ZeRO 3): every one must stop before DeepSpeed reads anything."""
    import shutil

    source = root / "z2" / "step=4.ckpt"
    for name, file in (("model_flip", "checkpoint/mp_rank_00_model_states.pt"),
                       ("optim_flip", "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt")):
        shutil.copytree(source, root / "tampered" / f"{name}.ckpt")
        _flip_a_byte(root / "tampered" / f"{name}.ckpt" / file)
    runs = {
        "model_flip": _resume(2, "tampered/model_flip.ckpt", may_fail=True),
        "optim_flip": _resume(2, "tampered/optim_flip.ckpt", may_fail=True),
        "stage_change": _resume(0, "z2/step=4.ckpt", may_fail=True),
    }
    return launch(2, "checkpoints:fits", {"root": str(root), "runs": runs})


def test_checkpoint_marker_records_every_files_sha256(zero2, root):
    import hashlib

    checkpoint = root / "z2" / "step=4.ckpt"
    files = json.loads((checkpoint / MARKER).read_text())["files"]
    assert len(files) >= 4  # latest, the model states, two optimizer shards
    for name, entry in files.items():
        assert entry["size"] == (checkpoint / name).stat().st_size
        assert entry["sha256"] == hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(), name


@pytest.mark.parametrize("name, file", [("model_flip", "checkpoint/mp_rank_00_model_states.pt"),
                                        ("optim_flip", "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt")])
def test_same_size_corruption_is_refused_on_resume_and_export(tampered, root, tmp_path, name, file):
    for rank in tampered:
        error_type, message = rank[name]["error"]
        assert error_type == "ValueError"
        assert "Cannot resume from this checkpoint" in message and f"the bytes of {file} differ" in message
        assert "verify_checkpoints=False" in message
    with pytest.raises(ValueError, match=f"Cannot export: .*the bytes of {file} differ"):
        export_checkpoint(root / "tampered" / f"{name}.ckpt", tmp_path / "export")
    assert checkpoint_status(root / "tampered" / f"{name}.ckpt") == (True, "")  # sizes alone cannot tell


def test_resume_at_another_zero_stage_names_both_stages(tampered):
    for rank in tampered:
        error_type, message = rank["stage_change"]["error"]
        assert error_type == "ValueError"
        assert "was saved at ZeRO stage 2 and this run uses stage 0" in message
        assert "UlyssesDeepSpeedStrategy(stage=2, ...)" in message and "export_checkpoint" in message


def test_export_does_not_run_code_from_a_checkpoint(root, tmp_path):
    """A checkpoint whose model file carries a pickle that would run a command (and whose marker an attacker
    rewrote to match) is refused by the restricted unpickler; the command never runs."""
    import pickle
    import shutil

    from lightning_ulysses.checkpoint.markers import commit_checkpoint, read_marker
    from lightning_ulysses.checkpoint.integrity import digests

    evil = root / "tampered" / "evil.ckpt"
    shutil.copytree(root / "z2" / "step=4.ckpt", evil)
    proof = tmp_path / "code-ran"

    class RunsCode:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(proof)],))

    model_file = evil / "checkpoint" / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=False)
    torch.save({**state, "payload": RunsCode()}, model_file)
    record = {k: v for k, v in read_marker(evil).items() if k not in ("files", "complete", "format")}
    names = [n for n in read_marker(evil)["files"]]
    commit_checkpoint(evil, record, digests(evil, names))
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        export_checkpoint(evil, tmp_path / "export")
    assert not proof.exists()
    torch.load(model_file, weights_only=False)  # the same file unpickled unrestricted does run it: the test can fail
    assert proof.exists()


# ----------------------------------------------------------------------------------------------- the loader alone
@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "persistent-worker"])
def test_resumable_loader_skips_the_saved_batches_once(workers):
    """In one process, no Trainer: the loader's state after 2 batches, a new loader resuming from it (the skipped
    samples are never read), the next epoch whole; with a persistent worker too (its iterator is reused per epoch)."""
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from lightning_ulysses.data.loaders import install_resumable_loader

    class Reads(Dataset):
        def __init__(self) -> None:
            self.read: list[int] = []

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            self.read.append(i)
            return i

    def make_loader(batch_size: int = 2):
        dataset = Reads()
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                            persistent_workers=workers > 0)
        return install_resumable_loader(loader), sampler, dataset

    def order(epoch: int) -> list[list[int]]:
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        return [perm[i:i + 2] for i in range(0, 8, 2)]

    first, sampler, _ = make_loader()
    sampler.set_epoch(0)
    iterator = iter(first)
    assert [next(iterator).tolist() for _ in range(2)] == order(0)[:2]
    state = first.state_dict()
    assert state == {"epoch": 0, "batches": 2, "global_batch": 2}

    resumed, sampler, dataset = make_loader()
    resumed.load_state_dict(state)
    assert len(resumed) == 4
    sampler.set_epoch(0)
    assert [b.tolist() for b in resumed] == order(0)[2:]
    if workers == 0:
        assert sorted(dataset.read) == sorted(i for b in order(0)[2:] for i in b)  # the skipped rows were not read
    sampler.set_epoch(1)
    assert [b.tolist() for b in resumed] == order(1)
    assert resumed.state_dict() == {"epoch": 1, "batches": 4, "global_batch": 2}

    # A state saved at the end of an epoch skips nothing in the next one.
    after_epoch, sampler, _ = make_loader()
    after_epoch.load_state_dict(resumed.state_dict())
    sampler.set_epoch(2)
    assert [b.tolist() for b in after_epoch] == order(2)

    # Another global batch: the epoch continues at the same sample (4 of 8), in this loader's batches of 1.
    other_batch, sampler, _ = make_loader(batch_size=1)
    with pytest.warns(UserWarning, match="2 samples per step.*reads 1 per step.*continues at its sample 4 "):
        other_batch.load_state_dict(state)
    sampler.set_epoch(0)
    assert [b.tolist() for b in other_batch] == [[i] for b in order(0)[2:] for i in b]
    # 3 samples in batches of 2: back to the step boundary at sample 2 (one sample seen again), said so.
    odd, sampler, _ = make_loader(batch_size=2)
    with pytest.warns(UserWarning, match="continues at its sample 2 \\(batch 1\\), 1 samples of the previous step"):
        odd.load_state_dict({"epoch": 0, "batches": 3, "global_batch": 1})
    sampler.set_epoch(0)
    assert [b.tolist() for b in odd] == order(0)[1:]
