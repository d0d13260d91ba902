"""Head-parallel sequence mixers: each SP rank runs a mixer's convolution and recurrence for ``1/sp`` of its heads,
over the whole sequence.

A sequence mixer's heads are independent from its input projections to its output projection (gated delta nets:
key heads with their value heads; the depthwise convolution and the decay parameters are per channel / per head; the
gated norm's weight is shared by the heads). So, as Megatron-Core's context-parallel Mamba and Ulysses attention do,
rank ``j`` of the SP group (:mod:`lightning_ulysses.models.mixers` drives it):

1. computes the module's input projections for its sequence shard and sends every rank that rank's rows, one
   all-to-all per layer (sequence shards -> head shards; each rank's rows are its heads' channels, what its recipe's
   ``rows`` name);
2. runs the module's **own** forward, narrowed to its heads, on a placeholder of its hidden states: the input
   projections return the rows received (:class:`ExchangeRun`), the convolution's channels, ``A_log`` / ``dt_bias`` of
   its heads are slices (views) of the parameters, so the gradients land in the full parameters, and the output
   projection returns its input, this rank's heads' output over the whole sequence;
3. that goes back by the reverse all-to-all (head shards -> sequence shards), and the output projection runs on the
   shard with every head, after the family's gate or gated norm where it has one (a
   :class:`~lightning_ulysses.families.mixers.head_slicing.Deferral`: its gate is a projection of the shard's input,
   so it never travels).

Exact (the forward is bitwise the one device's: the shard's projections are the full ones, row by row), and the
mixer's activations and compute per rank fall by ``sp``, as its bytes do. A family is one recipe returning a
:class:`~lightning_ulysses.families.mixers.head_slicing.HeadSlicing`, one module of
:mod:`lightning_ulysses.families.mixers`, chosen by what the module *is* (its attributes and submodules); this
module applies the recipes (:func:`head_slicing` picks one, :func:`narrowed` applies it). Heads that ``sp`` does
not divide split unevenly (the first ranks take one more, as attention's heads do). The narrowed submodules and
parameters shadow the real ones through the module's instance ``__dict__``, so the parameter registries DeepSpeed
walks are never touched; under ZeRO-3 the submodules' weights are registered as external parameters of the mixer
(:mod:`lightning_ulysses.models.mixers`), so they are gathered for its whole forward and backward and can be sliced
there.

A module whose forward does not go as its family expects (it transforms its input before projecting it, returns
something other than its output projection's output, or uses its gate another way) raises
:class:`MixerExchangeError` inside the run: the mixer then runs the gather path instead (the same narrowing, applied
to the all-gathered ``[B, S, H]`` input, the partial outputs reduce-scattered). Any other use of the placeholder's
content (NaN) makes the output NaN, which the model-form check finds before the first step.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import HeadSlicing
from lightning_ulysses.families.mixers import FAMILIES
from lightning_ulysses.parallel.exchange import all_reduce_sum
from lightning_ulysses.patches import on_instance, put_on_instance, replaced, take_from_instance


def head_slicing(module: nn.Module, rank: int, size: int, group: Any = None,
                 device: Optional[torch.device] = None) -> Optional[HeadSlicing]:
    """The first family recipe of :data:`lightning_ulysses.families.mixers.FAMILIES` that applies to ``module``
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
    slicing.deferred = {name: None if index is None else index.to(device) for name, index in slicing.deferred.items()}
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


class _NarrowedLinear:
    """A projection narrowed to some features; ``weight``/``bias`` are the real ones (what a disabled fused call is
    handed). A plain callable, not a module: no module hook (DeepSpeed's, a profiler's) sees it or wraps what it is
    given and returns, so the exchange's checks of what a projection got and returned are exact."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor) -> None:
        self.linear, self.index = [linear], index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)  # type: ignore[attr-defined]

    @property
    def weight(self) -> torch.Tensor:
        return self.linear[0].weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.linear[0].bias


class MixerExchangeError(RuntimeError):
    """A mixer's forward did not go as its family's exchange expects (see the module docstring)."""


class ExchangeRun:
    """What the shadows of one exchanged call of a mixer share: the rows this rank received for each input projection
    (``received``: qualified name -> ``[B, S, n]``), the placeholders of the hidden states handed to the module (one
    per packed document: their positions in the flattened ``[B·S]``), the deferred placeholders (gates computed after
    the exchange back), and what the deferred stage and the output projection were given."""

    def __init__(self, received: dict[str, torch.Tensor]) -> None:
        self.received = received
        self._inputs: dict[int, tuple[torch.Tensor, Optional[tuple[int, int]]]] = {}
        self._deferred: dict[int, torch.Tensor] = {}
        self.stage_input: Optional[torch.Tensor] = None  # what the deferred norm / gated function returned
        self.held: Optional[torch.Tensor] = None  # what the output projection got (and returned)
        self.held_value: Optional[torch.Tensor] = None  # what goes back: that, or the deferred stage's input

    def placeholder(self, shape: tuple[int, ...], like: torch.Tensor,
                    bounds: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """A ``shape`` tensor of NaN costing one element (every stride 0): the hidden states handed to the module;
        ``bounds``: the packed document's positions in the flattened ``[B·S]``."""
        placeholder = torch.full((), float("nan"), dtype=like.dtype, device=like.device).expand(shape)
        self._inputs[id(placeholder)] = (placeholder, bounds)
        return placeholder

    def is_input_placeholder(self, x: Any) -> bool:
        entry = self._inputs.get(id(x))
        return entry is not None and entry[0] is x

    def bounds(self, x: torch.Tensor, owner: str) -> Optional[tuple[int, int]]:
        entry = self._inputs.get(id(x))
        if entry is None or entry[0] is not x:
            raise MixerExchangeError(
                f"{owner} was called on a tensor other than the hidden states the mixer was given (the module"
                " transformed its input before projecting it), so its rows cannot be computed before the mixer runs")
        return entry[1]

    def deferred_placeholder(self, shape: tuple[int, ...], like: torch.Tensor, fill: float) -> torch.Tensor:
        """A ``shape`` tensor of ``fill`` costing one element: a gate that the deferred stage computes."""
        placeholder = torch.full((), fill, dtype=like.dtype, device=like.device).expand(shape)
        self._deferred[placeholder.data_ptr()] = placeholder
        return placeholder

    def is_deferred_placeholder(self, x: torch.Tensor) -> bool:
        return x.data_ptr() in self._deferred and all(stride == 0 for stride in x.stride())

    def check_deferred(self, gate: Any, owner: str) -> None:
        """``gate`` must come from a deferred placeholder (a view of one, or NaN throughout: placeholder rows of a
        projection whose other rows were exchanged)."""
        if isinstance(gate, torch.Tensor) and (self.is_deferred_placeholder(gate) or bool(torch.isnan(gate).all())):
            return
        raise MixerExchangeError(f"{owner} was given a gate that is not the placeholder of its deferred gate")

    def deferred_stage_input(self, x: torch.Tensor, owner: str) -> torch.Tensor:
        """With a deferred stage, what reaches the output projection must be what that stage's shadow returned (a
        view of it, a copy in another dtype, or equal to it: a unit gate multiplied it by one); returns the stage's
        input in ``x``'s shape (and the stage's dtype), what the stage runs on after the exchange back."""
        start, self.stage_input = self.stage_input, None
        if start is None:
            raise MixerExchangeError(f"{owner} ran before the mixer's gate or gated norm that its family defers")
        if x.numel() == start.numel():
            if x.data_ptr() == start.data_ptr() and x.dtype == start.dtype:
                return x
            for layout in (start, start.transpose(-1, -2)):  # reshaped, or transposed (Mamba1's [B, d, S] output)
                candidate = layout.reshape(x.shape)
                if torch.equal(torch.nan_to_num(x), torch.nan_to_num(candidate.to(x.dtype))):
                    return candidate
        raise MixerExchangeError(f"{owner} was given something other than the output of the mixer's gated norm")


class _Exchanged(_NarrowedLinear):
    """An input projection under the exchange: called on the mixer's placeholder it returns the rows this rank
    received (``[B, S, n]``, or the packed document's part), with placeholders at its deferred positions."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, key: str, run: ExchangeRun,
                 deferred: Optional[torch.Tensor], all_deferred: bool, fill: float) -> None:
        super().__init__(linear, index)
        self.key, self.run, self.fill, self.all_deferred = key, run, fill, all_deferred
        kept = None
        if deferred is not None and not all_deferred:
            mask = torch.ones(len(index), dtype=torch.bool, device=index.device)
            mask[deferred] = False
            kept = mask.nonzero().flatten()
        self.kept = kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bounds = self.run.bounds(x, self.key)
        shape = (*x.shape[:-1], len(self.index))
        if self.all_deferred:
            return self.run.deferred_placeholder(shape, x, self.fill)
        got = self.run.received[self.key]  # [B, S, n]
        if bounds is not None:
            got = got.reshape(1, -1, got.shape[-1])[:, bounds[0]:bounds[1]]  # [1, document, n]
        if self.kept is None:
            return got
        return got.new_full(shape, self.fill).index_copy(-1, self.kept, got)  # placeholders at the deferred rows


class _HeldOutput(_NarrowedLinear):
    """The output projection under the exchange: returns its input (this rank's heads over the whole sequence), which
    the mixer's output must be; the projection itself runs after the exchange back."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, run: ExchangeRun, owner: str, staged: bool) -> None:
        super().__init__(linear, index)
        self.run, self.owner, self.staged = run, owner, staged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.run.held_value = self.run.deferred_stage_input(x, self.owner) if self.staged else x
        self.run.held = x
        return x


class _DeferredNorm:
    """A mixer's (gated) norm under the exchange: returns its input; it runs after the exchange back, with every
    head, its gate computed there. A plain callable (see :class:`_NarrowedLinear`)."""

    def __init__(self, norm: nn.Module, run: ExchangeRun, owner: str) -> None:
        self.norm, self.run, self.owner = [norm], run, owner

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    @property
    def weight(self) -> Optional[torch.Tensor]:  # read by fused calls whose functions are disabled
        return getattr(self.norm[0], "weight", None)

    @property
    def variance_epsilon(self) -> Any:
        return getattr(self.norm[0], "variance_epsilon", getattr(self.norm[0], "eps", None))

    def forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate is not None:
            self.run.check_deferred(gate, self.owner)
        self.run.stage_input = hidden_states
        return hidden_states


class _InputScale:
    """A number the module multiplies its input by before projecting it (:attr:`HeadSlicing.input_scale`): times
    the placeholder it is the placeholder (the exchange projected the scaled shard), times anything else the
    product."""

    def __init__(self, value: Any, run: ExchangeRun) -> None:
        self.value, self.run = value, run

    def __mul__(self, other: Any) -> Any:
        return other if self.run.is_input_placeholder(other) else other * self.value

    __rmul__ = __mul__


def _gate_dropped(function: Any, keyword: str, run: ExchangeRun, owner: str) -> Any:
    """``function`` called with its gate keyword (a deferred placeholder) left out; the gate is applied after the
    exchange back."""

    def call(*args: Any, **kwargs: Any) -> Any:
        run.check_deferred(kwargs.get(keyword), f"{owner} ({keyword}=)")
        kwargs[keyword] = None
        out = function(*args, **kwargs)
        run.stage_input = out[0] if isinstance(out, tuple) else out
        return out

    return call


class _Rows(_NarrowedLinear):
    """An input projection narrowed to some output features; ``weight``/``bias`` are the slices (Mamba1 reads
    ``dt_proj.weight`` directly). Under the exchange, applied to a deferred placeholder it returns one (Kimi's
    low-rank output gate)."""

    def __init__(self, linear: nn.Linear, index: torch.Tensor, run: Optional[ExchangeRun] = None) -> None:
        super().__init__(linear, index)
        self.run = run

    @property
    def weight(self) -> torch.Tensor:
        return self.linear[0].weight[self.index]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        bias = self.linear[0].bias
        return None if bias is None else bias[self.index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.run is not None and self.run.is_deferred_placeholder(x):
            return self.run.deferred_placeholder((*x.shape[:-1], len(self.index)), x, float("nan"))
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
def narrowed(module: nn.Module, slicing: HeadSlicing, rank: int, run: Optional[ExchangeRun] = None,
             prefix: str = "") -> Iterator[None]:
    """Inside the block ``module`` computes only its heads of ``slicing`` (see the module docstring): on the gathered
    input, or with ``run`` on the rows exchanged (its input projections, output projection and deferred stage
    shadowed as the exchange needs)."""
    with ExitStack() as stack:
        for name, child in slicing.children.items():
            stack.enter_context(narrowed(module._modules[name], child, rank, run, f"{prefix}{name}."))
        stack.enter_context(_narrowed_here(module, slicing, rank, run, prefix))
        yield


@contextmanager
def _narrowed_here(module: nn.Module, slicing: HeadSlicing, rank: int, run: Optional[ExchangeRun],
                   prefix: str) -> Iterator[None]:
    # Narrowed submodules and parameters shadow the real ones through the instance __dict__ (attribute lookup finds
    # it before nn.Module's registries), so the registries DeepSpeed walks keep the real parameters.
    owner = type(module).__name__
    deferral = slicing.deferral if run is not None else None
    shadows: dict[str, object] = {}
    for name, index in slicing.rows.items():
        if run is not None and name in slicing.inputs:
            positions = slicing.deferred.get(name)  # None: all deferred if listed, none if not
            all_deferred = name in slicing.deferred and positions is None
            fill = float("inf") if deferral is not None and name in deferral.unit_gates else float("nan")
            shadows[name] = _Exchanged(module._modules[name], index, prefix + name, run, positions, all_deferred,
                                       fill)
        else:
            shadows[name] = _Rows(module._modules[name], index, run)
    for name, index in slicing.columns.items():
        staged = deferral is not None and (deferral.norm is not None or bool(deferral.gated_functions))
        shadows[name] = (_Columns(module._modules[name], index, rank == 0) if run is None
                         else _HeldOutput(module._modules[name], index, run, f"{owner}.{name}", staged))
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
    scaled = [slicing.input_scale] if run is not None and slicing.input_scale is not None else []
    for name in scaled:
        shadows[name] = _InputScale(on_instance(module, name), run)
    if deferral is not None and deferral.norm is not None:
        shadows[deferral.norm] = _DeferredNorm(module._modules[deferral.norm], run, f"{owner}.{deferral.norm}")
    saved_attributes = {name: on_instance(module, name) for name in (*slicing.attributes, *scaled)}
    modeling = sys.modules.get(type(module).__module__)
    disabled = [name for name in slicing.disabled_functions if hasattr(modeling, name)]
    gated = {} if deferral is None else {name: keyword for name, keyword in deferral.gated_functions.items()
                                         if hasattr(modeling, name)}
    with ExitStack() as stack:
        try:
            for name, value in {**shadows, **slicing.attributes}.items():
                put_on_instance(module, name, value)
            for name in disabled:  # fused kernels of the modeling module that would run on the whole channels
                stack.enter_context(replaced(modeling, name, _returns_none, f"{modeling.__name__}.{name}"))
            for name, keyword in gated.items():  # their gate is applied after the exchange back
                function = getattr(modeling, name)
                stack.enter_context(replaced(modeling, name, _gate_dropped(function, keyword, run, f"{owner}: {name}"),
                                             f"{modeling.__name__}.{name}"))
            yield
        finally:
            for name in shadows:
                take_from_instance(module, name, None)
            for name, value in saved_attributes.items():
                put_on_instance(module, name, value)


def _returns_none(*args: Any, **kwargs: Any) -> None:
    return None
