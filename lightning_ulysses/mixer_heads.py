"""Head-parallel sequence mixers: each SP rank runs a mixer's projections, convolution and recurrence for ``1/sp`` of
its heads, over the whole sequence.

A sequence mixer's heads are independent from its input projections to its output projection (gated delta nets:
key heads with their value heads; the depthwise convolution and the decay parameters are per channel / per head; the
gated norm's weight is shared by the heads). So, as Megatron's tensor-parallel layers with sequence parallelism do,
rank ``j`` of the SP group:

1. receives the whole sequence of the mixer's input (the all-gather of :mod:`lightning_ulysses.mixers`),
2. runs the module's **own** forward with the module temporarily narrowed to its heads: the input projections'
   rows, the convolution's channels, ``A_log`` / ``dt_bias`` of its heads, the output projection's columns (its bias
   counted on rank 0 only) — slices (views) of the parameters, so the gradients land in the full parameters,
3. and the partial outputs ``[B, S, H]`` of the ranks are summed and scattered back to sequence shards (one
   reduce-scatter; its backward is an all-gather).

Exact (a sum over heads instead of one matmul over them), and the mixer's activations and compute per rank fall by
``sp``. A family is one :class:`HeadSlicing` recipe in :data:`FAMILIES`, chosen by what the module *is* (its
attributes and submodules). Under ZeRO-3 the parameters of a module's submodules are gathered by DeepSpeed only when
those submodules run, so narrowing them is not possible there: mixers then run whole (exact, not divided).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HeadSlicing:
    """How to narrow one module to a subset of its heads.

    Attributes:
        rows: input projections (``nn.Linear`` submodule names) -> output-feature indices to keep.
        columns: output projections -> input-feature indices to keep (the bias is added by rank 0 only).
        channels: depthwise ``nn.Conv1d`` submodules -> channels to keep.
        parameters: the module's own parameters -> indices to keep along dim 0.
        attributes: integer attributes the forward reads (head counts, widths) -> their narrowed values.
    """

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    channels: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    attributes: dict[str, int] = field(default_factory=dict)


def _span(start: int, count: int, width: int) -> torch.Tensor:
    """Indices of ``count`` consecutive blocks of ``width`` starting at block ``start``."""
    return torch.arange(start * width, (start + count) * width)


def gated_delta_net_slicing(module: nn.Module, rank: int, size: int) -> Optional[HeadSlicing]:
    """Gated delta nets (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid): key heads split over the ranks, each with
    its value heads (``num_v_heads / num_k_heads`` per key head). ``None`` if the layout is not one of these or the
    key heads do not split evenly."""
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d", "A_log", "dt_bias")
    if not all(hasattr(module, name) for name in names) or module.num_k_heads % size:
        return None
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    k_each, v_each = nk // size, nv // size
    if nv % nk:
        return None
    k0, v0 = rank * k_each, rank * v_each
    q_idx = _span(k0, k_each, dk)  # within the key part
    v_idx = _span(v0, v_each, dv)
    conv = torch.cat([q_idx, nk * dk + q_idx, 2 * nk * dk + v_idx])  # channels [q | k | v] of my heads
    heads = torch.arange(v0, v0 + v_each)
    slicing = HeadSlicing(channels={"conv1d": conv}, parameters={"A_log": heads, "dt_bias": heads},
                          attributes={"num_k_heads": k_each, "num_v_heads": v_each, "key_dim": k_each * dk,
                                      "value_dim": v_each * dv, "conv_dim": 2 * k_each * dk + v_each * dv})
    children = dict(module.named_children())
    if "in_proj_qkvz" in children and "in_proj_ba" in children:  # qwen3_next: rows grouped by key head
        group = 2 * dk + 2 * (nv // nk) * dv
        slicing.rows = {"in_proj_qkvz": _span(k0, k_each, group), "in_proj_ba": _span(k0, k_each, 2 * (nv // nk))}
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


FAMILIES: list[Callable[[nn.Module, int, int], Optional[HeadSlicing]]] = [gated_delta_net_slicing]


def head_slicing(module: nn.Module, rank: int, size: int) -> Optional[HeadSlicing]:
    """The first family recipe that applies to ``module`` (``None``: the mixer runs whole)."""
    for recipe in FAMILIES:
        slicing = recipe(module, rank, size)
        if slicing is not None:
            return slicing
    return None


class _Rows(nn.Module):
    def __init__(self, linear: nn.Linear, index: torch.Tensor) -> None:
        super().__init__()
        self.linear, self.index = [linear], index  # a list: not registered as a child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear, index = self.linear[0], self.index.to(self.linear[0].weight.device)
        bias = None if linear.bias is None else linear.bias[index]
        return F.linear(x, linear.weight[index], bias)


class _Columns(nn.Module):
    def __init__(self, linear: nn.Linear, index: torch.Tensor, with_bias: bool) -> None:
        super().__init__()
        self.linear, self.index, self.with_bias = [linear], index, with_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear[0]
        weight = linear.weight[:, self.index.to(linear.weight.device)]
        return F.linear(x, weight, linear.bias if self.with_bias else None)


class _Channels(nn.Module):
    """A depthwise convolution narrowed to some channels; ``weight``/``bias`` are the slices (for forwards that read
    them, like transformers' ``causal_conv1d_fn(x, conv.weight.squeeze(1), conv.bias)``)."""

    def __init__(self, conv: nn.Conv1d, index: torch.Tensor) -> None:
        super().__init__()
        index = index.to(conv.weight.device)
        self.conv = [conv]
        self.weight = conv.weight[index]
        self.bias = None if conv.bias is None else conv.bias[index]
        self.kernel_size, self.padding = conv.kernel_size, conv.padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv[0]
        return F.conv1d(x, self.weight, self.bias, conv.stride, conv.padding, conv.dilation, self.weight.shape[0])


@contextmanager
def narrowed(module: nn.Module, slicing: HeadSlicing, rank: int) -> Iterator[None]:
    """Inside the block ``module`` computes only its heads of ``slicing`` (see the module docstring)."""
    saved_modules, saved_parameters, saved_attributes = {}, {}, {}
    try:
        for name, index in slicing.rows.items():
            saved_modules[name] = module._modules[name]
            module._modules[name] = _Rows(saved_modules[name], index)
        for name, index in slicing.columns.items():
            saved_modules[name] = module._modules[name]
            module._modules[name] = _Columns(saved_modules[name], index, with_bias=rank == 0)
        for name, index in slicing.channels.items():
            saved_modules[name] = module._modules[name]
            module._modules[name] = _Channels(saved_modules[name], index)
        for name, index in slicing.parameters.items():
            saved_parameters[name] = module._parameters[name]
            module._parameters[name] = saved_parameters[name][index.to(saved_parameters[name].device)]
        for name, value in slicing.attributes.items():
            saved_attributes[name] = module.__dict__[name]
            module.__dict__[name] = value
        yield
    finally:
        module._modules.update(saved_modules)
        module._parameters.update(saved_parameters)
        module.__dict__.update(saved_attributes)


class _ReduceScatterSequence(torch.autograd.Function):
    """``[B, S, ...]`` partial sums of the SP group -> this rank's ``[B, S/sp, ...]`` of their sum; backward: the
    all-gather of the shard gradients."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.group = group
        sp = dist.get_world_size(group)
        B, S = partial.shape[:2]
        chunks = partial.reshape(B, sp, S // sp, *partial.shape[2:]).transpose(0, 1).contiguous()  # [sp, B, s, ...]
        out = partial.new_empty((B, S // sp, *partial.shape[2:]))
        dist.reduce_scatter_tensor(out, chunks.view(sp * B, S // sp, *partial.shape[2:]), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from lightning_ulysses.mixers import all_gather_sequence

        return all_gather_sequence(grad, ctx.group), None


def reduce_scatter_sequence(partial: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterSequence.apply(partial, group)
