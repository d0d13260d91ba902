"""Scenarios for model forms the strategy is not told about (``tests/support/forms.py``): SGD fits, evaluation
outside ``fit`` (``trainer.predict/test/validate`` with no fit before), and the model-form guard stopping a form
whose output depends on the shard."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.forms import ENCODER_FORMS, OWN_FORMS, FormModule, MaskedTokenDataset, SDPACore
from tests.support.models import SEED, PackedDataset, TokenDataset
from tests.support.training import make_trainer, run_cases


def dataset_for(run: dict):
    if run["form"] in ENCODER_FORMS:
        return MaskedTokenDataset(run["num_rows"], run["seq_len"])
    if run.get("packed"):
        return PackedDataset(run["packed"])
    return TokenDataset(run["num_rows"], run["seq_len"])


def _strategy(run: dict) -> UlyssesDeepSpeedStrategy:
    options = dict(run.get("strategy", {}))
    if run["form"] in OWN_FORMS:
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


# What each mutation removes: the fix of one model-form row, so that the model-form check must catch the form.
def _mutate(name: str, undo: list) -> None:
    import lightning_ulysses.models.calls as calls
    import lightning_ulysses.models.hf as hf
    from lightning_ulysses.models.preparation import PreparedModels

    def patch(owner, attribute, value):
        undo.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, value)

    if name == "rope":  # length-dependent RoPE back on the shard's own largest position
        patch(hf, "wrap_length_dependent_rotaries", lambda model, context: [])
    elif name == "input_pos":  # `input_pos` not filled in: the model counts 0..T-1 on every shard
        patch(calls, "POSITION_PARAMETERS", ("position_ids",))
    elif name == "encoder_window":  # bidirectional windows computed as causal ones
        import lightning_ulysses.models.hf_attention as hf_attention

        original = hf_attention._sdpa_causal

        class Causal:
            def __init__(self, module):
                self._module = module
                self.is_causal = True

            def __getattr__(self, attribute):
                return getattr(self._module, attribute)

        def causal_windows(inner, module, q, k, v, window, kwargs):
            if window is None or window >= q.shape[2]:
                return original(inner, module, q, k, v, window, kwargs)
            return original(inner, Causal(module), q, k, v, window, kwargs)

        patch(hf_attention, "_sdpa_causal", causal_windows)
    elif name == "litgpt_rope":  # LitGPT's RoPE rows back to its own cos[:T] of the local length
        import lightning_ulysses.models.litgpt as litgpt_models

        patch(litgpt_models, "_rows_of_global_positions", lambda *args, **kwargs: None)
    elif name == "eval_hooks":  # Lightning's inference set-up removes the call completion and nothing notices
        patch(PreparedModels, "reinstall_hooks", lambda self, context: None)
        patch(PreparedModels, "check_hooks", lambda self: None)


@contextmanager
def _mutated(run: dict):
    """The run's mutation (if any) applied inside the block, undone after."""
    undo: list = []
    _mutate(run.get("mutation", ""), undo)
    try:
        yield
    finally:
        for owner, attribute, value in reversed(undo):
            setattr(owner, attribute, value)


def fit(payload: dict) -> dict:
    """SGD fits of forms; per run the losses, the final weights (rank 0), or the error a refused run raised."""

    def one(run: dict) -> dict:
        with _mutated(run):
            return _fit_one(run)

    return run_cases(payload["runs"], one)


def _fit_one(run: dict) -> dict:
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
    return {"losses": losses, "weights": _weights(module) if dist.get_rank() == 0 else None,
            "form_checks": trainer.strategy.form_checks_run}


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
        try:
            with _mutated(run):
                return _evaluate_one(run)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}

    return run_cases(payload["runs"], one)


def _evaluate_one(run: dict) -> dict:
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


def tuner(payload: dict) -> dict:
    """``Tuner(trainer).lr_find(module)`` and ``scale_batch_size``: refused before any step."""
    from lightning.pytorch.tuner import Tuner

    out = {}
    for method in ("lr_find", "scale_batch_size"):
        seed_everything(SEED, verbose=False)
        module = FormModule("llama-yarn", TokenDataset(4, 32))
        module.batch_size = 1
        trainer = make_trainer(_strategy({"stage": 2, "form": "llama-yarn"}), 2)
        try:
            getattr(Tuner(trainer), method)(module)
            out[method] = "no error"
        except Exception as err:
            out[method] = f"{type(err).__name__}: {err}"
    return out
