"""Each kind of model is one adapter (``lightning_ulysses/models/adapters.py``): what each finds in a module, what it
refuses before compute, what the model-form check probes. Preparing and restoring them is proven by the multi-process
tests (``tests/test_lifecycle.py::test_no_patch_outlives_a_stage`` and every parity test). In-process."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_ulysses.models import form_check
from lightning_ulysses.models.adapters import (ADAPTERS, AttentionCores, HuggingFaceModels, LitGPTModels,
                                               PositionTakingRoots, PreparationSettings)
from tests.support.forms import InputPosGPT, SDPACore
from tests.support.models import build_llama, tiny_llama_config


def _find(root: nn.Module, settings: PreparationSettings) -> dict[str, list[nn.Module]]:
    found: dict[str, list[nn.Module]] = {}
    for adapter in ADAPTERS:
        found[adapter.kind] = adapter.find(root, settings, found)
    return found


def test_the_adapters_and_their_order():
    assert [type(a) for a in ADAPTERS] == [HuggingFaceModels, LitGPTModels, AttentionCores, PositionTakingRoots]


def test_each_adapter_finds_its_kind_of_model():
    from litgpt.config import Config
    from litgpt.model import GPT

    llama = build_llama(tiny_llama_config())
    own = InputPosGPT()
    gpt = GPT(Config(block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=1, n_head=4, n_embd=32))
    root = nn.ModuleDict({"llama": llama, "own": own, "gpt": gpt})
    found = _find(root, PreparationSettings(sp_size=2, ring_size=1, device_type="cpu", attention_modules=[SDPACore]))
    assert found["hf"] == [llama] and found["litgpt"] == [gpt]
    assert found["cores"] == [block.core for block in own.blocks]
    assert found["own_roots"] == [own]  # the outermost module around the cores whose forward takes positions


def test_an_adapter_refuses_before_compute():
    settings = PreparationSettings(sp_size=2, ring_size=2, device_type="cpu", attention_modules=[SDPACore])
    with pytest.raises(ValueError, match="not supported with ring_size=2"):
        AttentionCores().validate([SDPACore()], settings)
    AttentionCores().validate([], settings)  # nothing declared: nothing to refuse
    with pytest.raises(ValueError, match="fewer than sp_size"):
        HuggingFaceModels().validate([build_llama(tiny_llama_config(num_kv_heads=2, num_heads=2))],
                                     PreparationSettings(sp_size=4, ring_size=1, device_type="cpu"))


@pytest.mark.parametrize("switches,named", [({"memory_features": "tiled_mlp"}, "tiled_mlp"),
                                             ({"attention_chunk": 4096}, "offload_attention"),
                                             ({"memory_features": "offload_checkpoints"}, "offload_checkpoints")])
def test_switches_only_hugging_face_models_run_are_refused_for_other_models(switches, named):
    """The memory switches and offload_attention run inside Hugging Face models only: with a LitGPT GPT or own
    attention cores they would silently do nothing (found so: LitGPT with tiled_mlp trained without tiling)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    from lightning_ulysses.models.memory import MemoryFeatures

    feature = switches.get("memory_features")
    settings = PreparationSettings(
        sp_size=2, ring_size=1, device_type="cpu", attention_modules=[SDPACore],
        memory_features=MemoryFeatures(**({feature: True if feature == "offload_checkpoints" else "auto"}
                                          if feature else {})),
        attention_chunk=switches.get("attention_chunk"))
    gpt = GPT(Config(block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=1, n_head=4, n_embd=32))
    with pytest.raises(ValueError, match=f"{named} is run inside Hugging Face models only.*LitGPT GPT.*Turn {named}"):
        LitGPTModels().validate([gpt], settings)
    with pytest.raises(ValueError, match=f"{named} is run inside Hugging Face models only.*own attention cores"):
        AttentionCores().validate([SDPACore()], settings)
    HuggingFaceModels().validate([build_llama(tiny_llama_config())], settings)  # what runs them
    LitGPTModels().validate([], settings)  # no such model: nothing to refuse
    plain = PreparationSettings(sp_size=2, ring_size=1, device_type="cpu")
    LitGPTModels().validate([gpt], plain)
    AttentionCores().validate([SDPACore()], plain)


def test_the_model_form_check_probes_what_each_adapter_names():
    llama = build_llama(tiny_llama_config())
    assert HuggingFaceModels().probe_targets(llama) == [(llama, form_check.whole_hf_call, form_check.sharded_hf_call)]
    assert AttentionCores().probe_targets(SDPACore()) == []
