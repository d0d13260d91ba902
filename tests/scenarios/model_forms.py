"""Scenarios for model forms the strategy is not told about (``tests/support/forms.py``): SGD fits, evaluation
outside ``fit`` (``trainer.predict/test/validate`` with no fit before), and the model-form guard stopping a form
whose output depends on the shard."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.forms import FormModule, SDPACore
from tests.support.models import SEED, PackedDataset, TokenDataset
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer, run_cases


def dataset_for(run: dict):
    if run.get("packed"):
        return PackedDataset(run["packed"])
    return TokenDataset(run["num_rows"], run["seq_len"])


def _strategy(run: dict) -> UlyssesDeepSpeedStrategy:
    options = dict(run.get("strategy", {}))
    if run.get("own"):
        options.setdefault("attention_modules", [SDPACore])
    if run.get("packed"):
        options.setdefault("sdpa_per_document", True)
    return UlyssesDeepSpeedStrategy(sp_size=run.get("sp_size", 2), stage=run["stage"], **options)


def _weights(module) -> dict:
    import deepspeed

    params = dict(module.model.named_parameters())
    strategy = module.trainer.strategy
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=strategy.zero_stage_3):
        return {k: v.detach().float().clone() for k, v in params.items()}


def fit(payload: dict) -> dict:
    """SGD fits of forms; per run the losses, the final weights (rank 0), or the error a refused run raised."""

    def one(run: dict) -> dict:
        seed_everything(SEED, verbose=False)
        module = FormModule(run["form"], dataset_for(run), step=run.get("step", "auto"))
        losses: list[float] = []

        class Record(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                losses.append(outputs["loss"].item())

        trainer = make_trainer(_strategy(run), run["steps"], callbacks=[Record()])
        started = time.monotonic()
        try:
            trainer.fit(module)
        except Exception as err:  # a refused form: what was said, and that no weight changed
            return {"error": f"{type(err).__name__}: {err}", "losses": losses, "seconds": time.monotonic() - started,
                    "changed": _changed_since_build(module, run)}
        return {"losses": losses, "weights": _weights(module) if dist.get_rank() == 0 else None}

    return run_cases(payload["runs"], one)


def _changed_since_build(module, run: dict) -> float:
    """Largest change of any weight against a fresh build of the same form (0: nothing was trained)."""
    import deepspeed

    from tests.support.forms import build_form

    fresh = dict(build_form(run["form"]).named_parameters())
    params = dict(module.model.named_parameters())
    strategy = module.trainer.strategy
    enabled = strategy.zero_stage_3 and all(hasattr(p, "ds_id") for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=enabled):
        return max((params[k].detach().float() - fresh[k].float()).abs().max().item() for k in fresh)


def evaluate(payload: dict) -> dict:
    """``trainer.predict``, ``trainer.validate``, ``trainer.test`` on a fresh Trainer each (no fit before)."""

    def one(run: dict) -> dict:
        seed_everything(SEED, verbose=False)
        module = FormModule(run["form"], dataset_for(run), step=run.get("step", "auto"))
        out = {}
        trainer = make_trainer(_strategy(run), 1, limit_val_batches=None)
        out["predict"] = [p.detach().float() for p in trainer.predict(module)]
        for kind in ("validate", "test"):
            trainer = make_trainer(_strategy(run), 1, limit_val_batches=None)
            metrics = getattr(trainer, kind)(module, verbose=False)
            out[kind] = {k: float(v) for k, v in metrics[0].items()}
        return out

    return run_cases(payload["runs"], evaluate_one_guarded(one))


def evaluate_one_guarded(one):
    def run(case: dict) -> dict:
        try:
            return one(case)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}

    return run
