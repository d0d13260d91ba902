"""bf16 under SP=2 as users run it (``tests/test_bf16.py``): the tiny Llama's LM loss and a DPO objective through a
real Trainer with Lightning's ``bf16-true`` / ``bf16-mixed`` precision, at ZeRO 2 and at ZeRO 3 with every parameter
partitioned. One launch: the LM fits (:func:`tests.support.training.fit_one`) and the objectives
(:func:`tests.scenarios.post_training._fit`)."""

from __future__ import annotations

from tests.scenarios.post_training import _fit as fit_objective
from tests.support.training import FitSpec, fit_one


def run(payload: dict) -> dict:
    results = {name: fit_one(FitSpec(**spec))[0] for name, spec in payload["lm"].items()}
    results.update({case["name"]: fit_objective(case) for case in payload["objectives"]})
    return results
