"""Ulysses-Offload around a Hugging Face model's layers (the strategy's ``offload_attention`` with checkpointed
layers): the strategy's own layer checkpoint, whose recompute keeps its saved tensors in host memory
(:mod:`~lightning_ulysses.offload.layer_checkpoint`); the rotary embedding in tiles of positions
(:mod:`~lightning_ulysses.offload.rotary_tiles`); the attention's inputs given back once the model's code cannot read
them again (:mod:`~lightning_ulysses.offload.unread_arguments`). The chunked attention itself and its chunk store:
:mod:`lightning_ulysses.parallel.offload_attention`."""
