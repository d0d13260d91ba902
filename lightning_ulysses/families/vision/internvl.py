"""InternVL: images cut into fixed-size tiles ``pixel_values [tiles, C, H, W]`` (a video's frames are tiles too),
each tile giving the same number of feature rows after the pixel shuffle (``image_seq_length`` placeholders),
1-D text positions.

The vision tower runs the tiles as a batch (attention within a tile, per-token norms, per-tile pixel shuffle and
projector), so each tile is one unit of the tower and an image with several tiles may be spread over the ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ulysses.families.vision.base import Encoded, Modality
from lightning_ulysses.families.vision.llava import LlavaFamily


class InternVLFamily(LlavaFamily):
    """One unit per tile; the rows per tile are the placeholders per tile (checked by :class:`LlavaFamily`)."""

    model_types = ("internvl",)

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        vision = inner.config.vision_config
        height, width = vision.image_size
        device = next(inner.parameters()).device
        return {"pixel_values": torch.zeros(1, vision.num_channels, height, width, device=device)}

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        features = inner.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output
        return Encoded([features.flatten(0, 1)])  # [tiles, rows, H] -> [tiles * rows, H]

    def encoder_output(self, tensors: list[torch.Tensor]) -> Any:
        """The model takes its image features as one tensor (it scatters ``pooler_output`` whole)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=tensors[0])  # [n, H]
