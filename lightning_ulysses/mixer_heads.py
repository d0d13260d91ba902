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
``sp``. A family is one :class:`HeadSlicing` recipe, one module of :mod:`lightning_ulysses.mixer_families`, chosen by
what the module *is* (its attributes and submodules). Heads that ``sp`` does not divide split unevenly (the first
ranks take one more, as attention's heads do). The narrowed submodules and parameters shadow the real ones through the module's
instance ``__dict__``, so the parameter registries DeepSpeed walks are never touched; under ZeRO-3 the submodules'
weights are registered as external parameters of the mixer (:mod:`lightning_ulysses.mixers`), so they are gathered
for its whole forward and backward and can be sliced there.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HeadSlicing:
    """How to narrow one module to a subset of its heads.

    Attributes:
        rows: input projections (``nn.Linear`` submodule names) -> output-feature indices to keep; the narrowed
            projection's ``weight``/``bias`` are the slices (for forwards that read ``proj.weight`` directly).
        columns: output projections -> input-feature indices to keep (the bias is added by rank 0 only).
        summed_columns: projections contracting over the heads whose output every rank needs whole (Mamba1's
            ``x_proj``): input features kept as ``columns``, the partial outputs all-reduced over the SP group.
        channels: depthwise ``nn.Conv1d`` submodules -> channels to keep.
        parameters: the module's own parameters -> indices to keep along dim 0, or ``(dim, indices)``.
        attributes: integer attributes the forward reads (head counts, widths) -> their narrowed values.
        modules: other submodules replaced while narrowed (e.g. a norm over channels of several ranks).
        buffers: the module's own per-head buffers -> (dim of the heads, indices to keep).
        children: submodules narrowed by their own recipe (e.g. Kimi's forget gate).
        disabled_functions: functions of the module's modeling file that must not run while narrowed (fused kernels
            that would see only the narrowed part of a computation spanning the ranks): they return ``None``, which
            makes transformers take its unfused path.
    """

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    summed_columns: dict[str, torch.Tensor] = field(default_factory=dict)
    channels: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, int] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    buffers: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    children: dict[str, "HeadSlicing"] = field(default_factory=dict)
    disabled_functions: tuple[str, ...] = ()
    group: Any = None  # the SP group (for summed_columns)


def share(count: int, rank: int, size: int) -> tuple[int, int]:
    """``(first, number)`` of ``count`` heads taken by ``rank`` of ``size``: consecutive blocks, the first
    ``count % size`` ranks one more (as attention's uneven head split)."""
    base, extra = divmod(count, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def span(start: int, count: int, width: int) -> torch.Tensor:
    """Indices of ``count`` consecutive blocks of ``width`` starting at block ``start``."""
    return torch.arange(start * width, (start + count) * width)


def head_slicing(module: nn.Module, rank: int, size: int, group: Any = None,
                 device: Optional[torch.device] = None) -> Optional[HeadSlicing]:
    """The first family recipe of :data:`lightning_ulysses.mixer_families.FAMILIES` that applies to ``module``
    (``None``: the mixer runs whole), its indices on ``device`` (the mixer's weights'), built once per mixer by
    :mod:`lightning_ulysses.mixers`."""
    from lightning_ulysses.mixer_families import FAMILIES

    for recipe in FAMILIES:
        slicing = recipe(module, rank, size, group)
        if slicing is not None:
            slicing.group = group
            return _on_device(slicing, device) if device is not None else slicing
    return None


def _on_device(slicing: HeadSlicing, device: torch.device) -> HeadSlicing:
    for table in (slicing.rows, slicing.columns, slicing.summed_columns, slicing.channels):
        for name, index in table.items():
            table[name] = index.to(device)
    slicing.parameters = {name: (index[0], index[1].to(device)) if isinstance(index, tuple) else index.to(device)
                          for name, index in slicing.parameters.items()}
    slicing.buffers = {name: (dim, index.to(device)) for name, (dim, index) in slicing.buffers.items()}
    for shim in slicing.modules.values():
        if isinstance(getattr(shim, "index", None), torch.Tensor):
            shim.index = shim.index.to(device)
    for child in slicing.children.values():
        child.group = slicing.group
        _on_device(child, device)
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
        gate_after = getattr(norm, "norm_before_gate", False)  # Falcon-H1's option: normalise, then gate
        if gate is not None and not gate_after:
            h = h * F.silu(gate.to(torch.float32))
        if self.group is not None:  # [B, S, 1]: the sum of squares over every rank's channels
            squares = _AllReduceSum.apply(h.pow(2).sum(-1, keepdim=True), self.group)
            h = h * torch.rsqrt(squares / self.width + norm.variance_epsilon)
        else:
            *prefix, last = h.shape
            grouped = h.view(*prefix, last // self.width, self.width)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            h = grouped.view(*prefix, last)
        if gate is not None and gate_after:
            return (self.weight * h * F.silu(gate.to(torch.float32))).to(input_dtype)
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
    """An input projection narrowed to some output features; ``weight``/``bias`` are the slices (Mamba1 reads
    ``dt_proj.weight`` directly)."""

    @property
    def weight(self) -> torch.Tensor:
        return self.linear[0].weight[self.index]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        bias = self.linear[0].bias
        return None if bias is None else bias[self.index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Columns(_NarrowedLinear):
    """An output projection narrowed to some input features; its bias is added by rank 0 only, so that the sum over
    the ranks adds it once."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, with_bias: bool) -> None:
        super().__init__(linear, index)
        self.with_bias = with_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[:, self.index], self.bias if self.with_bias else None)


class _SummedColumns(_Columns):
    """A projection contracting over the heads whose output every rank needs whole: this rank's input features'
    partial product, all-reduced over the SP group (``[B, S, out]``, forward and backward); rank 0 adds the bias."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, with_bias: bool, group: Any) -> None:
        super().__init__(linear, index, with_bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(super().forward(x), self.group)


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
    with ExitStack() as stack:
        for name, child in slicing.children.items():
            stack.enter_context(narrowed(module._modules[name], child, rank))
        stack.enter_context(_narrowed_here(module, slicing, rank))
        yield


@contextmanager
def _narrowed_here(module: nn.Module, slicing: HeadSlicing, rank: int) -> Iterator[None]:
    # Narrowed submodules and parameters shadow the real ones through the instance __dict__ (attribute lookup finds
    # it before nn.Module's registries), so the registries DeepSpeed walks keep the real parameters.
    shadows: dict[str, object] = {}
    for name, index in slicing.rows.items():
        shadows[name] = _Rows(module._modules[name], index)
    for name, index in slicing.columns.items():
        shadows[name] = _Columns(module._modules[name], index, rank == 0)
    for name, index in slicing.summed_columns.items():
        shadows[name] = _SummedColumns(module._modules[name], index, rank == 0, slicing.group)
    for name, index in slicing.channels.items():
        shadows[name] = _Channels(module._modules[name], index)
    for name, index in slicing.parameters.items():
        dim, index = index if isinstance(index, tuple) else (0, index)
        shadows[name] = module._parameters[name].index_select(dim, index)
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
