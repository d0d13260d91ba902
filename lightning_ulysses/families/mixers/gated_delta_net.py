"""Gated delta nets (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid): key heads split over the ranks, each with its
value heads (``num_v_heads / num_k_heads`` per key head)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import Deferral, HeadSlicing, share, span


def gated_delta_net_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """The projections' rows of this rank's key heads (``[q | k | v]`` channels of the convolution), ``A_log`` /
    ``dt_bias`` of its value heads, the output projection's columns; the gated norm's weight is per head dimension
    (shared by the heads), so under the exchange the norm and its gate (``z``, ``g_proj``) run on the shard after the
    exchange back and the gate rows never travel. ``None`` if the layout is not one of these or there are fewer key
    heads than ranks."""
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
        z_in_group = torch.arange(2 * dk + ratio * dv, group_rows)  # [q | k | v | z] per key head
        slicing.rows = {"in_proj_qkvz": span(k0, k_each, group_rows), "in_proj_ba": span(k0, k_each, 2 * ratio)}
        z_rows = torch.cat([g * group_rows + z_in_group for g in range(nk)])  # every head's z rows, head order
        slicing.deferred = {"in_proj_qkvz": torch.cat([g * group_rows + z_in_group for g in range(k_each)])}
        gate, norm = _rows_of("in_proj_qkvz", z_rows), "norm"
    elif all(name in children for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):  # qwen3_5
        slicing.rows = {"in_proj_qkv": conv, "in_proj_z": v_idx, "in_proj_b": heads, "in_proj_a": heads}
        slicing.deferred = {"in_proj_z": None}
        gate, norm = _rows_of("in_proj_z"), "norm"
    elif all(name in children for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")):  # olmo
        slicing.rows = {"q_proj": q_idx, "k_proj": q_idx, "v_proj": v_idx, "a_proj": heads, "b_proj": heads,
                        "g_proj": v_idx}
        slicing.deferred = {"g_proj": None}
        gate, norm = _rows_of("g_proj"), "o_norm"
    else:
        return None
    out = "out_proj" if "out_proj" in children else "o_proj" if "o_proj" in children else None
    if out is None or norm not in children:
        return None
    slicing.columns = {out: v_idx}
    slicing.inputs = tuple(slicing.rows)
    slicing.deferral = Deferral(tail=_gated_norm_tail(gate, norm, dv), norm=norm)
    return slicing


def _rows_of(name: str, rows: Optional[torch.Tensor] = None) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The gate: projection ``name`` of the shard (only ``rows`` of it if given), ``[B, s, value heads · dv]``."""

    def gate(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        linear = module._modules[name]
        weight, bias = linear.weight, linear.bias
        if rows is not None:
            index = rows.to(weight.device)
            weight, bias = weight.index_select(0, index), None if bias is None else bias.index_select(0, index)
        return F.linear(hidden, weight, bias)

    return gate


def _gated_norm_tail(gate: Callable[[nn.Module, torch.Tensor], torch.Tensor], norm: str, dv: int) -> Any:
    """The delta nets' last step before ``out_proj``, on the shard with every head: the gated norm per value head,
    ``norm(core, gate)`` on ``[B·s·heads, dv]``, as their forwards call it."""

    def tail(module: nn.Module, core: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        B, s, _ = core.shape
        z = gate(module, hidden)  # [B, s, value heads · dv]
        return module._modules[norm](core.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, s, -1)

    return tail
