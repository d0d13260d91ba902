"""The pre-flight memory check in real runs (``tests/test_preflight.py``): the tiny Llama at SP=2 under a
``memory_budget``, stopped before its first step, warned, or trained."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import Recorder, make_trainer


def _fit(case: dict) -> dict:
    seed_everything(SEED, verbose=False)
    module = CausalLM(tiny_llama_config(num_kv_heads=2), lr=0.5, dataset=TokenDataset(3, 64), batch_size=1)
    initial = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    recorder = Recorder()
    strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=case["stage"], **case["strategy"])
    result = {"error_type": None, "message": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            make_trainer(strategy, 3, callbacks=[recorder]).fit(module)
        except Exception as err:  # noqa: BLE001 - the test reads type and message
            result.update(error_type=type(err).__name__, message=str(err))
    result["warnings"] = [str(w.message) for w in caught if "pre-flight" in str(w.message)]
    result["losses"] = recorder.losses
    result["unchanged"] = all(torch.equal(initial[k], v.detach()) for k, v in module.model.named_parameters())
    return result


def run(payload: dict) -> dict:
    return {case["name"]: _fit(case) for case in payload["cases"]}
