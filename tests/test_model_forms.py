"""Model forms the strategy is not told about train and evaluate as one device, or stop before a weight changes.

- length-dependent RoPE (dynamic NTK, Phi-3 LongRoPE) chooses its frequencies from the whole batch's largest
  position (packed rows: the longest document), at ZeRO 2 and 3; a static type (yarn) as the control;
- ``trainer.predict/validate/test`` with no fit before give one device's logits and losses (Lightning's DeepSpeed
  inference set-up removes every module hook; the strategy installs its own again).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.forms import FormModule, build_form, reference_logits
from tests.support.launcher import launch
from tests.support.models import PackedDataset, TokenDataset, documents_as_rows, lightning_order, sgd_steps
from tests.test_parity import rel_diff, update_rel_diff

STEPS, SEQ_LEN, LR = 4, 32, 0.5
PACKED = [[20, 12], [10, 22], [14, 18], [30, 2]]  # longest documents past 16 positions, shards of 16 at sp=2


def _fit(form: str, stage: int, **options) -> dict:
    return dict(name=f"{form}-zero{stage}" + ("-packed" if options.get("packed") else ""), form=form, stage=stage,
                steps=STEPS, seq_len=SEQ_LEN, num_rows=STEPS, **options)


ROPE_RUNS = [_fit(form, stage) for form in ("llama-dynamic", "phi3-longrope") for stage in (2, 3)]
ROPE_RUNS += [_fit("llama-yarn", 2), _fit("phi3-longrope", 2, packed=PACKED), _fit("llama-dynamic", 3, packed=PACKED)]
EVAL_RUNS = [dict(name=f"{form}-zero{stage}", form=form, stage=stage, seq_len=SEQ_LEN, num_rows=2)
             for form, stage in (("phi3-longrope", 2), ("phi3-longrope", 3), ("llama-dynamic", 0))]
EVAL_RUNS.append(dict(EVAL_RUNS[0], name="phi3-longrope-logits-zero2", step="logits"))


@pytest.fixture(scope="module")
def two():
    return launch(2, "combined:run", {"fit": ["model_forms:fit", {"runs": ROPE_RUNS}],
                                      "evaluate": ["model_forms:evaluate", {"runs": EVAL_RUNS}]})


def _reference_batches(run: dict) -> list[dict]:
    if run.get("packed"):
        dataset = PackedDataset(run["packed"])
        return [documents_as_rows(dataset, [i]) for i in lightning_order(len(dataset))[:run["steps"]]]
    dataset = TokenDataset(run["num_rows"], run["seq_len"])
    return [{k: v[None] for k, v in dataset[i].items()} for i in lightning_order(len(dataset))[:run["steps"]]]


@pytest.mark.parametrize("run", ROPE_RUNS, ids=[r["name"] for r in ROPE_RUNS])
def test_length_dependent_rope_trains_as_one_device(two, run):
    results = [rank["fit"][run["name"]] for rank in two]
    assert all("error" not in r for r in results), results[0].get("error")
    initial = {k: v.detach().clone() for k, v in build_form(run["form"]).named_parameters()}
    reference = sgd_steps(build_form(run["form"]), _reference_batches(run), LR)
    assert results[0]["losses"] == results[1]["losses"]
    assert rel_diff(results[0]["losses"], reference["losses"]) <= 1e-5, (results[0]["losses"], reference["losses"])
    assert update_rel_diff(results[0]["weights"], reference["weights"], initial) <= 1e-4


def _reference_evaluation(run: dict) -> tuple[list, float]:
    model = build_form(run["form"]).eval()
    dataset = TokenDataset(run["num_rows"], run["seq_len"])
    with torch.no_grad():
        logits = [reference_logits(model, {k: v[None] for k, v in dataset[i].items()}) for i in range(len(dataset))]
        losses = [model(**{k: v[None] for k, v in dataset[i].items()}).loss.item() for i in range(len(dataset))]
    return logits, sum(losses) / len(losses)


@pytest.mark.parametrize("run", EVAL_RUNS, ids=[r["name"] for r in EVAL_RUNS])
def test_evaluation_outside_fit_is_one_devices(two, run):
    logits, loss = _reference_evaluation(run)
    for rank in two:
        result = rank["evaluate"][run["name"]]
        assert "error" not in result, result["error"]
        assert len(result["predict"]) == len(logits)
        for got, expected in zip(result["predict"], logits):
            assert rel_diff(got, expected) <= 1e-5
        assert result["validate"]["val_loss"] == pytest.approx(loss, rel=1e-5)
        assert result["test"]["test_loss"] == pytest.approx(loss, rel=1e-5)
