"""``sp_size="auto"``'s choice in process (:mod:`lightning_ulysses.plan.auto`); the launched runs, parity against one
device included, are in ``tests/test_preflight.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.plan import plan_memory
from lightning_ulysses.plan.auto import AutoSettings, choose_sp_size, describe, device_preset, planned_model_config
from tests.support.models import build_llama, tiny_llama_config


def _settings(budget: int, **overrides) -> AutoSettings:
    values = dict(sequence_length=4096, devices_per_node=4, nodes=1, budget_bytes=budget, precision="bf16-mixed",
                  stage=2, memory_switches=False, offload_optimizer=False, micro_batch=1)
    return AutoSettings(**{**values, **overrides})


def _peak(sp: int) -> int:
    return plan_memory(tiny_llama_config(num_kv_heads=2), 4096, sp_size=sp, world_size=4, stage=2,
                       precision="bf16-mixed", optimizer="adamw").peak


def test_the_quickest_size_that_fits_is_taken():
    config = tiny_llama_config(num_kv_heads=2)
    peaks = {sp: _peak(sp) for sp in (1, 2, 4)}
    assert peaks[4] < peaks[2] < peaks[1]
    assert choose_sp_size(config, _settings(peaks[1] + 1)).sp_size == 1
    assert choose_sp_size(config, _settings((peaks[1] + peaks[2]) // 2)).sp_size == 2
    assert choose_sp_size(config, _settings((peaks[2] + peaks[4]) // 2)).sp_size == 4


def test_nothing_fitting_names_settings_that_would():
    config = tiny_llama_config(num_kv_heads=2)
    just_below = _peak(4) - 1  # sp=4 at ZeRO 2 misses by a byte; ZeRO 3 (states partitioned) fits at every size
    with pytest.raises(ValueError, match="These settings would fit: {'sp_size': 1, 'stage': 3}"):
        choose_sp_size(config, _settings(just_below))
    with pytest.raises(ValueError, match="No setting the planner knows fits"):
        choose_sp_size(config, _settings(1 << 20))


def test_the_choice_is_described_on_one_line():
    config = tiny_llama_config(num_kv_heads=2)
    settings = _settings(_peak(1) + 1)
    line = describe(choose_sp_size(config, settings), settings)
    assert "chose sp_size=1 for 4096 tokens per row on 4 devices" in line and "\n" not in line


def test_device_presets():
    assert device_preset("NVIDIA H100 80GB HBM3") == "h100"
    assert device_preset("NVIDIA H200") == "h200"
    assert device_preset("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_preset("") == "h100"


def test_the_planned_model_is_the_one_hugging_face_model():
    model = build_llama(tiny_llama_config())
    holder = torch.nn.ModuleDict({"model": model, "head": torch.nn.Linear(2, 2)})
    assert planned_model_config(holder) is model.config
    with pytest.raises(ValueError, match="holds 2"):
        planned_model_config(torch.nn.ModuleDict({"a": model, "b": build_llama(tiny_llama_config())}))
    with pytest.raises(ValueError, match="holds 0"):
        planned_model_config(torch.nn.Linear(2, 2))
