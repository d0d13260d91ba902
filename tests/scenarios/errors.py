"""Bad configurations through a real Trainer, one after the other in the same processes, then a good fit.

Run by ``tests/test_errors.py`` as ``launch(2, "errors:run", payload)``. Each case reports the
exception (type and message) and how much compute ran before it (``training_step`` calls and forward calls of the
Hugging Face model), plus whether the model was left switched to Ulysses.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.models import hf
from tests.support.models import CountingCausalLM, TokenDataset, tiny_llama_config
from tests.support.training import make_trainer


def _fit(case: dict) -> dict:
    module = CountingCausalLM(tiny_llama_config(**case.get("config", {})), dataset=TokenDataset(8, 8), batch_size=1)
    attn_before = module.model.config._attn_implementation
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=case["sp_size"]), max_steps=case.get("max_steps", 2))
    result: dict[str, Any] = {"error_type": None, "message": None}
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on the type
        result.update(error_type=type(err).__name__, message=str(err))
    result.update(
        steps=module.steps,
        forwards=module.forwards,
        losses=module.losses,
        global_step=trainer.global_step,
        attn_before=attn_before,
        attn_after=module.model.config._attn_implementation,
        prepared_after=hf.is_prepared(module.model),
        pg_initialized=torch.distributed.is_initialized(),
    )
    return result


def run(payload: dict) -> dict:
    # Lightning's LightningEnvironment.teardown deletes WORLD_SIZE after every fit (failed or not); a fit that failed
    # before the process group existed would leave make_trainer without a world size, so put the launcher's back.
    world_size = os.environ["WORLD_SIZE"]
    results = {}
    for case in payload["cases"]:
        os.environ["WORLD_SIZE"] = world_size
        results[case["name"]] = _fit(case)
    return results
