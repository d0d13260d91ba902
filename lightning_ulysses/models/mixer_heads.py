"""Head-parallel sequence mixers: each SP rank runs a mixer's projections, convolution and recurrence for ``1/sp`` of
its heads, over the whole sequence.

A sequence mixer's heads are independent from its input projections to its output projection (gated delta nets:
key heads with their value heads; the depthwise convolution and the decay parameters are per channel / per head; the
gated norm's weight is shared by the heads). So, as Megatron's tensor-parallel layers with sequence parallelism do,
rank ``j`` of the SP group:

1. receives the whole sequence of the mixer's input (the all-gather of :mod:`lightning_ulysses.models.mixers`),
2. runs the module's **own** forward with the module temporarily narrowed to its heads: the input projections'
   rows, the convolution's channels, ``A_log`` / ``dt_bias`` of its heads, the output projection's columns (its bias
   counted on rank 0 only) — slices (views) of the parameters, so the gradients land in the full parameters,
3. and the partial outputs ``[B, S, H]`` of the ranks are summed and scattered back to sequence shards (one
   reduce-scatter; its backward is an all-gather). Both collectives are :mod:`lightning_ulysses.parallel.exchange`'s.

Exact (a sum over heads instead of one matmul over them), and the mixer's activations and compute per rank fall by
``sp``. A family is one recipe returning a :class:`~lightning_ulysses.models.head_slicing.HeadSlicing`, one module of
:mod:`lightning_ulysses.models.mixer_families`, chosen by what the module *is* (its attributes and submodules); this
module applies the recipes (:func:`head_slicing` picks one, :func:`narrowed` applies it). Heads that ``sp`` does not
divide split unevenly (the first ranks take one more, as attention's heads do). The narrowed submodules and parameters
shadow the real ones through the module's instance ``__dict__``, so the parameter registries DeepSpeed walks are never
touched; under ZeRO-3 the submodules' weights are registered as external parameters of the mixer
(:mod:`lightning_ulysses.models.mixers`), so they are gathered for its whole forward and backward and can be sliced
there.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.models.head_slicing import HeadSlicing
from lightning_ulysses.models.mixer_families import FAMILIES
from lightning_ulysses.parallel.exchange import all_reduce_sum
from lightning_ulysses.patches import replaced


def head_slicing(module: nn.Module, rank: int, size: int, group: Any = None,
                 device: Optional[torch.device] = None) -> Optional[HeadSlicing]:
    """The first family recipe of :data:`lightning_ulysses.models.mixer_families.FAMILIES` that applies to ``module``
    (``None``: the mixer runs whole), its indices on ``device`` (the mixer's weights'), built once per mixer by
    :mod:`lightning_ulysses.models.mixers`."""
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
        return all_reduce_sum(super().forward(x), self.group)


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
    disabled = [name for name in slicing.disabled_functions if hasattr(modeling, name)]
    with ExitStack() as stack:
        try:
            module.__dict__.update(shadows)
            module.__dict__.update(slicing.attributes)
            for name in disabled:  # fused kernels of the modeling module that would run on the whole channels
                stack.enter_context(replaced(modeling, name, _returns_none, f"{modeling.__name__}.{name}"))
            yield
        finally:
            for name in shadows:
                module.__dict__.pop(name, None)
            module.__dict__.update(saved_attributes)


def _returns_none(*args: Any, **kwargs: Any) -> None:
    return None
