"""Llama 4: images cut into fixed-size tiles by its processor, ``pixel_values [tiles, C, H, W]``; each tile gives
the same number of feature rows (patches after the pixel shuffle), so each tile is one unit of the vision tower.
1-D text positions. The model reads the tower's rows from ``mm_encoder_outputs["image"].last_hidden_state`` (not
``pooler_output``) and applies its projector row by row in the forward, after the exchange."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families.vision.base import Encoded, Modality, Units, VisionFamily


class Llama4Family(VisionFamily):
    model_types = ("llama4",)

    def units(self, inner: nn.Module, modality: Modality, named: dict[str, Any], shard: ShardInfo) -> Units:
        tiles = int(named[modality.pixels_key].shape[0])
        placeholders = int((shard.multimodal["input_ids"] == getattr(inner.config, modality.token_attr)).sum())
        if tiles == 0 or placeholders % tiles:
            raise ValueError(f"The batch has {placeholders} image placeholder tokens for {tiles} image tiles; Llama 4"
                             " gives every tile the same number of feature rows.")
        return Units([1] * tiles, [placeholders // tiles] * tiles)

    def slice_inputs(self, inner: nn.Module, modality: Modality, named: dict[str, Any], first: int,
                     last: int) -> dict[str, Any]:
        return {"pixel_values": named[modality.pixels_key][first:last]}  # [tiles, C, H, W]

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        vision = inner.config.vision_config
        device = next(inner.parameters()).device
        return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size,
                                            device=device)}

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        states = inner.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).last_hidden_state
        return Encoded([states.reshape(-1, states.shape[-1])])  # [tiles, rows, H] -> [tiles · rows, H]

    def encoder_output(self, tensors: list[torch.Tensor]) -> Any:
        return BaseModelOutputWithPooling(last_hidden_state=tensors[0])  # [n, H]: this shard's rows
