"""The pre-flight memory check in real runs (``tests/test_preflight.py``): the tiny Llama at SP=2 under a
``memory_budget``, stopped before its first step, warned, or trained; and ``sp_size="auto"`` (the tiny Llama or a
tiny Qwen3) choosing its size under a budget."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config, tiny_qwen3_config
from tests.support.training import Recorder, make_trainer


def _fit(case: dict) -> dict:
    seed_everything(SEED, verbose=False)
    if case.get("model") == "hybrid":  # a Qwen3.5-like hybrid: a gated delta net layer and an attention layer
        from tests.support.architectures import build_config

        config = build_config("qwen3_5_text")
    else:
        config = tiny_qwen3_config() if case.get("model") == "qwen3" else tiny_llama_config(num_kv_heads=2)
    module = CausalLM(config, lr=0.5, dataset=TokenDataset(3, 64), batch_size=1)
    initial = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    recorder = Recorder()
    strategy = UlyssesDeepSpeedStrategy(stage=case["stage"], **{"sp_size": 2, **case["strategy"]})
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
    result["chosen_sp_size"] = strategy.auto_choice.sp_size if strategy.auto_choice is not None else None
    result["weights"] = recorder.weights if result["error_type"] is None else None  # gathered at ZeRO 3
    return result


def run(payload: dict) -> dict:
    return {case["name"]: _fit(case) for case in payload["cases"]}
