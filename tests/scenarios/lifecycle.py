"""fit, validate, test and a second Trainer's fit in one process (``tests/test_lifecycle.py``)."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.patches import active_patches
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import Recorder, make_trainer


def run(payload: dict) -> dict:
    """fit (epoch with a smaller last batch) → validate → test → a second Trainer's fit, in one process."""
    from transformers import PreTrainedModel

    stage = payload["stage"]
    seed_everything(SEED, verbose=False)
    config = tiny_llama_config(num_kv_heads=2)
    dataset = TokenDataset(payload["num_rows"], payload["seq_len"])
    module = PredictingLM(config, lr=0.5, dataset=dataset, batch_size=payload["batch_size"])
    recorder = Recorder()
    patches = PatchRecorder()
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), max_steps=-1, max_epochs=1,
                           callbacks=[recorder, patches], limit_val_batches=1.0)
    trainer.fit(module)
    left = {"fit": active_patches()}
    restored = plain_state(module)
    val = trainer.validate(module, verbose=False)[0]["val_loss"]
    left["validate"] = active_patches()
    test = trainer.test(module, verbose=False)[0]["test_loss"]
    left["test"] = active_patches()
    predict_loader = module.test_dataloader()
    collate_before = predict_loader.collate_fn
    trainer.predict(module, predict_loader)
    left["predict"] = active_patches()
    predict_loader_untouched = predict_loader.collate_fn is collate_before
    failing = FailingStep(config, lr=0.5, dataset=dataset, batch_size=payload["batch_size"])
    failed = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), max_steps=3, callbacks=[PatchRecorder()])
    try:
        failed.fit(failing)
        failure = None
    except RuntimeError as err:
        failure = str(err)
    left["failed fit"] = active_patches()
    second_recorder = Recorder()
    second = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), max_steps=2, callbacks=[second_recorder])
    second.fit(module)
    return {
        "losses": recorder.losses,
        "input_shapes": recorder.input_shapes,
        "weights_after_first_fit": recorder.weights if torch.distributed.get_rank() == 0 else None,
        "restored": restored,
        "patches_during_fit": patches.seen,
        "patches_left": left,
        "failure": failure,
        "failed_model_plain": plain_state(failing),
        "predict_loader_untouched": predict_loader_untouched,
        "val_loss": float(val),
        "test_loss": float(test),
        "second_fit_losses": second_recorder.losses,
        "is_pretrained": isinstance(module.model, PreTrainedModel),
    }


def plain_state(module) -> dict:
    return {
        "attn_implementation": module.model.config._attn_implementation,
        "has_sp_loss": "_loss_function" in module.model.__dict__,
        "use_cache": module.model.config.use_cache,
    }


class PatchRecorder(Callback):
    """The patches in effect at the first training batch."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.seen = active_patches()


class PredictingLM(CausalLM):
    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"]).logits


class FailingStep(CausalLM):
    """Fails in its second training step (after one optimizer step)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("the user's step failed")
        return super().training_step(batch, batch_idx)


def probe_mutation(payload: dict) -> dict:
    """DeepSpeed's gradient averaging changed (mutated to halve the averaged gradients): the fit stops at set-up,
    before any step, with the strategy's divisor error."""
    from lightning_ulysses.training import gradient_factor

    stage = payload["stage"]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Optimizer

        name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
        original = getattr(Optimizer, name)

        def mutated(self, *args, **kwargs):
            return [grad * 0.5 for grad in original(self, *args, **kwargs)]
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Optimizer

        name = "average_tensor"
        original = getattr(Optimizer, name)

        def mutated(self, tensor, *args, **kwargs):
            tensor.mul_(0.5)
            return original(self, tensor, *args, **kwargs)

    gradient_factor._VERIFIED.clear()  # the divisor was measured in this process already: measure again
    setattr(Optimizer, name, mutated)
    seed_everything(SEED, verbose=False)
    module = CausalLM(tiny_llama_config(num_kv_heads=2), lr=0.5, dataset=TokenDataset(4, 16), batch_size=2)
    recorder = Recorder()
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), max_steps=2, callbacks=[recorder])
    try:
        trainer.fit(module)
        error = None
    except RuntimeError as err:
        error = str(err)
    finally:
        setattr(Optimizer, name, original)
    return {"error": error, "steps": len(recorder.losses), "patches_left": active_patches()}


class BranchLM(CausalLM):
    """A term from a parameter used in the first step only (a branch a later step does not take)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extra = torch.nn.Linear(4, 1, bias=False)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 0:
            loss = loss + self.extra(torch.ones(1, 4, device=self.device)).sum()
        return loss


class ExtraWeight(Callback):
    def __init__(self) -> None:
        self.values: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import deepspeed

        weight = pl_module.extra.weight
        with deepspeed.zero.GatheredParameters([weight], enabled=trainer.strategy.zero_stage_3):
            self.values.append(weight.detach().flatten().tolist())


def unused_parameter(payload: dict) -> dict:
    """ZeRO-3: a parameter used in step 1 only must stay put in steps 2 and 3 (DeepSpeed keeps its gradient partition
    and would apply it again; the strategy clears the partitions after every optimizer step)."""
    seed_everything(SEED, verbose=False)
    module = BranchLM(tiny_llama_config(num_kv_heads=2), lr=0.5, dataset=TokenDataset(4, 16), batch_size=1)
    before = module.extra.weight.detach().flatten().tolist()
    recorder = ExtraWeight()
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=payload["stage"]), max_steps=3,
                           callbacks=[recorder])
    trainer.fit(module)
    values = [before] + recorder.values
    return {"moves": [max(abs(a - b) for a, b in zip(old, new)) for old, new in zip(values, values[1:])]}
