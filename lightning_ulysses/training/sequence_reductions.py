"""Per-sequence reductions of sequence-sharded values, for objectives that score whole sequences (DPO, reward
models, embeddings, GRPO): the same ``[B, ...]`` result on every rank of the SP group, the one a single device
computes on the full rows, with exact gradients.

Each rank holds ``[B, s, ...]`` values for its ``s`` positions of every row. A per-row reduction over the full row is
a sum over the SP group of per-rank partial sums (one all-reduce of ``[B, ...]``). Its gradient reaches this rank's
partial sum with the factor :attr:`~lightning_ulysses.training.gradient_factor.GradientFactors.sp_size` (the loss
built from it is the same on every SP rank and back-propagated with the whole-loss factor, see
:mod:`lightning_ulysses.training.gradient_factor`): the SP ranks' gradients then add up to one device's. Unlike the
token losses, which average over the tokens of the global batch (all DP × SP ranks), these reduce over the SP group
only: each data-parallel replica scores its own rows, as DDP would.

The gradient reaching every reduction is recorded for the SP peers' agreement check (like the SP losses), and each
reduction's autograd node is one the shard-local-loss check (:mod:`lightning_ulysses.training.loss_graph`) accepts as
an SP reduction. Float ``[B, s]`` weights built from a per-row statistic of the shard (``mask * (adv /
mask.sum(1))[:, None]``, this rank's count) give a result that is the same on every rank and still wrong; the
strategy's public reductions refuse them with :func:`check_row_weights`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.parallel.outputs import GatherSequence
from lightning_ulysses.training.agreement import row_weights_from_shard_message


class SequenceSum(torch.autograd.Function):
    """Forward: the all-reduced sum of ``partial`` ``[B, ...]`` over ``group``. Backward: the incoming gradient times
    ``share_factor`` to this rank's partial sum, appended to ``record`` (if given)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup, share_factor: float,  # type: ignore[override]
                record: Optional[list]) -> torch.Tensor:
        ctx.share_factor, ctx.record = share_factor, record
        total = partial.detach().clone()
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)  # [B, ...]: the full rows' sums, on every SP rank
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.record is not None:
            ctx.record.append(grad.detach())
        return grad * ctx.share_factor, None, None, None


SP_REDUCTION_NODES = (SequenceSum._backward_cls, GatherSequence._backward_cls)


def real_positions(shard: ShardInfo, device: torch.device) -> torch.Tensor:
    """``[B, s]`` bool: this rank's positions that hold a real token (not the batch's padding, not the padding to the
    SP multiple)."""
    real = (shard.global_index[None, :] < shard.seq_len).expand(shard.shard_shape).to(device)
    if shard.attention_mask is not None:
        real = real & shard.attention_mask.to(device).bool()
    return real


def check_shard_values(values: torch.Tensor, shard: Optional[ShardInfo], what: str) -> ShardInfo:
    if shard is None or shard.shard_shape is None or shard.global_index is None:
        raise RuntimeError(f"{what} is for use inside a step, on tensors of this rank's shard.")
    if values.ndim < 2 or tuple(values.shape[:2]) != tuple(shard.shard_shape):
        raise ValueError(f"{what}: values must be [B, s, ...] = {list(shard.shard_shape)} + [...] (this rank's shard"
                         f" of the step's batch), got {list(values.shape)}.")
    return shard


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` (bool: 0 elsewhere, also where a value is inf or NaN; float: a weight)."""
    mask = mask.to(values.device)
    while mask.ndim < values.ndim:
        mask = mask.unsqueeze(-1)
    if mask.dtype == torch.bool:
        return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return values * mask.to(values.dtype)


def sequence_sum(values: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup, share_factor: float,
                 record: Optional[list]) -> torch.Tensor:
    """``[B, s, ...]`` -> ``[B, ...]``: each full row's sum of ``values`` over the positions of ``mask`` ``[B, s]``.
    Values of a 16-bit float type are summed and all-reduced in float32 and rounded once, at the end, as one device's
    ``sum`` over the full row rounds them (rounding each rank's partial sum first would round twice)."""
    accumulate = torch.float32 if values.dtype in (torch.bfloat16, torch.float16) else values.dtype
    partial = _masked(values.to(accumulate), mask).sum(dim=1)  # [B, ...] this rank's positions
    return SequenceSum.apply(partial, group, share_factor, record).to(values.dtype)


def row_weight_tolerance(dtype: torch.dtype) -> float:
    """The relative difference at which two ranks' constants of a row count as different: two units in the last place
    of the weights' dtype, at least 1e-6 (a count of this rank's ``n`` tokens against a peer's ``n + 1`` differs by
    ``1 / n``: caught in float32 up to a million tokens per row and rank, in bfloat16 up to about 60)."""
    return max(1e-6, 2 * torch.finfo(dtype).eps)


def _row_constants(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, s]`` float64 weights -> each row's largest and smallest nonzero finite weight ``[B]`` on this rank
    (-inf / inf for a row with fewer than two: one weight says nothing about the row's shape), and ``[1]`` whether
    any row holds two different ones (per-token weights proper)."""
    present = (weights != 0) & torch.isfinite(weights)  # [B, s]
    high = torch.where(present, weights, float("-inf")).amax(1)  # [B]
    low = torch.where(present, weights, float("inf")).amin(1)  # [B]
    varies = ((high != low) & present.any(1)).any().to(torch.float64).view(1)  # [1]
    several = present.sum(1) >= 2  # [B]
    return torch.where(several, high, float("-inf")), torch.where(several, low, float("inf")), varies


def check_row_weights(weights: torch.Tensor, group: dist.ProcessGroup, device: torch.device, what: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` if float ``[B, s]`` weights are row-constant (every row's
    nonzero weights one value on each rank, on every rank) and a row's constant differs between the ranks beyond
    :func:`row_weight_tolerance` (exact where the values are equal): a per-row statistic of this rank's shard
    broadcast over its tokens, such as ``mask * (adv / mask.sum(1))[:, None]``. A rank with fewer than two nonzero
    weights in a row is left out of that row's comparison. Weights that vary along a row anywhere are not compared.
    Bool and integer masks, and an SP group of one rank, cost nothing; float weights one all-reduce of ``[2B + 1]``
    float64 over ``group`` and one host read."""
    if not weights.is_floating_point() or weights.ndim != 2 or group_size(group) == 1:
        return
    rows = weights.shape[0]
    high, low, varies = _row_constants(weights.detach().to(device, torch.float64))
    summary = torch.cat([high, -low, varies])  # [2B + 1] MAX over the group: each row's max, -min; any row varies
    dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=group)
    top, bottom = summary[:rows], -summary[rows:2 * rows]  # [B], [B]: the row's constants over the ranks
    differ = torch.isfinite(top) & (top - bottom > row_weight_tolerance(weights.dtype)
                                    * torch.maximum(top.abs(), bottom.abs())) & (summary[-1] == 0)  # [B]
    if bool(differ.any()):
        found = differ.nonzero().flatten().tolist()
        raise ValueError(row_weights_from_shard_message(what, found, float(bottom[found[0]]), float(top[found[0]])))


def sequence_count(mask: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B]``: each full row's number (or total weight) of positions in ``mask`` (no gradient)."""
    count = mask.detach().to(torch.float64).sum(dim=1)  # [B]
    if group_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def last_positions(mask: torch.Tensor, shard: ShardInfo, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B]``: each full row's last global position where ``mask`` holds (-1 for a row without any)."""
    index = shard.global_index.to(mask.device)[None, :].expand(mask.shape)  # [B, s] global positions
    local = torch.where(mask.bool(), index, torch.full_like(index, -1)).max(dim=1).values  # [B]
    if group_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return local


def last_token(values: torch.Tensor, mask: torch.Tensor, shard: ShardInfo, group: dist.ProcessGroup,
               share_factor: float, record: Optional[list]) -> torch.Tensor:
    """``[B, s, ...]`` -> ``[B, ...]``: each row's value at its last position in ``mask`` (the rank holding it
    contributes it, the others 0: one all-reduce of ``[B]`` positions, one of ``[B, ...]`` values)."""
    mask = mask.to(values.device).bool()
    last = last_positions(mask, shard, group)  # [B]
    if bool((last < 0).any()):
        rows = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"last_token: rows {rows} have no position in the mask (no real token), so they have no"
                         " last token. Check the batch's attention_mask, or pass the mask of the positions to pool.")
    here = (shard.global_index.to(values.device)[None, :] == last[:, None]) & mask  # [B, s]: at most one per row
    return sequence_sum(values, here, group, share_factor, record)


def gather_sequence(values: torch.Tensor, shard: ShardInfo, group: dist.ProcessGroup,
                    record: Optional[list]) -> torch.Tensor:
    """``[B, s, ...]`` -> ``[B, S, ...]`` on every SP rank, differentiable (see :class:`GatherSequence`)."""
    if group_size(group) == 1:
        return values[:, :shard.seq_len]
    return GatherSequence.apply(values, group, shard.global_index, shard.seq_len, record)
