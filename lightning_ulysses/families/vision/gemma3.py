"""Gemma 3: fixed-size images ``pixel_values [images, C, H, W]`` through SigLIP and an average pool, each giving
``mm_tokens_per_image`` feature rows, 1-D text positions; each image is one unit of the vision tower (as LLaVA).

Its attention is the part of its own: in training (``token_type_ids`` given, 1 on image placeholders) the tokens of
one image attend to each other both ways, on top of causal attention (and inside the window on sliding layers).
The call's completion gathers the call's ``token_type_ids`` shards of the SP group (one small all-gather, only when
the call has them), finds the blocks on global positions and hands them to the SP attention with the call
(:data:`~lightning_ulysses.parallel.image_blocks.IMAGE_BLOCKS_KWARG`), which attends within them exactly
(:mod:`lightning_ulysses.parallel.image_blocks`). A call without ``token_type_ids``, or whose types mark no image,
runs causal attention as before, as one device does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families.vision.base import Encoded, Modality
from lightning_ulysses.families.vision.llava import LlavaFamily
from lightning_ulysses.parallel.exchange import all_gather_sequence
from lightning_ulysses.parallel.image_blocks import (IMAGE_BLOCKS_KWARG, ImageBlocks,
                                                 refuse_unsupported_image_blocks)
from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.training.step_context import StepContext

TOKEN_TYPES_KEY = "token_type_ids"  # what Gemma 3's processor returns and its forward reads (1 = image)


class Gemma3Family(LlavaFamily):
    """Units, slices and the dummy image as LLaVA's; the tower's output is ``[images, mm_tokens_per_image, H]`` and
    the model reads it back as one tensor."""

    model_types = ("gemma3",)

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        pooled = inner.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output
        return Encoded([pooled.reshape(-1, pooled.shape[-1])])  # [images · mm_tokens_per_image, H]

    def encoder_output(self, tensors: list[torch.Tensor]) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=tensors[0])  # Gemma 3 calls `.to` on it: a tensor

    def complete_attention(self, model: nn.Module, named: dict[str, Any], shard: Optional[ShardInfo],
                           context: StepContext) -> None:
        types = named.get(TOKEN_TYPES_KEY)
        if not isinstance(types, torch.Tensor) or shard is None:
            return
        blocks = ImageBlocks.from_token_types(whole_token_types(types, shard, context))
        if blocks:  # the same on every rank of the SP group: refused everywhere or nowhere
            causal = not getattr(model.config.get_text_config(), "use_bidirectional_attention", False)
            refuse_unsupported_image_blocks(type(model).__name__, _compat.inner_attention_implementation(model.config),
                                            context.ring_size, shard.packed, causal)
            named[IMAGE_BLOCKS_KWARG] = blocks


def whole_token_types(types: torch.Tensor, shard: ShardInfo, context: StepContext) -> torch.Tensor:
    """``[rows, S_pad]``: the call's ``token_type_ids`` shards ``[rows, s]`` of every rank of the SP group, each at
    its global positions (one all-gather; the shard itself without a process group)."""
    group = context.sp_group
    if group_size(group) == 1:
        return types
    gathered = all_gather_sequence(types, group)  # [rows, S_pad], rank-major
    geometry = context.geometry
    whole = torch.empty_like(gathered)
    whole[:, geometry.full_order(shard.padded_len).to(gathered.device)] = gathered  # sequence order
    return whole
