"""Kimi Linear's delta attention (KDA, kimi_linear): a gated delta net with a per-channel decay; heads split over
the ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import Deferral, HeadSlicing, share, span


def kimi_delta_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """``q/k/v_proj`` rows of this rank's heads (``[q | k | v]`` channels of the convolution), ``b_proj`` rows,
    the output gate's ``g_b_proj`` rows (its low-rank ``g_a_proj`` runs whole), the forget gate narrowed the same way
    (``f_b_proj`` rows, ``dt_bias`` channels, ``A_log`` heads on dim 2; its low-rank ``f_a_proj`` whole on every
    rank), ``o_proj`` columns. The output norm is per head dimension (shared by the heads): under the exchange it runs
    on the shard after the exchange back, with its gate, whose rows never travel."""
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
    low_rank = torch.arange(hd)  # g_a_proj / f_a_proj: hidden -> head_dim, every rank needs them whole
    forget_gate = HeadSlicing(rows={"f_a_proj": low_rank, "f_b_proj": channels}, inputs=("f_a_proj",),
                              parameters={"dt_bias": channels, "A_log": (2, heads)},
                              attributes={"num_heads": each, "qkv_dim": each * hd})
    return HeadSlicing(
        rows={"q_proj": channels, "k_proj": channels, "v_proj": channels, "b_proj": heads, "g_a_proj": low_rank,
              "g_b_proj": channels},
        inputs=("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj"), deferred={"g_a_proj": None},
        deferral=Deferral(tail=_output_gate_tail, norm="o_norm"),
        columns={"o_proj": channels}, channels={"conv1d": torch.cat([channels, qkv + channels, 2 * qkv + channels])},
        attributes={"num_heads": each, "qkv_dim": each * hd, "conv_dim": 3 * each * hd},
        children={"forget_gate": forget_gate})


def _output_gate_tail(module: nn.Module, core: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """KDA's last step before ``o_proj``, on the shard with every head: ``o_norm(core, g_b_proj(g_a_proj(x)))`` per
    head, as its forward calls it."""
    B, s, _ = core.shape
    shape = (B, s, -1, module.head_dim)
    gate = F.linear(F.linear(hidden, module.g_a_proj.weight, module.g_a_proj.bias), module.g_b_proj.weight,
                    module.g_b_proj.bias).view(shape)
    return module.o_norm(core.reshape(shape), gate).reshape(B, s, -1)
