"""The run-time drift check through a real Trainer and a real Fabric launch, one case after the other in the same
processes: versions faked as untested (``guard.TESTED_VERSIONS``) and a touch point faked as changed (a Lightning
digest), on every rank or on one.

Run by ``tests/test_drift.py`` as ``launch(2, "drift:run", payload)``. Each case reports the exception (type and
message), the steps and forward calls that ran, whether any weight changed, the warnings rank zero showed and the
losses.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.drift import guard, touch_points
from tests.support.models import CountingCausalLM, TokenDataset, tiny_llama_config
from tests.support.training import make_trainer

ENGINE_SETUP = "_setup_model_and_optimizer"
FABRIC_ENGINE = "_initialize_engine"


@contextmanager
def faked(case: dict, rank: int) -> Iterator[None]:
    """This rank's faked stack: ``untested`` overrides the tested versions; ``changed`` replaces the digest of the
    Trainer's and Fabric's engine set-up (what a new Lightning release would show)."""
    applies = case.get("ranks") is None or rank in case["ranks"]
    tested, setup, fabric = (dict(guard.TESTED_VERSIONS), dict(touch_points.LIGHTNING_ENGINE_SETUP),
                             dict(touch_points.FABRIC_OVERRIDDEN))
    env = os.environ.get(guard.ALLOW_UNTESTED_ENV)
    try:
        if applies:
            guard.TESTED_VERSIONS.update(case.get("untested", {}))
            if case.get("changed"):
                touch_points.LIGHTNING_ENGINE_SETUP[ENGINE_SETUP] = ("0" * 16, setup[ENGINE_SETUP][1])
                touch_points.FABRIC_OVERRIDDEN[FABRIC_ENGINE] = "0" * 16
        if case.get("allow_env"):
            os.environ[guard.ALLOW_UNTESTED_ENV] = "1"
        yield
    finally:
        guard.TESTED_VERSIONS.clear()
        guard.TESTED_VERSIONS.update(tested)
        touch_points.LIGHTNING_ENGINE_SETUP.update(setup)
        touch_points.FABRIC_OVERRIDDEN.update(fabric)
        if env is None:
            os.environ.pop(guard.ALLOW_UNTESTED_ENV, None)


def _trainer_fit(case: dict) -> dict:
    torch.manual_seed(0)
    module = CountingCausalLM(tiny_llama_config(), dataset=TokenDataset(8, 16), batch_size=1, lr=0.1)
    before = {k: v.detach().clone() for k, v in module.named_parameters()}
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, allow_untested_versions=case.get("allow", False)),
                           max_steps=2)
    result: dict[str, Any] = {"error_type": None, "message": None}
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on the type
        result.update(error_type=type(err).__name__, message=str(err))
    after = dict(module.named_parameters())
    result.update(steps=module.steps, forwards=module.forwards, losses=module.losses,
                  weights_changed=any(not torch.equal(before[k], after[k].detach()) for k in before))
    return result


def _fabric_setup(case: dict) -> dict:
    import lightning as L

    from lightning_ulysses.fabric import UlyssesDeepSpeedStrategy as FabricStrategy

    strategy = FabricStrategy(sp_size=2, stage=2, allow_untested_versions=case.get("allow", False))
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      precision="32-true")
    result: dict[str, Any] = {"error_type": None, "message": None}
    try:
        fabric.launch()
    except Exception as err:  # noqa: BLE001
        result.update(error_type=type(err).__name__, message=str(err))
    return result


def run(payload: dict) -> dict:
    world_size = os.environ["WORLD_SIZE"]  # Lightning's teardown deletes it after every fit (see errors.py)
    rank = int(os.environ["RANK"])
    results = {}
    for case in payload["cases"]:
        os.environ["WORLD_SIZE"] = world_size
        with faked(case, rank), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _fabric_setup(case) if case.get("front_end") == "fabric" else _trainer_fit(case)
        result["warnings"] = [str(w.message) for w in caught if "lightning-ulysses was tested" in str(w.message)]
        results[case["name"]] = result
    return results
