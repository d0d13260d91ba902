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
attributes and submodules). Under ZeRO-3 the parameters of a module's submodules exist only while DeepSpeed has them
gathered for that submodule's call, so the projections run themselves there: the input projections' outputs are
narrowed to this rank's features, the output projection runs on this rank's heads zero-padded to its full width
(allowed only without a bias); the convolution and recurrence are narrowed as at the other stages. The narrowed
submodules and parameters shadow the real ones through the module's instance ``__dict__``, so the parameter
registries DeepSpeed walks are never touched.
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
    """An input projection narrowed to some output features. ``through_module``: call the projection itself and keep
    those features (ZeRO-3 gathers a submodule's weight only while the submodule runs): exact, the same activations
    kept, but the projection's compute is not divided."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, through_module: bool) -> None:
        super().__init__()
        self.linear, self.index, self.through_module = [linear], index, through_module  # a list: not a child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear[0]
        if self.through_module:
            out = linear(x)
            return out[..., self.index.to(out.device)]
        index = self.index.to(linear.weight.device)
        bias = None if linear.bias is None else linear.bias[index]
        return F.linear(x, linear.weight[index], bias)


class _Columns(nn.Module):
    """An output projection narrowed to some input features (its bias added by rank 0 only). ``through_module``: the
    input is zero-padded to the full width and the projection itself runs (ZeRO-3; only for projections without
    bias)."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, with_bias: bool, through_module: bool) -> None:
        super().__init__()
        self.linear, self.index, self.with_bias, self.through_module = [linear], index, with_bias, through_module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear[0]
        index = self.index.to(x.device)
        if self.through_module:
            full = x.new_zeros((*x.shape[:-1], linear.in_features)).index_copy(-1, index, x)
            return linear(full)
        return F.linear(x, linear.weight[:, index], linear.bias if self.with_bias else None)


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


def supports_zero3(module: nn.Module, slicing: HeadSlicing) -> bool:
    """Under ZeRO-3 the output projections are run through themselves on a zero-padded input, which adds their bias
    on every rank: only projections without bias qualify."""
    return all(getattr(module._modules[name], "bias", None) is None for name in slicing.columns)


@contextmanager
def narrowed(module: nn.Module, slicing: HeadSlicing, rank: int, through_modules: bool = False) -> Iterator[None]:
    """Inside the block ``module`` computes only its heads of ``slicing`` (see the module docstring).
    ``through_modules``: run the projections themselves (ZeRO-3, see :class:`_Rows`, :class:`_Columns`)."""
    # Narrowed submodules and parameters shadow the real ones through the instance __dict__ (attribute lookup finds
    # it before nn.Module's registries), so the registries DeepSpeed walks keep the real parameters.
    shadows: dict[str, object] = {}
    for name, index in slicing.rows.items():
        shadows[name] = _Rows(module._modules[name], index, through_modules)
    for name, index in slicing.columns.items():
        shadows[name] = _Columns(module._modules[name], index, rank == 0, through_modules)
    for name, index in slicing.channels.items():
        shadows[name] = _Channels(module._modules[name], index)
    for name, index in slicing.parameters.items():
        parameter = module._parameters[name]
        shadows[name] = parameter[index.to(parameter.device)]
    saved_attributes = {name: module.__dict__[name] for name in slicing.attributes}
    try:
        module.__dict__.update(shadows)
        module.__dict__.update(slicing.attributes)
        yield
    finally:
        for name in shadows:
            module.__dict__.pop(name, None)
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
