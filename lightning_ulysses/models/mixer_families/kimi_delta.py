"""Kimi Linear's delta attention (KDA, kimi_linear): a gated delta net with a per-channel decay; heads split over
the ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses.models.head_slicing import HeadSlicing, share, span


def kimi_delta_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """``q/k/v_proj`` rows of this rank's heads (``[q | k | v]`` channels of the convolution), ``b_proj`` rows,
    the output gate's ``g_b_proj`` rows (its low-rank ``g_a_proj`` runs whole), the forget gate narrowed the same way
    (``f_b_proj`` rows, ``dt_bias`` channels, ``A_log`` heads on dim 2), ``o_proj`` columns. The output norm is per
    head dimension (shared by the heads): local."""
    names = ("num_heads", "head_dim", "qkv_dim", "q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj",
             "g_a_proj", "g_b_proj", "o_norm", "o_proj")
    if not all(hasattr(module, name) for name in names) or module.num_heads < size:
        return None
    gate = module.forget_gate
    if not all(hasattr(gate, name) for name in ("f_b_proj", "dt_bias", "A_log")):
        return None
    nh, hd = module.num_heads, module.head_dim
    if module.qkv_dim != nh * hd or tuple(gate.A_log.shape) != (1, 1, nh, 1):
        return None
    first, each = share(nh, rank, size)
    channels = span(first, each, hd)
    heads = torch.arange(first, first + each)
    qkv = nh * hd
    return HeadSlicing(
        rows={"q_proj": channels, "k_proj": channels, "v_proj": channels, "b_proj": heads, "g_b_proj": channels},
        columns={"o_proj": channels}, channels={"conv1d": torch.cat([channels, qkv + channels, 2 * qkv + channels])},
        attributes={"num_heads": each, "qkv_dim": each * hd, "conv_dim": 3 * each * hd},
        children={"forget_gate": HeadSlicing(rows={"f_b_proj": channels},
                                             parameters={"dt_bias": channels, "A_log": (2, heads)},
                                             attributes={"num_heads": each, "qkv_dim": each * hd})})
