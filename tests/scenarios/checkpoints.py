"""Checkpoint scenarios, run by ``tests/test_checkpoints.py`` as ``launch(N, "checkpoints:fits", ...)``.

Each fit goes through a real Trainer (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``) with
SGD + momentum and a per-step ``StepLR``, over two shuffled epochs, so the optimizer state, the scheduler state and
the position in the epoch all change the losses of a resumed run. Directories live under ``payload["root"]``, shared
by all ranks. A fit may also kill its own process (SIGKILL) at a chosen point, to leave what a crash leaves.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_ulysses  # noqa: F401  (registers the strategy names)
from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, VOCAB, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer

LR, MOMENTUM, LR_STEP, LR_GAMMA = 0.1, 0.9, 3, 0.5
KV_HEADS = 2


def predict_inputs(rows: int = 2, seq_len: int = 24) -> torch.Tensor:
    """Fixed token rows whose logits the SP model and the exported model must agree on."""
    return torch.randint(1, VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(99))


class RowDataset(TokenDataset):
    """TokenDataset whose samples also carry their row index (a [B] tensor passes the collate step unchanged)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "row_id": torch.tensor(i)}


class MomentumLM(CausalLM):
    """SGD with momentum and a StepLR stepped every optimizer step: both states shape every later loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.predict_shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        return super().training_step({k: v for k, v in batch.items() if k != "row_id"}, batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step({k: v for k, v in batch.items() if k != "row_id"}, batch_idx)

    def predict_step(self, batch, batch_idx):
        self.predict_shapes.append(tuple(batch["input_ids"].shape))  # this rank's shard
        return self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=MOMENTUM)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP, gamma=LR_GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepLog(Callback):
    """Per optimizer step: (global_step, loss, lr, the dataset rows this replica trained on, Lightning's batch_idx in
    the epoch)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float, list[int]]] = []
        self._rows: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._rows = batch["row_id"].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.steps.append((trainer.global_step, outputs["loss"].float().item(), lr, self._rows, batch_idx))


class KillWhileSaving(Callback):
    """SIGKILL this process during the n-th checkpoint save, at the moment DeepSpeed would write this rank's ZeRO
    shard: the other ranks have begun writing theirs (and rank 0 DeepSpeed's ``latest``)."""

    def __init__(self, save_number: int) -> None:
        self.save_number = save_number

    def on_train_start(self, trainer, pl_module) -> None:
        engine = trainer.strategy.deepspeed_engine
        original = engine._save_zero_checkpoint
        calls = {"n": 0}

        def save_zero_checkpoint(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == self.save_number:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        engine._save_zero_checkpoint = save_zero_checkpoint


def _fit(run: dict, root: Path) -> dict[str, Any]:
    seed_everything(SEED, verbose=False)
    dataset = RowDataset(run["num_rows"], run["seq_len"])
    module = MomentumLM(tiny_llama_config(num_kv_heads=KV_HEADS, layers=run.get("layers", 2)), lr=LR, dataset=dataset,
                        batch_size=run["batch_size"])
    for name, parameter in module.named_parameters():  # a frozen part, as a LoRA fine-tune has
        if any(part in name for part in run.get("frozen", ())):
            parameter.requires_grad_(False)
        if any(part in name for part in run.get("scramble", ())):  # other starting weights: only a load restores them
            with torch.no_grad():
                parameter.mul_(1.5)
    log = StepLog()
    callbacks: list[Callback] = [log]
    if run.get("ckpt_every"):
        callbacks.append(ModelCheckpoint(dirpath=root / run["ckpt_dir"], every_n_train_steps=run["ckpt_every"],
                                         save_top_k=-1, filename="{step}"))
    if run.get("kill_rank") == int(os.environ["RANK"]):
        callbacks.append(KillWhileSaving(run["kill_at_save"]))
    strategy = UlyssesDeepSpeedStrategy(sp_size=run["sp_size"], stage=run["stage"], **run.get("strategy", {}))
    trainer = make_trainer(strategy, run.get("max_steps", -1), callbacks=callbacks, max_epochs=run["max_epochs"],
                           enable_checkpointing=bool(run.get("ckpt_every")),
                           **({"limit_val_batches": None} if run.get("validate") else {}), **run.get("trainer", {}))
    if run.get("validate"):  # only validate this checkpoint (of any layout) with this run's layout
        metrics = trainer.validate(module, ckpt_path=str(root / run["validate"]), verbose=False)[0]
        return {"val_loss": metrics["val_loss"]}
    resume = run.get("resume")
    trainer.fit(module, ckpt_path=str(root / resume) if resume else None)
    out: dict[str, Any] = {"steps": log.steps, "global_step": trainer.global_step}
    if run.get("save_to"):
        trainer.save_checkpoint(root / run["save_to"])
    if run.get("predict"):
        inputs = predict_inputs()
        loader = DataLoader([{"input_ids": row} for row in inputs], batch_size=len(inputs))
        out["logits"] = torch.cat(trainer.predict(module, dataloaders=loader)).float()
        out["predict_shapes"] = module.predict_shapes
        out["attn_after"] = module.model.config._attn_implementation
    return out


def fits(payload: dict) -> dict[str, Any]:
    """Fits one after the other in the same processes; ``may_fail`` ones report their exception instead."""
    root = Path(payload["root"])
    results = {}
    for name, run in payload["runs"].items():
        # Lightning's environment teardown removes WORLD_SIZE after each fit, failed or not.
        os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
        try:
            results[name] = _fit(run, root)
        except Exception as err:  # noqa: BLE001 - the test asserts on type and message
            if not run.get("may_fail"):
                raise
            results[name] = {"error": (type(err).__name__, str(err))}
    return results
