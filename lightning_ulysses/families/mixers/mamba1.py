"""Mamba1 mixers (mamba, falcon_mamba, jamba): the inner channels split over the ranks. ``x_proj`` (inner channels
-> ``dt_rank + 2·state``) contracts over every channel, so each rank computes its channels' partial product and the
SP group sums it (one all-reduce of ``[B, S, dt_rank + 2·state]`` forward and backward): every rank then has the
whole ``dt``, ``B``, ``C`` (Jamba's and Falcon-Mamba's norms over them run whole), and ``dt_proj`` gives its
channels' time steps."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import Deferral, HeadSlicing, share


def mamba1_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """``in_proj`` rows ``[x | gate]`` of this rank's channels, the convolution's channels, ``x_proj`` columns
    (summed over the group), ``dt_proj`` rows, ``A_log`` / ``D`` rows, ``out_proj`` columns; transformers' fused
    ``mamba_inner_fn`` (which would contract ``x_proj`` over this rank's channels only) is bypassed while
    narrowed. Under the exchange the scan runs without its gate (``z``), which multiplies its output on the shard after
    the exchange back, so the gate rows never travel."""
    names = ("intermediate_size", "time_step_rank", "ssm_state_size", "in_proj", "conv1d", "x_proj", "dt_proj",
             "out_proj", "A_log", "D")
    if not all(hasattr(module, name) for name in names) or hasattr(module, "num_heads"):
        return None
    d = module.intermediate_size
    if module.in_proj.out_features != 2 * d or module.x_proj.in_features != d or module.dt_proj.out_features != d:
        return None
    if module.A_log.shape[0] != d or module.conv1d.in_channels != d or d < size:
        return None
    first, each = share(d, rank, size)
    channels = torch.arange(first, first + each)
    return HeadSlicing(
        rows={"in_proj": torch.cat([channels, d + channels]), "dt_proj": channels},
        summed_columns={"x_proj": channels}, columns={"out_proj": channels}, channels={"conv1d": channels},
        parameters={"A_log": channels, "D": channels}, attributes={"intermediate_size": each},
        disabled_functions=("mamba_inner_fn",), inputs=("in_proj",),
        deferred={"in_proj": torch.arange(each, 2 * each)},  # the gate half of this rank's rows
        deferral=Deferral(tail=_gate_tail, gated_functions={"mamba_selective_scan": "z"}))


def _gate_tail(module: nn.Module, y: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The scan's gate, ``y · silu(gate)`` (what ``mamba_selective_scan(..., z=gate)`` multiplies its output by),
    on the shard with every channel; the gate is the second half of ``in_proj``."""
    d = module.intermediate_size
    in_proj = module.in_proj
    gate = F.linear(hidden, in_proj.weight[d:], None if in_proj.bias is None else in_proj.bias[d:])  # [B, s, d]
    return (y * F.silu(gate.to(y.dtype))).to(hidden.dtype)
