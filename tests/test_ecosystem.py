"""Lightning's ecosystem under SP: ``model.generate(batch["input_ids"])`` in ``predict_step`` and
``validation_step`` generates from the whole prompt (the batch's shard is gathered over the SP group), so every rank
returns one device's tokens, at ZeRO 2 and 3."""

from __future__ import annotations

import pytest
import torch

from tests.scenarios.ecosystem import NEW_TOKENS, _rows
from tests.support.launcher import launch
from tests.support.models import tiny_llama_config

STAGES = (2, 3)


@pytest.fixture(scope="module")
def runs():
    return launch(2, "ecosystem:run", {"cases": [{"name": f"zero{s}", "stage": s} for s in STAGES]}, timeout=600)


@pytest.mark.parametrize("stage", STAGES)
def test_generate_in_predict_and_validation_steps_is_one_devices(runs, stage):
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(tiny_llama_config(num_kv_heads=2)).eval()
    plain.load_state_dict(runs[0][f"zero{stage}"]["weights"])
    expected = []
    with torch.no_grad():
        for row in _rows():
            expected.append(plain.generate(row["input_ids"][None], max_new_tokens=NEW_TOKENS,
                                           do_sample=False).tolist())
    assert len(expected[0][0]) == 16 + NEW_TOKENS
    for rank in runs:
        result = rank[f"zero{stage}"]
        assert result["predictions"] == expected
        assert result["validation"] == expected


# ------------------------------------------------------------------------------------------------ weight averaging
EMA_CASES = [{"name": "zero2", "stage": 2}, {"name": "zero3", "stage": 3},
             {"name": "zero3-partitioned", "stage": 3, "partitioned": True}]


@pytest.fixture(scope="module")
def ema_runs():
    return launch(2, "ecosystem:run_ema", {"cases": EMA_CASES}, timeout=600)


def _one_device_ema() -> dict:
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    from tests.support.models import TokenDataset, build_llama, lightning_order

    model = build_llama(tiny_llama_config(num_kv_heads=2), 0)
    average = AveragedModel(model, avg_fn=get_ema_avg_fn(decay=0.5), use_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dataset = TokenDataset(8, 16)
    for index in lightning_order(8)[:3]:
        row = dataset[index]
        loss = model(input_ids=row["input_ids"][None], labels=row["labels"][None]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        average.update_parameters(model)
    return {k: v.detach().clone() for k, v in average.module.named_parameters()}


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_ema_weight_averaging_is_one_devices(ema_runs, name):
    """ZeRO 2, and ZeRO 3 with every parameter whole (below stage3_param_persistence_threshold)."""
    for rank in ema_runs:
        assert rank[name]["error_type"] is None, rank[name]["message"]
    from tests.support.models import build_llama

    expected = _one_device_ema()
    initial = dict(build_llama(tiny_llama_config(num_kv_heads=2), 0).named_parameters())
    got = ema_runs[0][name]["weights"]
    worst = max(float((got[k] - v).norm() / (v - initial[k]).norm()) for k, v in expected.items()
                if float((v - initial[k]).norm()) > 0)
    assert worst <= 1e-4, worst  # of each parameter's change by the averaged training


def test_ema_on_partitioned_parameters_is_refused_before_a_weight_changes(ema_runs):
    for rank in ema_runs:
        result = rank["zero3-partitioned"]
        assert result["error_type"] == "ValueError", result["message"]
        assert "EMAWeightAveraging" in result["message"] and "stage=2" in result["message"]
        assert result["global_step"] == 0 and result["unchanged"]


# ------------------------------------------------------------------------------------------------ refusals mid-fit
def test_a_refusal_a_batch_triggers_mid_fit_stops_every_rank_with_the_message():
    """An encoder batch whose padding lies in one rank's shard only: every rank raises the encoder message (agreed
    through one all-reduce), none dies in a collective its peer left."""
    runs = launch(2, "ecosystem:run_refusals", {}, timeout=300)
    for rank in runs:
        result = rank["encoder_padding"]
        assert result["error_type"] == "ValueError", result
        assert "attends bidirectionally (an encoder), and this batch has padding" in result["message"]


def test_the_own_shift_refusals_point_to_the_metrics_pattern():
    """The training loss's own-shift refusals also name the pattern for evaluation metrics, where nothing is
    back-propagated to stop an own shift."""
    from lightning_ulysses.training.agreement import loss_mismatch_message, shard_local_message

    for message in (loss_mismatch_message([0, 1], "training step", 1.0, 2.0),
                    shard_local_message([0, 1], "training step", "logits")):
        assert 'batch["shift_labels"]' in message and "Metrics: torchmetrics, own shifts" in message
