"""The next-token halo: the token after the last position of a shard lives on another SP rank.

Next-token targets and per-token values that must line up with them (``values[:, 1:]`` on one device) need, at the
end of each contiguous run of a shard, the first value of the run that follows it in the row. :func:`next_token_sources`
plans where that value lives (computed once per batch by the collate step); :func:`next_token_values` fetches it with
one all-gather of the runs' first values; :func:`shift_labels_across_shards` builds next-token targets inside a step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.context import IGNORE_INDEX, ShardInfo
from lightning_ulysses.parallel.geometry import SequenceGeometry
from lightning_ulysses.parallel.layout import group_size


def next_token_sources(padded_len: int, geometry: SequenceGeometry, sp_rank: int) -> "HaloPlan":
    """Where the token after each contiguous run of this rank's shard lives (see :class:`HaloPlan`)."""

    def index_of(rank: int) -> torch.Tensor:  # [s] positions in the padded row that SP rank `rank` holds
        return geometry.shard_index(padded_len, rank)

    def run_starts(index: torch.Tensor) -> list[int]:  # one comparison of the whole shard, not one per token
        return [0] + (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()

    owner: dict[int, tuple[int, int]] = {}  # global start of every run -> (SP rank, run number)
    slots = 1
    for rank in range(geometry.sp_size):
        index = index_of(rank)
        starts = run_starts(index)
        slots = max(slots, len(starts))
        for run, start in enumerate(starts):
            owner[int(index[start])] = (rank, run)
    mine = index_of(sp_rank)
    starts = run_starts(mine)
    ends = [start - 1 for start in starts[1:]] + [len(mine) - 1]
    sources = [owner.get(int(mine[end]) + 1) for end in ends]  # None: the run ends the row
    # Every rank sends the same number of first tokens (zigzag shards have 1 or 2 runs): repeat the last start.
    return HaloPlan(starts + [starts[-1]] * (slots - len(starts)), ends, sources)


class HaloPlan:
    """For shifting per-token tensors by one position across shard boundaries: this rank's shard is made of
    contiguous runs of the padded row (one run, or two with the ring's zigzag layout); ``starts``/``ends`` are their
    first/last local positions (``starts`` padded to the same length on every rank, so every rank sends as many
    first tokens), and ``sources[i]`` is the ``(SP rank, run number)`` whose first token follows run ``i`` in the row
    (``None`` where run ``i`` ends the row)."""

    __slots__ = ("starts", "ends", "sources")

    def __init__(self, starts: list[int], ends: list[int], sources: list[Optional[tuple[int, int]]]) -> None:
        self.starts, self.ends, self.sources = starts, ends, sources

    def __getstate__(self):
        return self.starts, self.ends, self.sources

    def __setstate__(self, state) -> None:
        self.starts, self.ends, self.sources = state


def next_token_values(values: torch.Tensor, shard: ShardInfo, group: dist.ProcessGroup,
                      fill: Any = 0) -> torch.Tensor:
    """``[B, s, ...]`` -> ``[B, s, ...]``: at every position of this rank's shard, the value at the NEXT position of
    the full row (``fill`` after the row's last position). Values across a shard boundary come from the SP peer that
    holds them: one all-gather of ``[B, runs, ...]`` (the first value of each contiguous run) over ``group``.
    Not differentiable."""
    plan = shard.halo
    out = torch.empty_like(values)
    out[:, :-1] = values[:, 1:]  # inside a run; run ends are overwritten below
    firsts = values[:, plan.starts].contiguous()  # [B, runs, ...]
    sp = group_size(group)
    gathered = torch.empty((sp * firsts.shape[0], *firsts.shape[1:]), dtype=firsts.dtype, device=firsts.device)
    if sp > 1:
        dist.all_gather_into_tensor(gathered, firsts, group=group)  # [sp·B, runs, ...], rank-major
    else:
        gathered.copy_(firsts)
    gathered = gathered.view(sp, *firsts.shape)  # [sp, B, runs, ...]
    for end, source in zip(plan.ends, plan.sources):
        if source is None:
            out[:, end] = fill
        else:
            out[:, end] = gathered[source[0], :, source[1]]
    return out


def shift_labels_across_shards(labels: torch.Tensor, shard: ShardInfo, group: dist.ProcessGroup,
                               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[B, s]`` next-token targets of this rank's shard from the shard of ``labels`` (what Hugging Face's loss does
    with ``labels[:, 1:]`` on a whole row): targets that are padding or start another packed document are
    ``ignore_index``, as in the collate step's ``shift_labels``."""
    following = next_token_values(labels, shard, group, fill=ignore_index)
    valid = shard.target_valid.to(labels.device)  # type: ignore[union-attr]
    return torch.where(valid, following, torch.full_like(following, ignore_index))
