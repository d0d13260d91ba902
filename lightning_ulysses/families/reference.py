"""The small reference models the run-time drift checks build (:mod:`lightning_ulysses.drift.touch_points`): a
decoder whose class transformers' ``_from_config`` builds, and a config with sub-configs."""

from __future__ import annotations

from typing import Any


def reference_decoder() -> tuple[type, Any]:
    """``(model class, config)`` of a one-layer decoder (Llama: GQA, RoPE, the attention interface), a few hundred
    parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM, config


def composite_config() -> Any:
    """A config with a text and a vision sub-config (Gemma 3's), one layer each."""
    from transformers import Gemma3Config

    return Gemma3Config(text_config={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8},
                        vision_config={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                                       "num_attention_heads": 2})
