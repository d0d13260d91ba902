"""``torch.compile`` of the model a user trains with the strategy (issue 61), 2 ranks, sp 2, against one uncompiled
device (SGD, 3 steps, fp32): the same losses and weights. Launched once:

* ``self.model = torch.compile(self.model)`` (the wrapper, torch's default backend: inductor, this CPU's C++
  compiler) at ZeRO 2;
* ``self.model.compile(backend="aot_eager")`` (in place: dynamo and AOTAutograd, where the strategy's attention
  functions, all-to-alls, loss and hooks meet the compiler) at ZeRO 3 with every parameter partitioned and
  ``offload_attention`` with all the ALST switches (``tiled_mlp``, ``tiled_loss``, ``offload_checkpoints``): the
  strategy's all-to-all is traced into a compiled graph;
* the wrapper at ZeRO 3, which DeepSpeed cannot run: refused before compute, naming ``stage=3`` and the in-place
  form (:func:`~lightning_ulysses.models.refusals.refuse_compile_wrapper_at_zero3`, also checked in-process).

``torch.compile`` of the LightningModule itself is refused by Lightning for every DeepSpeed strategy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ulysses.models.refusals import refuse_compile_wrapper_at_zero3
from tests.scenarios import compiled as scenario
from tests.support.launcher import launch
from tests.support.models import TokenDataset, build_llama, sgd_steps, tiny_llama_config

ALST = {"offload_attention": 8, "tiled_mlp": 2, "tiled_loss": 2, "offload_checkpoints": True}
TRAINED = {
    "torch.compile(model), inductor, zero2": {"form": "wrapper", "backend": None, "stage": 2},
    "model.compile(), aot_eager, zero3 + offload_attention + ALST": {
        "form": "in place", "backend": "recording aot_eager", "stage": 3, **ALST,
        "config": {"stage3_param_persistence_threshold": 0}},
}
REFUSED = "torch.compile(model), zero3"
SETTINGS = {**TRAINED, REFUSED: {"form": "wrapper", "backend": "aot_eager", "stage": 3}}  # the refusal last


def _one_device() -> dict:
    """Plain PyTorch and transformers, uncompiled: the same rows every step (one batch of both rows)."""
    rows = TokenDataset(scenario.ROWS, scenario.SEQ_LEN)
    batch = {key: torch.stack([rows[i][key] for i in range(scenario.ROWS)]) for key in rows[0]}
    return sgd_steps(build_llama(tiny_llama_config(num_kv_heads=2)), [batch] * scenario.STEPS, lr=0.5)


@pytest.fixture(scope="module")
def trained():
    return launch(2, "compiled:run", {"settings": SETTINGS}, timeout=600), _one_device()


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", list(TRAINED))
def test_a_compiled_model_trains_as_one_uncompiled_device(trained, setting):
    by_rank, reference = trained
    for rank in by_rank:
        got = rank[setting]
        assert "error" not in got, got.get("error")
        assert got["graphs"] > 0  # dynamo compiled graphs of the model
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        if TRAINED[setting]["backend"] == "recording aot_eager":
            assert got["graphs_with_all_to_all"] > 0  # the strategy's exchange ran compiled, not beside the graphs
    weights = by_rank[0][setting]["weights"]
    assert set(weights) == set(reference["weights"])
    worst = max(float((weights[k] - w).norm() / w.norm()) for k, w in reference["weights"].items())
    print(f"[measured] {setting}: losses {by_rank[0][setting]['losses']}, worst weight {worst:.1e},"
          f" graphs {by_rank[0][setting]['graphs']}")
    assert worst <= 1e-5, worst


@pytest.mark.multiprocess
def test_the_compile_wrapper_at_zero3_is_refused_before_compute(trained):
    by_rank, _ = trained
    for rank in by_rank:
        error = rank[REFUSED].get("error", "")
        assert error.startswith("ValueError") and "`stage=3`" in error and "self.model.compile()" in error, error


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_the_wrapper_at_zero3_is_refused(stage):
    config = {"zero_optimization": {"stage": stage}}
    in_place = _Module()
    in_place.model.compile(backend="aot_eager")
    refuse_compile_wrapper_at_zero3(in_place, config)  # nn.Module.compile: no wrapper, never refused
    nested = _Module()
    nested.model[0] = torch.compile(nested.model[0], backend="aot_eager")
    top = _Module()
    top.model = torch.compile(top.model, backend="aot_eager")
    for module, attribute in ((nested, "self.model.0"), (top, "self.model")):
        if stage == 3:
            with pytest.raises(ValueError, match=rf"`stage=3`.*`{attribute}\.compile\(\)`"):
                refuse_compile_wrapper_at_zero3(module, config)
        else:
            refuse_compile_wrapper_at_zero3(module, config)
    refuse_compile_wrapper_at_zero3(top, {})  # no zero_optimization: stage 0
