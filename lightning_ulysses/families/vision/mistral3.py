"""Mistral 3: a Pixtral vision tower over images of different sizes (``pixel_values [images, C, H_max, W_max]``
padded, ``image_sizes [images, 2]`` the real height and width in pixels), a patch merger of ``merge × merge``
patches, 1-D text positions. The placeholders of an image are its feature rows, row by row, each row of the image
followed by a break token and the last by an end token (neither takes a feature row).

Pixtral runs all images of a call as one sequence with block-diagonal attention and 2-D rotary positions starting
at 0 in every image; its norms, the projector's norm and the patch merger work per token or per image. So each
image is an independent unit: one image per unit, ``(h // (patch·merge)) · (w // (patch·merge))`` feature rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families.vision.base import Encoded, Modality, Units, VisionFamily, encoder_rows


def _merged_side(inner: nn.Module) -> int:
    """Pixels per side of one feature row: the patch size times the spatial merge."""
    return int(inner.config.vision_config.patch_size) * int(inner.config.spatial_merge_size)


class Mistral3Family(VisionFamily):
    model_types = ("mistral3",)

    def units(self, inner: nn.Module, modality: Modality, named: dict[str, Any], shard: ShardInfo) -> Units:
        sizes = named["image_sizes"].tolist()  # [[height, width], ...] in pixels
        patch, side = int(inner.config.vision_config.patch_size), _merged_side(inner)
        rows = [(h // side) * (w // side) for h, w in sizes]
        placeholders = int((shard.multimodal["input_ids"] == getattr(inner.config, modality.token_attr)).sum())
        if placeholders != sum(rows):
            raise ValueError(f"The batch has {placeholders} image placeholder tokens where its image_sizes give"
                             f" {sum(rows)} feature rows ({side} pixels per row and column of features).")
        return Units([(h // patch) * (w // patch) for h, w in sizes], rows)

    def slice_inputs(self, inner: nn.Module, modality: Modality, named: dict[str, Any], first: int,
                     last: int) -> dict[str, Any]:
        sizes = named["image_sizes"][first:last]  # [k, 2]
        height, width = (int(v) for v in sizes.max(dim=0).values)  # the run's padding only
        return {"pixel_values": named[modality.pixels_key][first:last, :, :height, :width], "image_sizes": sizes}

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        """One image of ``merge × merge`` patches (one feature row)."""
        side = _merged_side(inner)
        device = next(inner.parameters()).device
        channels = inner.config.vision_config.num_channels
        return {"pixel_values": torch.zeros(1, channels, side, side, device=device),
                "image_sizes": torch.tensor([[side, side]], device=device)}

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        """The run's images in one call of the model's own ``get_image_features``. A run of one feature row in all
        gets a blank one-row image after it, whose row is dropped (transformers squeezes a single row away and
        fails; the images are independent, so the extra one changes nothing else)."""
        pixels, sizes = inputs["pixel_values"], inputs["image_sizes"]  # [k, C, H, W], [k, 2]
        side = _merged_side(inner)
        rows = int(((sizes // side).prod(dim=-1)).sum())
        if rows == 1:
            pixels = torch.cat([pixels, torch.zeros_like(pixels[:1])])  # [k + 1, C, H, W]
            sizes = torch.cat([sizes, torch.tensor([[side, side]], dtype=sizes.dtype, device=sizes.device)])
        output = inner.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True)
        return Encoded([encoder_rows(output)[:rows]])  # [rows of the run, H]

    def consumed_keys(self, modality: Modality) -> tuple[str, ...]:
        return (modality.pixels_key, "image_sizes")
