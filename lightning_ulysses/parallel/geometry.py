"""Where every token of a row lives: the one definition of the sequence geometry of an SP group.

An SP group of ``sp_size = ring_size × ulysses_size`` ranks (SP rank ``r`` is ring rank ``r // ulysses_size``,
Ulysses rank ``r % ulysses_size``: a Ulysses group is consecutive ranks) holds each row of ``S`` tokens padded to
``S_pad`` (:meth:`SequenceGeometry.padded_length`):

* ``ring_size = 1`` (Ulysses only): SP rank ``r`` holds the contiguous shard ``[r·s, (r+1)·s)``, ``s = S_pad / sp``;
* ``ring_size = R > 1`` (hybrid Ulysses × ring): the row is cut into ``2R`` chunks of ``c = S_pad / 2R``; ring rank
  ``i`` owns chunks ``i`` and ``2R-1-i`` ("zigzag", so that every ring rank has the same causal work), and its
  Ulysses group cuts those ``2c`` tokens into ``ulysses_size`` contiguous pieces.

Pure data (no process groups), so the collate step in DataLoader workers can carry it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def zigzag_positions(ring_rank: int, ring_size: int, chunk: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """``[2·chunk]`` global positions of ring rank ``ring_rank``'s tokens: chunk ``ring_rank`` then chunk
    ``2·ring_size - 1 - ring_rank``."""
    late = 2 * ring_size - 1 - ring_rank
    return torch.cat([torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk, device=device),
                      torch.arange(late * chunk, (late + 1) * chunk, device=device)])


@dataclass(frozen=True)
class SequenceGeometry:
    """How rows are cut over an SP group of ``sp_size`` ranks in ``ring_size`` ring groups (see the module)."""

    sp_size: int
    ring_size: int = 1

    @property
    def ulysses_size(self) -> int:
        """Ranks of one Ulysses group (the all-to-all around attention): ``sp_size / ring_size``."""
        return self.sp_size // self.ring_size

    def ring_and_ulysses_rank(self, sp_rank: int) -> tuple[int, int]:
        """``(ring rank, Ulysses rank)`` of SP rank ``sp_rank``."""
        return divmod(sp_rank, self.ulysses_size)

    def padded_length(self, seq_len: int) -> int:
        """``S`` padded to a multiple of ``sp_size`` (Ulysses only) or of ``2 × sp_size`` (``2·ring_size`` chunks,
        each cut evenly by ``ulysses_size``)."""
        unit = self.sp_size * (2 if self.ring_size > 1 else 1)
        return -(-seq_len // unit) * unit

    def shard_length(self, seq_len: int) -> int:
        """``s``: tokens per rank of a row of ``seq_len`` tokens (after the padding of :meth:`padded_length`)."""
        return self.padded_length(seq_len) // self.sp_size

    def contiguous_span(self, padded_len: int, sp_rank: int) -> Optional[slice]:
        """The slice of the padded row that SP rank ``sp_rank`` holds when it is one contiguous span (Ulysses only),
        else ``None`` (zigzag pieces: use :meth:`shard_index`)."""
        if self.ring_size > 1:
            return None
        s = padded_len // self.sp_size
        return slice(sp_rank * s, (sp_rank + 1) * s)

    def shard_index(self, padded_len: int, sp_rank: int) -> torch.Tensor:
        """``[s]`` global positions (indices into the padded row) that SP rank ``sp_rank`` holds."""
        s = padded_len // self.sp_size
        if self.ring_size == 1:
            return torch.arange(sp_rank * s, (sp_rank + 1) * s)
        ring_rank, ulysses_rank = self.ring_and_ulysses_rank(sp_rank)
        mine = zigzag_positions(ring_rank, self.ring_size, padded_len // (2 * self.ring_size))  # [2c]
        return mine[ulysses_rank * s:(ulysses_rank + 1) * s]

    def full_order(self, padded_len: int) -> torch.Tensor:
        """``[S_pad]``: for the concatenation of all SP ranks' shards in SP-rank order, the global position of each
        entry (to put gathered shards back in sequence order: ``full[:, order] = gathered``)."""
        return torch.cat([self.shard_index(padded_len, r) for r in range(self.sp_size)])
