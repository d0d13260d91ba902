"""Per-token outputs of a sequence shard, gathered back to the full sequence on every rank of the SP group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection


def gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup, seq_len: int,
                    order: "torch.Tensor | None" = None) -> torch.Tensor:
    """``[B, s, ...]`` shards of the SP group -> ``[B, seq_len, ...]`` (the padding to a multiple of sp removed).
    ``order``: for shards that are not contiguous slices (ring layout), the global position of every entry of the
    rank-major concatenation (:meth:`lightning_ulysses.parallel.geometry.SequenceGeometry.full_order`)."""
    sp = dist.get_world_size(group)
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
