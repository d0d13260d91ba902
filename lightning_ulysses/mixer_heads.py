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
attributes and submodules). The narrowed submodules and parameters shadow the real ones through the module's
instance ``__dict__``, so the parameter registries DeepSpeed walks are never touched; under ZeRO-3 the submodules'
weights are registered as external parameters of the mixer (:mod:`lightning_ulysses.mixers`), so they are gathered
for its whole forward and backward and can be sliced there.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

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
        modules: other submodules replaced while narrowed (e.g. a norm over channels of several ranks).
        buffers: the module's own per-head buffers -> (dim of the heads, indices to keep).
        disabled_functions: functions of the module's modeling file that must not run while narrowed (fused kernels
            that would see only the narrowed part of a computation spanning the ranks): they return ``None``, which
            makes transformers take its unfused path.
    """

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    channels: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    attributes: dict[str, int] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    buffers: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    disabled_functions: tuple[str, ...] = ()


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


def mamba2_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """Mamba2 mixers (mamba2, nemotron_h, bamba, granitemoehybrid, zamba2): SSM heads split over the ranks. The
    input projection is ``[gate | x | B | C | dt]`` and the convolution runs over ``[x | B | C]``; B and C belong to
    head groups: with one group (the Bamba, Granite 4 and Zamba2 checkpoints) every rank keeps them whole, with a
    number of groups the ranks divide each rank keeps its heads' groups. The gated RMSNorm normalises over a group's
    channels: with one group those span every rank, so its sum of squares is all-reduced over the SP group (one
    all-reduce of ``[B, S, 1]`` forward and backward)."""
    names = ("num_heads", "head_dim", "intermediate_size", "n_groups", "ssm_state_size", "conv_dim", "in_proj",
             "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias")
    if not all(hasattr(module, name) for name in names) or hasattr(module, "mup_vector"):
        return None
    nh, hd, d, ng, ds = module.num_heads, module.head_dim, module.intermediate_size, module.n_groups, module.ssm_state_size
    norm = module.norm
    if nh % size or d != nh * hd or not hasattr(norm, "group_size") or not (ng == 1 or ng % size == 0):
        return None
    if module.in_proj.out_features != 2 * d + 2 * ng * ds + nh or module.conv_dim != d + 2 * ng * ds:
        return None
    h_each = nh // size
    heads = torch.arange(rank * h_each, (rank + 1) * h_each)
    x_idx = _span(rank * h_each, h_each, hd)
    g_each = ng if ng == 1 else ng // size
    b_idx = torch.arange(ng * ds) if ng == 1 else _span(rank * g_each, g_each, ds)
    rows = torch.cat([x_idx, d + x_idx, 2 * d + b_idx, 2 * d + ng * ds + b_idx, 2 * d + 2 * ng * ds + heads])
    conv = torch.cat([x_idx, d + b_idx, d + ng * ds + b_idx])
    spans_ranks = ng == 1 and size > 1
    return HeadSlicing(
        rows={"in_proj": rows}, columns={"out_proj": x_idx}, channels={"conv1d": conv},
        parameters={"A_log": heads, "D": heads, "dt_bias": heads},
        attributes={"num_heads": h_each, "intermediate_size": h_each * hd, "n_groups": g_each,
                    "conv_dim": h_each * hd + 2 * g_each * ds},
        modules={"norm": _GatedNormAcrossRanks(norm, x_idx, d if spans_ranks else norm.group_size,
                                               group if spans_ranks else None)},
        disabled_functions=("mamba2_split_conv1d_scan_combined",))


def lightning_attention_slicing(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    """Lightning attention (minimax): heads split over the ranks with their per-head decays (``slope_rate`` and the
    decay buffers); ``qkv_proj`` rows are ``3 · head_dim`` per head, ``output_gate`` rows and ``out_proj`` columns
    ``head_dim`` per head; the RMSNorm over all heads' channels all-reduces its sum of squares over the SP group."""
    names = ("num_attention_heads", "head_dim", "qkv_proj", "output_gate", "out_proj", "norm", "slope_rate",
             "query_decay", "key_decay", "diagonal_decay")
    if not all(hasattr(module, name) for name in names) or module.num_attention_heads % size:
        return None
    nh, hd = module.num_attention_heads, module.head_dim
    if module.qkv_proj.out_features != 3 * nh * hd or module.diagonal_decay.shape[1] != nh:
        return None
    each = nh // size
    heads = torch.arange(rank * each, (rank + 1) * each)
    channels = _span(rank * each, each, hd)
    norm = module.norm
    return HeadSlicing(
        rows={"qkv_proj": _span(rank * each, each, 3 * hd), "output_gate": channels}, columns={"out_proj": channels},
        buffers={"slope_rate": (0, heads), "query_decay": (0, heads), "key_decay": (0, heads),
                 "diagonal_decay": (1, heads)},
        attributes={"num_attention_heads": each},
        modules={"norm": _GatedNormAcrossRanks(norm, channels, nh * hd, group if size > 1 else None)})


def _gated_delta_net_recipe(module: nn.Module, rank: int, size: int, group: Any = None) -> Optional[HeadSlicing]:
    return gated_delta_net_slicing(module, rank, size)


FAMILIES: list[Callable[..., Optional[HeadSlicing]]] = [_gated_delta_net_recipe, mamba2_slicing,
                                                       lightning_attention_slicing]


def head_slicing(module: nn.Module, rank: int, size: int, group: Any = None,
                 device: Optional[torch.device] = None) -> Optional[HeadSlicing]:
    """The first family recipe that applies to ``module`` (``None``: the mixer runs whole), its indices on
    ``device`` (the mixer's weights'), built once per mixer by :mod:`lightning_ulysses.mixers`."""
    for recipe in FAMILIES:
        slicing = recipe(module, rank, size, group)
        if slicing is not None:
            return _on_device(slicing, device) if device is not None else slicing
    return None


def _on_device(slicing: HeadSlicing, device: torch.device) -> HeadSlicing:
    for table in (slicing.rows, slicing.columns, slicing.channels, slicing.parameters):
        for name, index in table.items():
            table[name] = index.to(device)
    slicing.buffers = {name: (dim, index.to(device)) for name, (dim, index) in slicing.buffers.items()}
    for shim in slicing.modules.values():
        if isinstance(getattr(shim, "index", None), torch.Tensor):
            shim.index = shim.index.to(device)
    return slicing


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; its backward is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatedNormAcrossRanks(nn.Module):
    """transformers' gated RMSNorm of Mamba2 mixers (``x · silu(gate)``, normalised over groups of ``width``
    channels, times the weight) on this rank's channels ``index``; with a ``group``, one normalisation group spans the
    ranks and its sum of squares is all-reduced."""

    def __init__(self, norm: nn.Module, index: torch.Tensor, width: int, group: Any) -> None:
        super().__init__()
        self.norm, self.index, self.width, self.group = [norm], index, width, group
        self.variance_epsilon = norm.variance_epsilon

    @property
    def weight(self) -> torch.Tensor:  # sliced at use (the recipe is built once; the weight changes every step)
        return self.norm[0].weight[self.index]

    def forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        norm = self.norm[0]
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * F.silu(gate.to(torch.float32))
        if self.group is not None:  # [B, S, 1]: the sum of squares over every rank's channels
            squares = _AllReduceSum.apply(h.pow(2).sum(-1, keepdim=True), self.group)
            h = h * torch.rsqrt(squares / self.width + norm.variance_epsilon)
        else:
            *prefix, last = h.shape
            grouped = h.view(*prefix, last // self.width, self.width)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            h = grouped.view(*prefix, last)
        return self.weight * h.to(input_dtype)


class _NarrowedLinear(nn.Module):
    """A projection narrowed to some features; ``weight``/``bias`` are the real ones (what a disabled fused call is
    handed)."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor) -> None:
        super().__init__()
        self.linear, self.index = [linear], index  # a list: not registered as a child

    @property
    def weight(self) -> torch.Tensor:
        return self.linear[0].weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.linear[0].bias


class _Rows(_NarrowedLinear):
    """An input projection narrowed to some output features (views of its weight and bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.index]
        return F.linear(x, self.weight[self.index], bias)


class _Columns(_NarrowedLinear):
    """An output projection narrowed to some input features; its bias is added by rank 0 only, so that the sum over
    the ranks adds it once."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, with_bias: bool) -> None:
        super().__init__(linear, index)
        self.with_bias = with_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[:, self.index], self.bias if self.with_bias else None)


class _Channels(nn.Module):
    """A depthwise convolution narrowed to some channels; ``weight``/``bias`` are the slices (for forwards that read
    them, like transformers' ``causal_conv1d_fn(x, conv.weight.squeeze(1), conv.bias)``)."""

    def __init__(self, conv: nn.Conv1d, index: torch.Tensor) -> None:
        super().__init__()
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
    # Narrowed submodules and parameters shadow the real ones through the instance __dict__ (attribute lookup finds
    # it before nn.Module's registries), so the registries DeepSpeed walks keep the real parameters.
    shadows: dict[str, object] = {}
    for name, index in slicing.rows.items():
        shadows[name] = _Rows(module._modules[name], index)
    for name, index in slicing.columns.items():
        shadows[name] = _Columns(module._modules[name], index, rank == 0)
    for name, index in slicing.channels.items():
        shadows[name] = _Channels(module._modules[name], index)
    for name, index in slicing.parameters.items():
        shadows[name] = module._parameters[name][index]
    for name, (dim, index) in slicing.buffers.items():
        shadows[name] = module._buffers[name].index_select(dim, index)
    shadows.update(slicing.modules)
    saved_attributes = {name: module.__dict__[name] for name in slicing.attributes}
    modeling = sys.modules.get(type(module).__module__)
    saved_functions = {name: getattr(modeling, name) for name in slicing.disabled_functions
                       if hasattr(modeling, name)}
    try:
        module.__dict__.update(shadows)
        module.__dict__.update(slicing.attributes)
        for name in saved_functions:
            setattr(modeling, name, _returns_none)
        yield
    finally:
        for name in shadows:
            module.__dict__.pop(name, None)
        module.__dict__.update(saved_attributes)
        for name, function in saved_functions.items():
            setattr(modeling, name, function)


def _returns_none(*args: Any, **kwargs: Any) -> None:
    return None


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
