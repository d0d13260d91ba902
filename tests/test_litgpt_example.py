"""``examples/litgpt_pretrain.py`` run as a user runs it (``python examples/litgpt_pretrain.py``: one process, Fabric
starts the second; sp_size=2, ZeRO 2) trains as one device does: its logged train and validation losses equal those
of the plain LitGPT ``GPT`` on the same rows in the same order (SGD, no clipping: a wrong gradient scale would show),
and it leaves a complete checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses import checkpoint_status
from lightning_ulysses.checkpoint.markers import MARKER
from tests.test_launchers import clean_env

pytestmark = pytest.mark.multiprocess

REPO_ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--max-iters", "3", "--seq-len", "128", "--micro-batch-size", "2", "--eval-iters", "2",
            "--optimizer", "sgd", "--lr", "0.5", "--warmup-iters", "0", "--max-norm", "0"]


def rel_diff(got: float, expected: float) -> float:
    return abs(got - expected) / max(abs(expected), 1e-12)


def single_device_losses(argv: list[str]) -> dict:
    """The example's model, rows, order and learning rates, trained by a plain loop on one device."""
    from examples.litgpt_pretrain import build_model, get_dataloaders, learning_rate, make_optimizer, model_config, \
        parse_args

    args = parse_args(argv)
    model = build_model(model_config(args), args.seed)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    train_loader, val_loader = get_dataloaders(args, data_parallel=1)

    def loss_of(batch: dict) -> torch.Tensor:
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten())

    train_losses = []
    for it, batch in enumerate(train_loader):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, it, args.warmup_iters, args.max_iters, args.min_lr)
        loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train_losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        val_loss = torch.stack([loss_of(batch) for batch in val_loader]).mean().item()
    return {"train_loss": train_losses, "val_loss": {str(args.max_iters): val_loss}}


def test_the_example_pretrains_as_one_device(tmp_path):
    out_dir = tmp_path / "litgpt_pretrain"
    argv = [*SETTINGS, "--out-dir", str(out_dir)]
    proc = subprocess.run([sys.executable, "examples/litgpt_pretrain.py", *argv], cwd=REPO_ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "sp_size=2, world_size=2, ZeRO 2" in proc.stdout

    final = out_dir / "final"
    assert (final / MARKER).is_file()
    assert checkpoint_status(final) == (True, "")
    assert json.loads((final / MARKER).read_text())["sp_size"] == 2

    got = json.loads((out_dir / "losses.json").read_text())
    expected = single_device_losses(argv)
    assert len(got["train_loss"]) == 3 and got["val_loss"].keys() == expected["val_loss"].keys()
    pairs = [*zip(got["train_loss"], expected["train_loss"]),
             *((got["val_loss"][k], v) for k, v in expected["val_loss"].items())]
    worst = max(rel_diff(a, b) for a, b in pairs)
    print(f"largest relative loss difference from one device: {worst:.2e}")
    assert worst <= 1e-5, (got, expected)
