"""Attention modules are recognised by what their forward does (it looks its kernel up in transformers' attention
interface), whatever their class is called; in process, on tiny models."""

from __future__ import annotations

import torch

from lightning_ulysses.models import refusals
from tests.support.architectures import build_model


def test_an_attention_class_named_otherwise_is_recognised_by_its_forward():
    model = build_model("llama_attention_renamed")
    attention = model.model.layers[0].self_attn
    assert type(attention).__name__ == "LlamaLatentMixer"
    assert refusals._attention_kind(attention) == "interface"
    assert refusals.has_attention(model)
    # the layer around it, the MLP and the model are no attention modules
    for module in (model.model.layers[0], model.model.layers[0].mlp, model):
        assert refusals._attention_kind(module) is None, type(module).__name__


def test_a_forward_without_source_is_decided_by_the_name_alone():
    class Mixer(torch.nn.Module):
        pass

    Mixer.forward = eval("lambda self, x: x")  # noqa: S307 - a function whose source cannot be read
    assert not refusals._forward_dispatches_attention(Mixer)
    assert refusals._attention_kind(Mixer()) is None


def test_longcat_flash_is_refused_with_its_cause():
    from tests.support.sweep import build

    model = build("longcat_flash", "LongcatFlashForCausalLM")
    assert refusals._attention_kind(model.model.layers[0].self_attn[0]) == "interface"  # LongcatFlashMLA
    try:
        refusals.refuse_unsupported_architecture(model)
    except ValueError as err:
        assert "zero-compute (identity) experts" in str(err) and "sp_size=1" in str(err), err
    else:
        raise AssertionError("longcat_flash was not refused")
