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
