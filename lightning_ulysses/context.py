"""What the collate step knows about a batch and the attention and loss need during its step.

The collate step attaches a :class:`ShardInfo` to each batch under the key ``"_ulysses"``; the strategy's loader takes
it out as the batch leaves the DataLoader (before any Lightning or user hook sees the batch) and queues it, and the
step of that batch moves it into the :class:`StepContext` that the prepared models' attention and loss read.
Nothing of it reaches the user's hooks or ``model(**batch)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

SHARD_INFO_KEY = "_ulysses"


class ShardInfo:
    """Facts about the full batch a shard was cut from (a plain object: Lightning neither moves nor sizes it).

    Attributes:
        seq_len: length ``S`` of the full batch before padding to a multiple of sp.
        cu_seqlens: ``[num_segments + 1]`` int32 offsets of the documents in the flattened, padded ``[B × S_pad]``
            batch, or ``None`` when no row is packed (each row is one causal sequence).
        max_seqlen: length of the longest document (``None`` when not packed).
        window_tokens: this rank's count of target tokens over the whole gradient-accumulation window the batch
            belongs to (set by the train loader when accumulating), else ``None``.
        batch_size: rows ``B`` of the full batch.
        fingerprint: digest of the full batch (:func:`lightning_ulysses.agreement.batch_fingerprint`), compared
            between SP peers before the step; ``None`` when the check is off.
    """

    __slots__ = ("seq_len", "cu_seqlens", "max_seqlen", "window_tokens", "batch_size", "fingerprint")

    def __init__(self, seq_len: int, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                 window_tokens: Optional[torch.Tensor] = None, batch_size: int = 1,
                 fingerprint: Optional[int] = None) -> None:
        self.seq_len = seq_len
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = max_seqlen
        self.window_tokens = window_tokens
        self.batch_size = batch_size
        self.fingerprint = fingerprint

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def __getstate__(self):  # DataLoader workers pickle it
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


@dataclass
class StepContext:
    """Shared by the attention functions and the loss of the prepared models; the strategy updates it per step.

    Attributes:
        sp_group: ranks that hold the shards of the same sequences.
        ulysses_group: the ranks of the all-to-all around attention (the SP group unless ``ring_group`` is set).
        ring_group: with hybrid Ulysses × ring SP, the ranks that exchange keys/values across ring groups.
        loss_group: ranks whose tokens make up one optimizer step's batch (every rank: DP × SP).
        grad_scale: factor on the local loss share that makes DeepSpeed's gradient reduction exact (see loss.py).
        accumulation: gradient-accumulation steps DeepSpeed divides the loss by.
        sdpa_per_document: with ``sdpa``, attend within each packed document by one SDPA call per document.
        shard: the current batch's :class:`ShardInfo`.
        token_stats: per-token ``(loss, argmax_correct)`` of this rank's shard, ``[B, s]`` each (loss 0 and correct
            False where there is no target), recorded by the loss of the last forward pass run without gradients
            (evaluation); ``None`` otherwise.
        tile_shard_len: the step's longest shard over all ranks, set when tile counts follow the shard length
            (``tiled_mlp``/``tiled_loss="auto"``) under ZeRO-3 with several replicas: every rank then runs the same
            number of tiles, so ZeRO-3 issues the same parameter gathers everywhere. ``None``: the local length.
    """

    sp_group: dist.ProcessGroup
    loss_group: Optional[dist.ProcessGroup]
    grad_scale: float = 1.0
    accumulation: int = 1
    sdpa_per_document: bool = False
    shard: Optional[ShardInfo] = None
    tile_shard_len: Optional[int] = None
    token_stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    ulysses_group: Optional[dist.ProcessGroup] = None
    ring_group: Optional[dist.ProcessGroup] = None

    @property
    def exchange_group(self) -> dist.ProcessGroup:
        """The group of the Ulysses all-to-all."""
        return self.ulysses_group if self.ulysses_group is not None else self.sp_group
