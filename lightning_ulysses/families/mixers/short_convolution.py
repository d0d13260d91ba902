"""Short convolutions (lfm2, lfm2_moe, lfm3): ``in_proj`` gives ``[B | C | x]`` gates per channel, a depthwise causal
convolution of ``B · x``, the output ``C · conv`` projected back; every channel is independent, so the channels
split over the ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import HeadSlicing, share


def short_convolution_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """``in_proj`` rows of this rank's channels in each of its ``[B | C | x]`` thirds, the convolution's channels,
    ``out_proj`` columns. ``None`` for anything else (recognised by a depthwise ``conv`` over ``d`` channels, an
    ``in_proj`` ``d -> 3d`` and an ``out_proj`` ``d -> H``)."""
    conv = getattr(module, "conv", None)
    in_proj, out_proj = getattr(module, "in_proj", None), getattr(module, "out_proj", None)
    if not (isinstance(conv, nn.Conv1d) and isinstance(in_proj, nn.Linear) and isinstance(out_proj, nn.Linear)):
        return None
    width = conv.in_channels
    if conv.groups != width or in_proj.out_features != 3 * width or out_proj.in_features != width or width < size:
        return None
    first, each = share(width, rank, size)
    channels = torch.arange(first, first + each)
    return HeadSlicing(rows={"in_proj": torch.cat([channels, width + channels, 2 * width + channels])},
                       channels={"conv": channels}, columns={"out_proj": channels}, inputs=("in_proj",))
