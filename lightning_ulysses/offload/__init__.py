"""Ulysses-Offload around a Hugging Face model's layers (the strategy's ``offload_attention`` with checkpointed
layers): the strategy's own layer checkpoint, whose recompute keeps its saved tensors in host memory
(:mod:`~lightning_ulysses.offload.layer_checkpoint`); the attention block the strategy runs itself for the registered
families, its own temporaries dropped as soon as they are read (:mod:`~lightning_ulysses.offload.attention_block`);
the rotary embedding in tiles of positions (:mod:`~lightning_ulysses.offload.rotary_tiles`). The chunked attention
itself and its chunk store: :mod:`lightning_ulysses.parallel.offload_attention`."""
