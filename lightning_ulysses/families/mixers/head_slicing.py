"""What a sequence-mixer family's recipe builds (:mod:`lightning_ulysses.families.mixers`): a
:class:`HeadSlicing`, the description of how to narrow one module to the heads (or channels) of one SP rank (with its
:class:`Deferral`, the gate run after the exchange back), and the pieces recipes share (:func:`share`, :func:`span`,
:class:`GatedNormAcrossRanks`). Applying a recipe is
:mod:`lightning_ulysses.models.mixer_heads`; this module depends on neither, so the families and the code that runs
them import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.parallel.exchange import all_reduce_sum


@dataclass
class Deferral:
    """The part of a mixer between its per-head core and its output projection that runs on this rank's sequence
    shard, after the exchange back, with every head: a gated norm or a gate whose gate is a projection of the mixer's
    input, so the gate never travels (:mod:`lightning_ulysses.models.mixers`).

    Attributes:
        tail: ``tail(module, y, hidden)``: ``y`` ``[B, s, d]`` is what the module handed its output projection (every
            head, the module's channel order, this rank's positions), ``hidden`` ``[B, s, H]`` this rank's input
            shard; returns what the output projection gets on one device. Runs with the module's real submodules.
        norm: the submodule the module calls on its per-head output (``norm(y)`` or ``norm(y, gate)``): inside the
            module the call returns ``y`` (its gate must be a deferred placeholder), and what reaches the output
            projection must be that ``y``.
        gated_functions: functions of the module's modeling file -> the keyword of their gate (Mamba1's scan: ``z``,
            ``out · silu(z)``): called with the gate dropped (it must be a deferred placeholder); what reaches the
            output projection must be their output.
        unit_gates: deferred projections the module applies as ``sigmoid(gate) · y``: their placeholder is ``+inf``,
            so the module's own product is ``y`` exactly (checked).
    """

    tail: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    norm: Optional[str] = None
    gated_functions: dict[str, str] = field(default_factory=dict)
    unit_gates: tuple[str, ...] = ()


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
        inputs: the ``rows`` projections the module applies to its input (hidden states): under the exchange every
            rank computes them for its sequence shard and sends each rank its rows (one all-to-all per layer).
        deferred: of ``inputs``: positions within ``rows[name]`` (``None``: all) that only the :attr:`deferral`
            reads: they are not exchanged, the module sees placeholders there.
        deferral: the gate or gated norm run after the exchange back (:class:`Deferral`), or ``None``.
        input_scale: an attribute holding a number the module multiplies its input by before projecting it
            (Falcon-H1's ``ssm_in_multiplier``): the exchange projects the scaled shard, and inside the module the
            product of the placeholder and that number is the placeholder.
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
    inputs: tuple[str, ...] = ()
    deferred: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    deferral: Optional[Deferral] = None
    input_scale: Optional[str] = None


def share(count: int, rank: int, size: int) -> tuple[int, int]:
    """``(first, number)`` of ``count`` heads taken by ``rank`` of ``size``: consecutive blocks, the first
    ``count % size`` ranks one more (as attention's uneven head split)."""
    base, extra = divmod(count, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def span(start: int, count: int, width: int) -> torch.Tensor:
    """Indices of ``count`` consecutive blocks of ``width`` starting at block ``start``."""
    return torch.arange(start * width, (start + count) * width)


class GatedNormAcrossRanks(nn.Module):
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
            squares = all_reduce_sum(h.pow(2).sum(-1, keepdim=True), self.group)
            h = h * torch.rsqrt(squares / self.width + norm.variance_epsilon)
        else:
            *prefix, last = h.shape
            grouped = h.view(*prefix, last // self.width, self.width)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            h = grouped.view(*prefix, last)
        if gate is not None and gate_after:
            return (self.weight * h * F.silu(gate.to(torch.float32))).to(input_dtype)
        return self.weight * h.to(input_dtype)
