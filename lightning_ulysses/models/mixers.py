"""Sequence mixers other than attention (gated delta nets, Mamba/SSM mixers, short convolutions, lightning attention)
under SP: exact by running each mixer on the whole sequence, split by heads over the SP group.

A mixer's recurrence or convolution needs every earlier token of the sequence, which a shard does not have. So, as
Ulysses attention exchanges q, k, v and its output, a mixer layer exchanges its projected channels
(:mod:`lightning_ulysses.models.mixer_heads` has the details):

1. every rank computes the mixer's input projections for its ``[B, s, H]`` shard, each rank's rows (its heads'
   channels, by the recipe of its family, :mod:`lightning_ulysses.families.mixers`), and one all-to-all turns
   them into this rank's rows over the whole sequence, ``[B, S, D/sp]`` (backward: the reverse all-to-all);
2. the mixer's **own** forward (its convolution and scan kernels: transformers' torch fallbacks on CPU, ``fla`` /
   ``mamba_ssm`` / ``causal_conv1d`` on CUDA when installed) runs narrowed to this rank's heads, on a placeholder of
   its hidden states that costs one element; its projections return the rows received, its output projection returns
   its input, ``[B, S, d/sp]``;
3. one all-to-all takes that back to the shard, ``[B, s, d]`` with every head, where the family's gate or gated norm
   (its gate a projection of the shard's own input, never exchanged) and the output projection run.

Bytes per rank and layer are then about those of an attention layer of the same width (``tests/test_mixer_bytes.py``
pins them), and nothing of size ``[B, S, H]`` exists on any rank. Families with a projection every rank needs whole
keep a small all-reduce (Mamba1's ``x_proj``). A module whose forward does not go as its family expects runs the
gather path instead, with a warning: one all-gather of the ``[B, S, H]`` input, the same narrowed forward on it, the
partial outputs summed and scattered back (one reduce-scatter). A mixer no family claims runs whole on every rank and
keeps its ``[B, s, H]`` slice of the output: exact too, but its activations and compute are not divided by ``sp``.

Packed documents (``position_ids`` restarting at 0): one exchange for the whole batch, then the mixer runs once per
document, so no recurrence or convolution crosses a document start, as separate rows on one device would.

Mixers are found by what a module *is*: it owns an ``A_log`` parameter (state-space decay: Mamba, gated delta
nets), has a depthwise ``nn.Conv1d`` child over the sequence (kernel > 1: Mamba's and the delta nets' causal
convolutions, short convolutions), or holds lightning attention's ``slope_rate`` buffer; and it contains no attention
module of its own.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.families.mixers.head_slicing import HeadSlicing
from lightning_ulysses.models.mixer_heads import ExchangeRun, MixerExchangeError, head_slicing, narrowed
from lightning_ulysses.parallel.exchange import (channel_to_sequence_shards, gather_sequence_differentiable,
                                                 reduce_scatter_sequence, sequence_to_channel_shards)
from lightning_ulysses.parallel.layout import group_rank, group_size
from lightning_ulysses.patches import held_on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training.step_context import StepContext

_ORIGINAL = "_ulysses_mixer_forward"
_HIDDEN_NAMES = ("hidden_states", "input_states", "x")
_MASK_NAMES = ("attention_mask", "mask")


def is_sequence_mixer(module: nn.Module) -> bool:
    """Whether ``module`` mixes the sequence by a recurrence or a convolution (see the module docstring)."""
    own_parameters = dict(module.named_parameters(recurse=False))
    own_buffers = dict(module.named_buffers(recurse=False))
    if "A_log" in own_parameters or "slope_rate" in own_buffers:
        return True
    return any(isinstance(child, nn.Conv1d) and child.kernel_size[0] > 1 and child.groups == child.in_channels
               for child in module.children())


def find_sequence_mixers(model: nn.Module, is_attention: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The outermost sequence mixers of ``model`` that hold no attention module (``is_attention``)."""
    found: list[nn.Module] = []
    covered: set[int] = set()
    for module in model.modules():
        if id(module) in covered or not is_sequence_mixer(module):
            continue
        if any(is_attention(m) for m in module.modules()):
            continue
        found.append(module)
        covered.update(id(m) for m in module.modules())
    return found


def uncovered_sequence_convolutions(model: nn.Module, mixers: list[nn.Module]) -> list[str]:
    """Names of convolutions over the sequence that no wrapped mixer contains (they would see only the shard)."""
    covered = {id(m) for mixer in mixers for m in mixer.modules()}
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1 and id(module) not in covered]


def wrap_sequence_mixer(module: nn.Module, context: StepContext) -> None:
    """Make ``module`` run on the whole sequence under SP (see the module docstring). Idempotent; undone by
    :func:`unwrap_sequence_mixer`."""
    if held_on_instance(module, _ORIGINAL):
        return
    original = type(module).forward
    put_on_instance(module, _ORIGINAL, original)
    if context.zero_stage_3:  # gather the submodules' weights for this module's whole forward and backward
        _register_external_parameters(module)
    plans: dict[int, _ExchangePlan] = {}  # sp -> every rank's head slicing of this mixer, built once

    def forward(*args: Any, **kwargs: Any) -> Any:
        group = context.ulysses_group
        if context.plain or context.shard_info is None or group_size(group) == 1:
            return original(module, *args, **kwargs)
        args, kwargs, hidden = _take_hidden(args, kwargs)
        for name in _MASK_NAMES:  # a padding mask of the shard: right padding needs none (the mixers are causal)
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = None
        shard = context.shard_info
        rank, sp = group_rank(group), group_size(group)
        if sp not in plans:
            plans[sp] = _ExchangePlan(module, [head_slicing(module, r, sp, group, hidden.device) for r in range(sp)])
        plan = plans[sp]
        cu_seqlens = shard.cu_seqlens if shard.packed else None

        def run(x: torch.Tensor) -> Any:
            return original(module, x, *args, **kwargs)

        if plan.exchanges:
            try:
                return _exchanged_forward(module, run, plan, hidden, rank, group, cu_seqlens)
            except MixerExchangeError as err:
                plan.exchanges = False
                warnings.warn(f"{type(module).__name__} does not run as its family's exchange expects ({err}); it"
                              " runs the gather path instead: all-gather of its [B, S, H] input, reduce-scatter of"
                              " its partial output (exact, more bytes and memory per rank).", stacklevel=2)
        return _gathered_forward(module, run, plan.slicings[rank], hidden, rank, group, cu_seqlens)

    put_on_instance(module, "forward", forward)


class _ExchangePlan:
    """Every rank's :class:`~lightning_ulysses.families.mixers.head_slicing.HeadSlicing` of one mixer at one SP size
    and what the exchange derives from them: the input projections (``sources``: qualified name -> ``nn.Linear``), the
    rows each rank receives of each (its ``rows`` less the deferred ones), and the channels of the output projection each
    rank holds. ``exchanges``: the mixer runs the exchange (else the gather path, or whole when no family claims
    it)."""

    def __init__(self, module: nn.Module, slicings: list[Optional[HeadSlicing]]) -> None:
        self.slicings = slicings
        self.exchanges = all(s is not None and len(s.columns) == 1 and s.inputs for s in slicings)
        if not self.exchanges:
            return
        self.sources: dict[str, nn.Linear] = {}
        self.rows: list[dict[str, torch.Tensor]] = [{} for _ in slicings]  # per rank: name -> rows it receives
        for r, slicing in enumerate(slicings):
            for key, owner, child in _with_children(module, slicing):  # type: ignore[arg-type]
                for name in child.inputs:
                    self.sources[key + name] = owner._modules[name]
                    index = child.rows[name]
                    if name in child.deferred:
                        positions = child.deferred[name]
                        if positions is None:
                            continue
                        keep = torch.ones(len(index), dtype=torch.bool, device=index.device)
                        keep[positions] = False
                        index = index[keep]
                    self.rows[r][key + name] = index
        self.counts = [sum(len(i) for i in rows.values()) for rows in self.rows]
        (self.output_name, _), = slicings[0].columns.items()  # type: ignore[union-attr]
        held = [s.columns[self.output_name] for s in slicings]  # type: ignore[union-attr]
        self.held_counts = [len(index) for index in held]
        channels = torch.cat(held)  # [d]: the channel order the exchange back gives
        width = module._modules[self.output_name].in_features
        if sorted(channels.tolist()) != list(range(width)):  # each channel held by exactly one rank
            self.exchanges = False
            return
        identity = torch.equal(channels, torch.arange(width, device=channels.device))
        self.order = None if identity else torch.argsort(channels)


def _with_children(module: nn.Module, slicing: HeadSlicing, prefix: str = "") -> list[tuple[str, nn.Module, Any]]:
    found = [(prefix, module, slicing)]
    for name, child in slicing.children.items():
        found += _with_children(module._modules[name], child, f"{prefix}{name}.")
    return found


def _exchanged_forward(module: nn.Module, run: Callable[[torch.Tensor], Any], plan: _ExchangePlan,
                       hidden: torch.Tensor, rank: int, group: Any, cu_seqlens: Optional[torch.Tensor]) -> Any:
    """The mixer by the exchange of its projected channels (the module docstring's steps 1-3)."""
    B, s, H = hidden.shape
    sp = len(plan.slicings)
    slicing = plan.slicings[rank]
    if slicing.input_scale is not None:  # the module scales its input before projecting it (Falcon-H1)
        hidden = hidden * getattr(module, slicing.input_scale)  # type: ignore[union-attr]
    received = sequence_to_channel_shards(_rows_to_send(plan, hidden), plan.counts, group)  # [B, S, n]: my rows
    sizes = {key: len(index) for key, index in plan.rows[rank].items()}
    pieces = received.split(list(sizes.values()), dim=-1)  # per projection [B, S, n_p]; contiguous as on one device
    state = ExchangeRun({key: piece.contiguous() for key, piece in zip(sizes, pieces)})
    S = s * sp
    with narrowed(module, slicing, rank, state):  # type: ignore[arg-type]
        if cu_seqlens is None:
            output = run(state.placeholder((B, S, H), hidden))
            held = _held(output, state)  # [B, S, d/sp]
        else:  # one run per packed document, each on its part of the rows received
            bounds = cu_seqlens.tolist()
            outputs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                output = run(state.placeholder((1, b - a, H), hidden, (a, b)))
                outputs.append(_held(output, state))
            held = torch.cat(outputs, dim=1).reshape(B, S, -1)  # [B, S, d/sp]
    back = channel_to_sequence_shards(held, plan.held_counts, group)  # [B, s, d]: every rank's heads, rank order
    if plan.order is not None:
        back = back.index_select(-1, plan.order)  # the output projection's channel order
    back = back.contiguous()  # row-major as on one device: the same kernels, the same rounding
    deferral = slicing.deferral  # type: ignore[union-attr]
    projected = deferral.tail(module, back, hidden) if deferral is not None else back
    out = module._modules[plan.output_name]
    result = F.linear(projected, out.weight, out.bias)  # [B, s, H]
    return (result, *output[1:]) if isinstance(output, tuple) else result


def _rows_to_send(plan: _ExchangePlan, hidden: torch.Tensor) -> torch.Tensor:
    """``[B, s, C]``: every destination rank's rows of this shard's input projections, in rank order. Each projection
    runs whole, as the module runs it on one device (so its rows are bitwise the same), and its rows are picked
    from it."""
    projected = {key: F.linear(hidden, linear.weight, linear.bias) for key, linear in plan.sources.items()}  # [B, s, D]
    return torch.cat([projected[key].index_select(-1, index) for rows in plan.rows for key, index in rows.items()],
                     dim=-1)


def _held(output: Any, state: ExchangeRun) -> torch.Tensor:
    """The module's output must be exactly what its output projection's shadow returned."""
    first = output[0] if isinstance(output, tuple) and output else output
    if state.held is None or first is not state.held:
        raise MixerExchangeError("the module's output is not its output projection's output (it computed something"
                                 " after it)")
    held, state.held, state.held_value = state.held_value, None, None
    return held  # type: ignore[return-value]


def _gathered_forward(module: nn.Module, run: Callable[[torch.Tensor], Any], slicing: Optional[HeadSlicing],
                      hidden: torch.Tensor, rank: int, group: Any, cu_seqlens: Optional[torch.Tensor]) -> Any:
    """The gather path: the whole ``[B, S, H]`` input on every rank; narrowed to this rank's heads with the partial
    outputs summed over the group, or (no family) the whole mixer and this rank's slice of its output."""
    full = gather_sequence_differentiable(hidden, group)  # [B, s, H] -> [B, S, H] (backward: reduce-scatter)
    s = hidden.shape[1]
    if slicing is not None:  # this rank's heads over the whole sequence; partial outputs summed over the group
        with narrowed(module, slicing, rank):
            partial = _per_document(run, full, cu_seqlens) if cu_seqlens is not None else run(full)  # [B, S, H]
        if isinstance(partial, tuple):
            return (reduce_scatter_sequence(partial[0], group), *partial[1:])
        return reduce_scatter_sequence(partial, group)  # [B, S, H] partial sums -> [B, s, H] (backward: all-gather)
    output = _per_document(run, full, cu_seqlens) if cu_seqlens is not None else run(full)
    return _own_slice(output, full.shape[:2], slice(rank * s, (rank + 1) * s))


def unwrap_sequence_mixer(module: nn.Module) -> None:
    if take_from_instance(module, _ORIGINAL, None) is not None:
        take_from_instance(module, "forward", None)
        for parameter in take_from_instance(module, _EXTERNAL, []):
            from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

            unregister_external_parameter(module, parameter)


_EXTERNAL = "_ulysses_external_parameters"


def _register_external_parameters(module: nn.Module) -> None:
    """Under ZeRO-3 DeepSpeed gathers a submodule's weights only while that submodule runs; registered as external
    parameters of the mixer they are gathered for the mixer's whole forward and backward, so the head-parallel
    recipes can slice them there (DeepSpeed's documented way for weights used outside their module)."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    own = {id(p) for p in module.parameters(recurse=False)}
    registered = [p for p in module.parameters() if id(p) not in own]
    for parameter in registered:
        register_external_parameter(module, parameter)
    put_on_instance(module, _EXTERNAL, registered)


def _take_hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor]:
    if args and isinstance(args[0], torch.Tensor):
        return args[1:], dict(kwargs), args[0]
    kwargs = dict(kwargs)
    for name in _HIDDEN_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return args, kwargs, kwargs.pop(name)
    raise TypeError("A sequence mixer was called without its hidden states as the first argument.")


def _per_document(run: Callable[[torch.Tensor], Any], full: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Any:
    """``run`` on every packed document of ``full`` ``[B, S, H]`` separately (offsets in the flattened ``[B·S]``);
    the outputs (tensor, or tuple whose first item is the tensor) put back together as ``[B, S, ...]``."""
    B, S = full.shape[:2]
    flat = full.reshape(1, B * S, *full.shape[2:])  # [1, B·S, H]
    bounds = cu_seqlens.tolist()  # type: ignore[union-attr]
    outputs = [run(flat[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    first = [o[0] if isinstance(o, tuple) else o for o in outputs]
    joined = torch.cat(first, dim=1).reshape(B, S, *first[0].shape[2:])  # [B, S, ...]
    return (joined, *outputs[-1][1:]) if isinstance(outputs[-1], tuple) else joined


def _own_slice(output: Any, full_shape: torch.Size, own: slice) -> Any:
    """This rank's positions of the mixer's output (a tensor, or a tuple whose first item is)."""
    if isinstance(output, torch.Tensor) and tuple(output.shape[:2]) == tuple(full_shape):
        return output[:, own]
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (_own_slice(output[0], full_shape, own), *output[1:])
    raise TypeError(f"A sequence mixer returned {type(output).__name__}, not its [B, S, ...] output.")
