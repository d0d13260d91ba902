"""Gated delta nets (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid): key heads split over the ranks, each with its
value heads (``num_v_heads / num_k_heads`` per key head)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses.models.head_slicing import HeadSlicing, share, span


def gated_delta_net_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """The projections' rows of this rank's key heads (``[q | k | v]`` channels of the convolution), ``A_log`` /
    ``dt_bias`` of its value heads, the output projection's columns; the gated norm's weight is per head dimension
    (shared by the heads). ``None`` if the layout is not one of these or there are fewer key heads than ranks."""
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d", "A_log", "dt_bias")
    if not all(hasattr(module, name) for name in names) or module.num_k_heads < size:
        return None
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    if nv % nk:
        return None
    ratio = nv // nk
    k0, k_each = share(nk, rank, size)
    v0, v_each = k0 * ratio, k_each * ratio
    q_idx = span(k0, k_each, dk)  # within the key part
    v_idx = span(v0, v_each, dv)
    conv = torch.cat([q_idx, nk * dk + q_idx, 2 * nk * dk + v_idx])  # channels [q | k | v] of my heads
    heads = torch.arange(v0, v0 + v_each)
    slicing = HeadSlicing(channels={"conv1d": conv}, parameters={"A_log": heads, "dt_bias": heads},
                          attributes={"num_k_heads": k_each, "num_v_heads": v_each, "key_dim": k_each * dk,
                                      "value_dim": v_each * dv, "conv_dim": 2 * k_each * dk + v_each * dv})
    children = dict(module.named_children())
    if "in_proj_qkvz" in children and "in_proj_ba" in children:  # qwen3_next: rows grouped by key head
        group_rows = 2 * dk + 2 * ratio * dv
        slicing.rows = {"in_proj_qkvz": span(k0, k_each, group_rows), "in_proj_ba": span(k0, k_each, 2 * ratio)}
    elif all(name in children for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):  # qwen3_5
        slicing.rows = {"in_proj_qkv": conv, "in_proj_z": v_idx, "in_proj_b": heads, "in_proj_a": heads}
    elif all(name in children for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")):  # olmo
        slicing.rows = {"q_proj": q_idx, "k_proj": q_idx, "v_proj": v_idx, "a_proj": heads, "b_proj": heads,
                        "g_proj": v_idx}
    else:
        return None
    out = "out_proj" if "out_proj" in children else "o_proj" if "o_proj" in children else None
    if out is None:
        return None
    slicing.columns = {out: v_idx}
    return slicing
