"""Model adaptation: Hugging Face, LitGPT and own models switched to their sequence-parallel form (attention, RoPE,
calls, mixers, MoE, memory features), the refusals and the model-form check."""
