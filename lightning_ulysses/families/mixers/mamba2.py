"""Mamba2 mixers (mamba2, nemotron_h, bamba, granitemoehybrid, zamba2, falcon_h1): SSM heads split over the ranks."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import Deferral, GatedNormAcrossRanks, HeadSlicing, share, span


def mamba2_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """The input projection is ``[gate | x | B | C | dt]`` and the convolution runs over ``[x | B | C]``; B and C
    belong to head groups: with one group (the Bamba, Granite 4, Zamba2 and Falcon-H1 checkpoints) every rank keeps
    them whole and the heads split unevenly if need be, with a number of groups the ranks divide each rank keeps its
    heads' groups. The gated RMSNorm normalises over a group's channels: with one group those span every rank, so
    its sum of squares is all-reduced over the SP group (one all-reduce of ``[B, S, 1]`` forward and backward).
    Falcon-H1: its µP multipliers (``mup_vector``, per projected feature) are sliced like the projection, its norm
    may gate after normalising or be absent. Under the exchange the gated norm and its gate run on the shard after
    the exchange back (every channel there: no all-reduce), so the gate rows never travel; without a norm
    (Falcon-H1's ``mamba_rms_norm=False``: ``y · silu(gate)`` inline) the gate rows travel with the others."""
    names = ("num_heads", "head_dim", "intermediate_size", "n_groups", "ssm_state_size", "conv_dim", "in_proj",
             "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias")
    if not all(hasattr(module, name) for name in names):
        return None
    nh, hd, d, ng, ds = module.num_heads, module.head_dim, module.intermediate_size, module.n_groups, module.ssm_state_size
    norm = module.norm
    norm_width = _norm_group_width(norm, d)
    if nh < size or d != nh * hd or norm_width is None or not (ng == 1 or ng % size == 0):
        return None
    if module.in_proj.out_features != 2 * d + 2 * ng * ds + nh or module.conv_dim != d + 2 * ng * ds:
        return None
    first, h_each = share(nh, rank, size)
    heads = torch.arange(first, first + h_each)
    x_idx = span(first, h_each, hd)
    g_each = ng if ng == 1 else ng // size
    b_idx = torch.arange(ng * ds) if ng == 1 else span(rank * g_each, g_each, ds)
    rows = torch.cat([x_idx, d + x_idx, 2 * d + b_idx, 2 * d + ng * ds + b_idx, 2 * d + 2 * ng * ds + heads])
    conv = torch.cat([x_idx, d + b_idx, d + ng * ds + b_idx])
    slicing = HeadSlicing(
        rows={"in_proj": rows}, columns={"out_proj": x_idx}, channels={"conv1d": conv},
        parameters={"A_log": heads, "D": heads, "dt_bias": heads},
        attributes={"num_heads": h_each, "intermediate_size": h_each * hd, "n_groups": g_each,
                    "conv_dim": h_each * hd + 2 * g_each * ds},
        disabled_functions=("mamba2_split_conv1d_scan_combined",))
    slicing.inputs = ("in_proj",)
    if isinstance(getattr(module, "ssm_in_multiplier", None), (int, float)):  # Falcon-H1: input × multiplier
        slicing.input_scale = "ssm_in_multiplier"
    if not isinstance(norm, nn.Identity):
        spans_ranks = norm_width == d and size > 1
        slicing.modules["norm"] = GatedNormAcrossRanks(norm, x_idx, norm_width, group if spans_ranks else None)
        if getattr(module, "mamba_rms_norm", True):  # the gated norm: it and its gate run after the exchange back
            slicing.deferred = {"in_proj": torch.arange(h_each * hd)}  # this rank's gate rows, first in its rows
            slicing.deferral = Deferral(tail=_gated_norm_tail, norm="norm")
    mup = getattr(module, "mup_vector", None)
    if isinstance(mup, torch.Tensor):  # Falcon-H1: [1, 1, projected features]
        slicing.buffers["mup_vector"] = (2, rows)
    if hasattr(module, "groups_time_state_size"):  # Falcon-H1
        slicing.attributes["groups_time_state_size"] = g_each * ds
    return slicing


def _gated_norm_tail(module: nn.Module, y: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Mamba2's last step before ``out_proj``, on the shard with every head: ``norm(y, gate)`` over every channel,
    the gate being the first ``intermediate_size`` rows of ``in_proj`` (times Falcon-H1's µP multipliers), cast to
    the input's dtype as the forwards do."""
    d = module.intermediate_size
    in_proj = module.in_proj
    gate = F.linear(hidden, in_proj.weight[:d], None if in_proj.bias is None else in_proj.bias[:d])  # [B, s, d]
    mup = getattr(module, "mup_vector", None)
    if isinstance(mup, torch.Tensor):
        gate = gate * mup[..., :d]
    return module.norm(y, gate).to(hidden.dtype)


def _norm_group_width(norm: nn.Module, d: int) -> Optional[int]:
    """Channels per normalisation group of a Mamba2 gated norm (``d`` for one group); ``0`` for no norm; ``None``
    for a norm of unknown layout."""
    if isinstance(norm, nn.Identity):
        return 0
    if hasattr(norm, "group_size"):
        return norm.group_size
    if hasattr(norm, "n_groups") and hasattr(norm, "variance_epsilon"):  # Falcon-H1
        return d // norm.n_groups
    return None
