"""Per-token outputs of a sequence shard, gathered back to the full sequence on every rank of the SP group."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_ulysses.parallel.layout import group_rank, group_size


class GatherSequence(torch.autograd.Function):
    """Forward: ``[B, s, ...]`` shards of the SP group -> ``[B, S, ...]`` in sequence order (the padding to the SP
    multiple removed). Backward: the exact adjoint, a reduce-scatter (sum) of the ``[B, S, ...]`` gradients back to
    each rank's positions, appended to ``record`` (if given)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup,  # type: ignore[override]
                global_index: torch.Tensor, seq_len: int, record: Optional[list]) -> torch.Tensor:
        sp = group_size(group)
        ctx.group, ctx.global_index, ctx.seq_len, ctx.record, ctx.sp = group, global_index, seq_len, record, sp
        shard = shard.detach().contiguous()
        B, s = shard.shape[:2]
        pieces = torch.empty((sp * B, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(pieces, shard, group=group)  # [sp·B, s, ...], rank-major
        indices = torch.empty(sp * s, dtype=torch.long, device=shard.device)
        dist.all_gather_into_tensor(indices, global_index.to(shard.device), group=group)  # [sp·s] global positions
        ctx.indices = indices
        rows = pieces.view(sp, B, *shard.shape[1:]).transpose(0, 1).reshape(B, sp * s, *shard.shape[2:])
        full = torch.empty_like(rows)  # [B, S_pad, ...]
        full[:, indices] = rows  # each entry at its global position
        return full[:, :seq_len].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.record is not None:
            ctx.record.append(grad.detach())
        sp, indices = ctx.sp, ctx.indices
        B = grad.shape[0]
        padded = grad.new_zeros((B, indices.numel(), *grad.shape[2:]))  # [B, S_pad, ...]
        padded[:, :ctx.seq_len] = grad
        rows = padded[:, indices]  # [B, sp·s, ...] rank-major
        s = indices.numel() // sp
        stacked = rows.view(B, sp, s, *grad.shape[2:]).transpose(0, 1).contiguous()  # [sp, B, s, ...]
        mine = grad.new_empty((B, s, *grad.shape[2:]))
        dist.reduce_scatter_tensor(mine, stacked.view(sp * B, s, *grad.shape[2:]), group=ctx.group)  # [B, s, ...]
        return mine, None, None, None, None


def gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup, seq_len: int,
                    order: "torch.Tensor | None" = None) -> torch.Tensor:
    """``[B, s, ...]`` shards of the SP group -> ``[B, seq_len, ...]`` (the padding to a multiple of sp removed).
    ``order``: for shards that are not contiguous slices (ring layout), the global position of every entry of the
    rank-major concatenation (:meth:`lightning_ulysses.parallel.geometry.SequenceGeometry.full_order`).

    Differentiable when ``shard`` requires gradients (backward: a reduce-scatter of the ``[B, seq_len, ...]``
    gradients to each rank's positions). Inside a step, ``strategy.gather_sequence(values)`` fills in the group, the
    length and the order, and records the gradient for the SP peers' loss check."""
    if shard.requires_grad and torch.is_grad_enabled():
        rank, s = group_rank(group), shard.shape[1]
        mine = (order.to(shard.device)[rank * s:(rank + 1) * s] if order is not None
                else torch.arange(rank * s, (rank + 1) * s, device=shard.device))
        return GatherSequence.apply(shard, group, mine, seq_len, None)
    sp = group_size(group)
    shard = shard.contiguous()
    pieces = torch.empty((sp * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(pieces, shard, group=group)  # [sp*B, s, ...], rank-major
    full = pieces.view(sp, *shard.shape).transpose(0, 1).reshape(shard.shape[0], sp * shard.shape[1], *shard.shape[2:])  # [B, S_pad, ...]
    if order is not None:  # put each entry at its global position
        placed = torch.empty_like(full)
        placed[:, order.to(full.device)] = full
        full = placed
    return full[:, :seq_len]


def gather_sequence_outputs(output: Any, local_shape: tuple[int, int], seq_len: int, group: dist.ProcessGroup,
                            order: "torch.Tensor | None" = None) -> Any:
    """Gather every tensor of ``output`` whose leading dims are this rank's ``(B, s)``; leave the rest as is."""

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim >= 2 and tuple(tensor.shape[:2]) == local_shape:
            return gather_sequence(tensor, group, seq_len, order)
        return tensor

    return apply_to_collection(output, torch.Tensor, gather)
