"""bf16 as users run it: under SP=2, Lightning's ``bf16-true`` and ``bf16-mixed`` (DeepSpeed's bf16 mode: bf16
weights and activations, float32 master weights) and bf16 switched on in the user's own DeepSpeed config, at ZeRO 2
and at ZeRO 3 with every parameter partitioned, with SGD and with Adam, for the model's LM loss and for a DPO
objective reduced with ``strategy.sequence_sum``.

Criterion (SP adds no error beyond bf16's own): against a float64 run of the same training on one device, SP's
per-step losses and its weight updates are off by at most twice what the same training in bf16 on one device is off
(plain PyTorch: bf16 model, float32 master weights, SGD). An exchange on the wrong heads or positions, or a reduction
that rounds twice, is off by more. The measured ratios are in docs/performance.md#bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.launcher import launch
from tests.support.models import TokenDataset, build_llama, lightning_order, tiny_llama_config
from tests.support.precision import loss_error, sgd_in_dtype, update_error
from tests.test_parity import LR, SEQ_LEN, STEPS, _run

pytestmark = pytest.mark.multiprocess

ADAM_LR = 1e-2
LM_RUNS = {
    "lm_bf16_true_zero2": _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS, trainer={"precision": "bf16-true"}),
    "lm_bf16_mixed_zero3": _run(3, 2, sp_size=2, batch_size=1, num_rows=STEPS, trainer={"precision": "bf16-mixed"},
                                strategy={"config": {"zero_optimization": {
                                    "stage": 3, "stage3_param_persistence_threshold": 0},
                                    "zero_allow_untested_optimizer": True}}),
    # bf16 switched on in the user's own DeepSpeed config (Lightning's precision left at its default "32-true"):
    # DeepSpeed casts the model to bf16 and keeps float32 master weights, as bf16-mixed does
    "lm_bf16_deepspeed_config_zero2": _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS, strategy={"config": {
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}}),
    # Adam (float32 master weights and moments, as DeepSpeed keeps them)
    "lm_bf16_true_adam_zero2": replace(_run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS,
                                            trainer={"precision": "bf16-true"}, optimizer="adam"), lr=ADAM_LR),
    # the ALST memory switches (tiled MLP and loss, offloaded checkpoints) and ring attention (ring 2 x Ulysses 1)
    "lm_bf16_true_alst_zero2": _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS, trainer={"precision": "bf16-true"},
                                    strategy={"tiled_mlp": 4, "tiled_loss": 4, "offload_checkpoints": True}),
    "lm_bf16_true_ring_zero2": _run(2, 2, sp_size=2, batch_size=1, num_rows=STEPS, trainer={"precision": "bf16-true"},
                                    strategy={"ring_size": 2}),
}
OBJECTIVE_RUNS = [
    {"name": "dpo_bf16_true_zero2", "objective": "dpo", "stage": 2, "trainer": {"precision": "bf16-true"}},
    # log-probabilities left in bf16 (TRL's bf16 path): sequence_sum must accumulate them in float32 and round once
    {"name": "dpo_bf16_logps_zero2", "objective": "dpo_logps_in_model_dtype", "stage": 2,
     "trainer": {"precision": "bf16-true"}},
    {"name": "dpo_bf16_logps_zero3", "objective": "dpo_logps_in_model_dtype", "stage": 3,
     "trainer": {"precision": "bf16-mixed"}},
]
RATIO = 2.0


@pytest.fixture(scope="module")
def runs():
    from dataclasses import asdict

    payload = {"lm": {name: asdict(run) for name, run in LM_RUNS.items()}, "objectives": OBJECTIVE_RUNS}
    return launch(2, "bf16:run", payload, timeout=900)


def lm_one_device(dtype: torch.dtype, optimizer: str = "sgd", lr: float = LR, buffers_too: bool = True) -> dict:
    model = build_llama(tiny_llama_config(num_kv_heads=2))
    dataset = TokenDataset(STEPS, SEQ_LEN)
    order = lightning_order(len(dataset))

    def loss_of_step(model, step):
        row = dataset[order[step]]
        return model(**{k: v[None] for k, v in row.items()}).loss

    return sgd_in_dtype(model, lambda m: dict(m.named_parameters()), loss_of_step, lr, dtype, optimizer, STEPS,
                        buffers_too)


def objective_one_device(objective: str, dtype: torch.dtype, buffers_too: bool = True) -> dict:
    from tests.support.objectives import (LEARNING_RATES, OBJECTIVES, PRECISION_OBJECTIVES, OneDevice, collate_pairs,
                                          preference_rows)
    from tests.test_post_training import LR as OBJECTIVE_LR
    from tests.test_post_training import Holder

    module = Holder(objective)
    pairs = preference_rows()
    order = lightning_order(len(pairs))

    def loss_of_step(module, step):
        batch = collate_pairs([pairs[i] for i in order[2 * step: 2 * step + 2]])
        return {**OBJECTIVES, **PRECISION_OBJECTIVES}[objective](OneDevice(), module, batch)

    def trainable(module):
        return {k: p for k, p in module.named_parameters() if k.startswith(("policy.", "value_head."))}

    return sgd_in_dtype(module, trainable, loss_of_step, LEARNING_RATES.get(objective, OBJECTIVE_LR), dtype,
                        steps=STEPS, buffers_too=buffers_too)


CASES = [(name, "lm") for name in LM_RUNS] + [(case["name"], case["objective"]) for case in OBJECTIVE_RUNS]


@pytest.mark.parametrize("name,kind", CASES)
def test_bf16_under_sp_adds_no_error_beyond_bf16s_own(runs, name, kind, record_property):
    run = LM_RUNS.get(name)
    # DeepSpeed's bf16 mode (bf16-mixed, bf16 in its config) casts the parameters and keeps float32 buffers (rotary
    # inv_freq); Lightning's bf16-true casts the whole module: the one-device reference casts as the run does
    trainer = run.trainer if run is not None else next(c["trainer"] for c in OBJECTIVE_RUNS if c["name"] == name)
    buffers_too = trainer.get("precision") == "bf16-true"
    reference = (lambda dtype: lm_one_device(dtype, run.optimizer, run.lr, buffers_too)) if kind == "lm" else (
        lambda dtype: objective_one_device(kind, dtype, buffers_too))
    exact, one = reference(torch.float64), reference(torch.bfloat16)
    results = [r[name] for r in runs]
    for result in results:
        assert result.get("error_type") is None, result.get("message")
    assert results[0]["losses"] == results[1]["losses"]  # SP peers: the same full-sequence loss
    if kind == "lm":  # it trained in bf16 (else the criterion would pass trivially)
        assert results[0]["parameter_dtypes"] == ["torch.bfloat16"], results[0]["parameter_dtypes"]
    weights = results[0]["weights"]
    if kind != "lm":
        weights = {k: v for k, v in weights.items() if k in exact["weights"]}
    sp_loss, one_loss = loss_error(results[0]["losses"], exact["losses"]), loss_error(one["losses"], exact["losses"])
    sp_update = update_error(weights, one["initial"], exact)
    one_update = update_error(one["weights"], one["initial"], exact)
    for key, value in (("sp_loss_error", sp_loss), ("one_device_loss_error", one_loss),
                       ("sp_update_error", sp_update), ("one_device_update_error", one_update)):
        record_property(key, f"{value:.3g}")
    print(f"{name}: loss error SP {sp_loss:.3g} / one device {one_loss:.3g}; update error SP {sp_update:.3g} /"
          f" one device {one_update:.3g}")
    assert sp_loss <= RATIO * one_loss + 1e-6, (sp_loss, one_loss, results[0]["losses"], exact["losses"])
    assert sp_update <= RATIO * one_update, (sp_update, one_update)
