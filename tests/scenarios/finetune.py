"""Fine-tuning scenarios (run inside the worker processes): pretrained Hugging Face models built where Lightning says
large models belong (``configure_model``), LoRA, gradient checkpointing, packing collators, evaluation from
checkpoints. Each returns plain data for the test process to compare with a plain single process."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED
from tests.support.training import make_trainer


def build_hf_model(spec: dict) -> torch.nn.Module:
    """The model a user builds: ``from_pretrained`` of a local directory or ``from_config``, optionally wrapped with
    LoRA and with gradient checkpointing on (exactly the calls a user makes, in that order)."""
    from transformers import AutoModelForCausalLM

    if "path" in spec:
        model = AutoModelForCausalLM.from_pretrained(spec["path"], attn_implementation="sdpa", dtype=torch.float32)
    else:
        torch.manual_seed(spec.get("init_seed", 0))
        model = AutoModelForCausalLM.from_config(spec["config"], attn_implementation="sdpa", dtype=torch.float32)
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=spec["gradient_checkpointing"])
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(spec.get("lora_seed", 0))
        model = get_peft_model(model, LoraConfig(**spec["lora"]))
    return model


class FinetuneLM(LightningModule):
    """A user's fine-tuning module: the HF model is built in ``configure_model`` (or in ``__init__``)."""

    def __init__(self, spec: dict, dataset, batch_size: int = 1, lr: float = 0.5, collate_fn=None,
                 build_in: str = "configure_model") -> None:
        super().__init__()
        self.spec, self.dataset, self.batch_size, self.lr, self.collate_fn = spec, dataset, batch_size, lr, collate_fn
        self.model: Optional[torch.nn.Module] = build_hf_model(spec) if build_in == "__init__" else None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_hf_model(self.spec)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)
        self.log("val_at_step", float(self.global_step))  # lets ModelCheckpoint's "best" be the first checkpoint

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(**batch).loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        return self.model(**inputs).logits

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def _loader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=self.collate_fn)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def _gathered(module: torch.nn.Module, zero3: bool, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    import deepspeed

    params = {k: p for k, p in module.named_parameters() if p.requires_grad or not trainable_only}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=zero3):
        return {k: p.detach().float().cpu().clone() for k, p in params.items()}


class FinetuneRecorder(Callback):
    """Losses per step, the weights before the first and after the last step (gathered under ZeRO-3), how many
    times the attention modules ran per step (once per layer; twice with gradient checkpointing: forward and the
    recompute in backward; transformers checkpoints a decoder layer's ``forward``, so hooks on the layer itself do
    not see the recompute), and the modes the HF model was in."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.final: dict[str, torch.Tensor] = {}
        self.layer_calls_per_step: list[int] = []
        self.modules_in_train_mode_at_step0: Optional[tuple[int, int]] = None
        self._calls = 0
        self._hooks: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        zero3 = trainer.strategy.zero_stage_3
        self.initial = _gathered(pl_module.model, zero3)
        modules = list(pl_module.model.modules())
        self.modules_in_train_mode_at_step0 = (sum(m.training for m in modules), len(modules))
        for name, module in pl_module.model.named_modules():
            if name.endswith("self_attn"):
                self._hooks.append(module.register_forward_pre_hook(self._count))

    def _count(self, *_: Any) -> None:
        from lightning_ulysses.models.form_check import probe_running

        self._calls += 0 if probe_running() else 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].float().item())
        self.layer_calls_per_step.append(self._calls)

    def on_train_end(self, trainer, pl_module) -> None:
        for hook in self._hooks:
            hook.remove()
        self.final = _gathered(pl_module.model, trainer.strategy.zero_stage_3)


def finetune(payload: dict) -> dict:
    """Fits described by ``payload["cases"]``: spec (how the model is built), dataset, stage, sp_size (default 2),
    strategy/trainer kwargs, a checkpoint to resume from; returns losses, initial/final weights (rank 0), layer calls per step and the model's modes."""
    out = {}
    for name, case in payload["cases"].items():
        seed_everything(SEED, verbose=False)
        module = FinetuneLM(case["spec"], case["dataset"], case.get("batch_size", 1), case.get("lr", 0.5),
                            case.get("collate_fn"), case.get("build_in", "configure_model"))
        recorder = FinetuneRecorder()
        strategy = UlyssesDeepSpeedStrategy(sp_size=case.get("sp_size", 2), stage=case["stage"],
                                            **case.get("strategy", {}))
        trainer = make_trainer(strategy, case.get("steps", 3), callbacks=[recorder], **case.get("trainer", {}))
        result: dict[str, Any] = {}
        try:
            trainer.fit(module, ckpt_path=case.get("resume"))
            if "save_to" in case:
                trainer.save_checkpoint(case["save_to"])
        except Exception as err:  # noqa: BLE001 - the test asserts on type and message
            result["error"] = (type(err).__name__, str(err))
            out[name] = result
            continue
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        rank = torch.distributed.get_rank()
        hf_model = module.model.get_base_model() if hasattr(module.model, "get_base_model") else module.model
        result.update(
            losses=recorder.losses,
            initial=recorder.initial if rank == 0 else None,
            final=recorder.final if rank == 0 else None,
            layer_calls_per_step=recorder.layer_calls_per_step,
            train_modules_at_start=recorder.modules_in_train_mode_at_step0,
            model_training_after_fit=hf_model.training,
            zero3_flag_after_fit=is_deepspeed_zero3_enabled(),
        )
        out[name] = result
    return out


def evaluate_from_checkpoint(payload: dict) -> dict:
    """Per ZeRO stage: fit ``epochs`` epochs with validation after each and a ``ModelCheckpoint`` whose "best" is the
    first checkpoint (``monitor="val_at_step", mode="min"``: not the last weights), plus ``save_last`` (with
    ``save_top_k=-1``: Lightning 2.6 writes "last" only in a step that saved a top-k checkpoint); then
    ``validate(ckpt_path="best")``, ``validate(ckpt_path=<the best path>)``, ``test(ckpt_path="last")`` and
    ``predict(ckpt_path=<the best path>)``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = {}
    for stage in payload["stages"]:
        seed_everything(SEED, verbose=False)
        module = FinetuneLM(payload["spec"], payload["dataset"])
        checkpoints = ModelCheckpoint(dirpath=f"{payload['dirpath']}/zero{stage}", monitor="val_at_step", mode="min",
                                      save_top_k=-1, save_last=True, filename="{step}")
        trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), -1, callbacks=[checkpoints],
                               max_epochs=payload["epochs"], enable_checkpointing=True, limit_val_batches=1.0)
        trainer.fit(module)
        best = checkpoints.best_model_path
        out[stage] = {
            "best": best.rsplit("/", 1)[-1],
            "validate_best": trainer.validate(module, ckpt_path="best", verbose=False)[0]["val_loss"],
            "test_last": trainer.test(module, ckpt_path="last", verbose=False)[0]["test_loss"],
            "validate_path": trainer.validate(module, ckpt_path=best, verbose=False)[0]["val_loss"],
            "predict_best": [p.float() for p in trainer.predict(module, ckpt_path=best)],
        }
    return out
