"""Lightning attention (minimax): heads split over the ranks with their per-head decays."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import Deferral, GatedNormAcrossRanks, HeadSlicing, share, span


def lightning_attention_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """Lightning attention (minimax): heads split over the ranks with their per-head decays (``slope_rate`` and the
    decay buffers); ``qkv_proj`` rows are ``3 · head_dim`` per head, ``output_gate`` rows and ``out_proj`` columns
    ``head_dim`` per head; the RMSNorm over all heads' channels all-reduces its sum of squares over the SP group on
    the gather path; under the exchange it runs with the output gate on the shard after the exchange back (every
    channel there), the module's own ``sigmoid(gate) · norm(y)`` multiplying by one (its gate placeholder is
    ``+inf``)."""
    names = ("num_attention_heads", "head_dim", "qkv_proj", "output_gate", "out_proj", "norm", "slope_rate",
             "query_decay", "key_decay", "diagonal_decay")
    if not all(hasattr(module, name) for name in names) or module.num_attention_heads < size:
        return None
    nh, hd = module.num_attention_heads, module.head_dim
    if module.qkv_proj.out_features != 3 * nh * hd or module.diagonal_decay.shape[1] != nh:
        return None
    first, each = share(nh, rank, size)
    heads = torch.arange(first, first + each)
    channels = span(first, each, hd)
    norm = module.norm
    return HeadSlicing(
        rows={"qkv_proj": span(first, each, 3 * hd), "output_gate": channels}, columns={"out_proj": channels},
        buffers={"slope_rate": (0, heads), "query_decay": (0, heads), "key_decay": (0, heads),
                 "diagonal_decay": (1, heads)},
        attributes={"num_attention_heads": each},
        modules={"norm": GatedNormAcrossRanks(norm, channels, nh * hd, group if size > 1 else None)},
        inputs=("qkv_proj", "output_gate"), deferred={"output_gate": None},
        deferral=Deferral(tail=_norm_and_gate_tail, norm="norm", unit_gates=("output_gate",)))


def _norm_and_gate_tail(module: nn.Module, y: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Lightning attention's last step before ``out_proj``, on the shard with every head:
    ``sigmoid(output_gate(x)) · norm(y)`` as its forward computes it (the norm over every head: no all-reduce)."""
    gate = F.linear(hidden, module.output_gate.weight, module.output_gate.bias)
    return F.sigmoid(gate) * module.norm(y)
