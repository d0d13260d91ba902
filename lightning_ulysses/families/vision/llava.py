"""LLaVA: fixed-size images ``pixel_values [images, C, H, W]``, each giving the same number of feature rows (the
placeholders per image), 1-D text positions. Each image is one unit of the vision tower."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families.vision.base import Encoded, Modality, Units, VisionFamily, encoder_rows


class LlavaFamily(VisionFamily):
    model_types = ("llava",)

    def units(self, inner: nn.Module, modality: Modality, named: dict[str, Any], shard: ShardInfo) -> Units:
        images = int(named[modality.pixels_key].shape[0])
        placeholders = int((shard.multimodal["input_ids"] == getattr(inner.config, modality.token_attr)).sum())
        if images == 0 or placeholders % images:
            raise ValueError(f"The batch has {placeholders} image placeholder tokens for {images} images; this"
                             " family gives every image the same number of feature rows.")
        return Units([1] * images, [placeholders // images] * images)

    def slice_inputs(self, inner: nn.Module, modality: Modality, named: dict[str, Any], first: int,
                     last: int) -> dict[str, Any]:
        return {"pixel_values": named[modality.pixels_key][first:last]}

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        vision = inner.config.vision_config
        device = next(inner.parameters()).device
        return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size,
                                            device=device)}

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        return Encoded([encoder_rows(inner.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True))])
