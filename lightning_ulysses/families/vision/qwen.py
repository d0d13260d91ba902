"""The Qwen vision-language families: a vision tower over patch rows with a ``[items, 3]`` grid (temporal, height,
width in patches) per modality, multimodal RoPE from the model's ``get_rope_index``.

Each temporal patch of an item is an independent unit of the tower (it attends within a temporal patch of one item
only, and its position embeddings depend on the height and width), so a video's frames are spread over the ranks
and an image goes whole. A unit of ``h × w`` patches gives ``h·w / merge²`` feature rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families.vision.base import (IMAGE, VIDEO, Encoded, Modality, Units, VisionFamily,
                                                            encoder_rows)

GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}


def grid_units(grid: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(item, height, width)`` per temporal patch of each item, in order."""
    return [(k, int(h), int(w)) for k, (t, h, w) in enumerate(grid.tolist()) for _ in range(int(t))]


def sub_grid(units: list[tuple[int, int, int]], grid: torch.Tensor) -> torch.Tensor:
    """``[items, 3]``: the grid of a contiguous run of units (whole or partial items: their temporal patches)."""
    pieces: list[list[int]] = []
    for item, h, w in units:
        if pieces and pieces[-1][3] == item:
            pieces[-1][0] += 1
        else:
            pieces.append([1, h, w, item])
    return torch.tensor([piece[:3] for piece in pieces], dtype=grid.dtype, device=grid.device)


class QwenGridFamily(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: images and videos, one feature tensor per unit run."""

    model_types = ("qwen2_vl",)
    modalities = (IMAGE, VIDEO)
    rope_index_keys: tuple[str, ...] = ()

    def units(self, inner: nn.Module, modality: Modality, named: dict[str, Any], shard: ShardInfo) -> Units:
        merge = inner.config.vision_config.spatial_merge_size
        sizes = [h * w for _, h, w in grid_units(named[GRID_KEYS[modality.name]])]
        return Units(sizes, [size // merge ** 2 for size in sizes])

    def slice_inputs(self, inner: nn.Module, modality: Modality, named: dict[str, Any], first: int,
                     last: int) -> dict[str, Any]:
        grid = named[GRID_KEYS[modality.name]]
        units = grid_units(grid)
        sizes = [h * w for _, h, w in units]
        start = sum(sizes[:first])
        pixels = named[modality.pixels_key][start:start + sum(sizes[first:last])]
        return {"pixels": pixels, "grid": sub_grid(units[first:last], grid)}

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        """One temporal patch of ``merge × merge`` patches."""
        vision = inner.config.vision_config
        device = next(inner.parameters()).device
        merge = vision.spatial_merge_size
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return {"pixels": torch.zeros(merge * merge, width, device=device),
                "grid": torch.tensor([[1, merge, merge]], device=device)}

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        method = inner.get_image_features if modality is IMAGE else inner.get_video_features
        return Encoded([encoder_rows(method(inputs["pixels"], inputs["grid"], return_dict=True))])


class Qwen25VLFamily(QwenGridFamily):
    model_types = ("qwen2_5_vl",)
    rope_index_keys = ("second_per_grid_ts",)
