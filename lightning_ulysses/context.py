"""What the collate step knows about a batch and the attention and loss need during its step.

The collate step attaches a :class:`ShardInfo` to each batch under the key ``"_ulysses"``; the strategy's loader takes
it out as the batch leaves the DataLoader (before any Lightning or user hook sees the batch) and queues it, and the
step of that batch moves it into the :class:`StepContext` that the prepared models' attention and loss read.
Nothing of it reaches the user's hooks or ``model(**batch)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from lightning_ulysses.gradient_factor import GradientFactors

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
        position_ids: ``[B, s]`` global positions of this rank's shard (what a model call without ``position_ids``
            gets).
        attention_mask: ``[B, s]`` this rank's shard of the batch's padding mask (checked: right padding), or
            ``None`` when the batch had none.
        target_valid: ``[B, s]`` bool: whether the token after each position is a target of it (not padding, not the
            start of another packed document, not past the end of the row); shifting labels inside a step uses it.
        global_index: ``[s]`` positions in the padded row that this rank holds (contiguous, or zigzag with ring).
        padded_len: the row length after padding to the SP layout's multiple.
        halo: where the token after each run of this shard lives (:class:`lightning_ulysses.data.HaloPlan`).
        max_position: the largest ``position_ids`` value of the full batch (before the padding to the SP multiple):
            what a single device's length-dependent RoPE sees (:mod:`lightning_ulysses.rope`).
    """

    __slots__ = ("seq_len", "cu_seqlens", "max_seqlen", "window_tokens", "batch_size", "fingerprint",
                 "position_ids", "attention_mask", "target_valid", "global_index", "padded_len", "halo",
                 "max_position")

    def __init__(self, seq_len: int, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                 window_tokens: Optional[torch.Tensor] = None, batch_size: int = 1,
                 fingerprint: Optional[int] = None) -> None:
        self.seq_len = seq_len
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = max_seqlen
        self.window_tokens = window_tokens
        self.batch_size = batch_size
        self.fingerprint = fingerprint
        self.position_ids: Optional[torch.Tensor] = None
        self.attention_mask: Optional[torch.Tensor] = None
        self.target_valid: Optional[torch.Tensor] = None
        self.global_index: Optional[torch.Tensor] = None
        self.padded_len = seq_len
        self.halo = None
        self.max_position: Optional[int] = None

    @property
    def shard_shape(self) -> Optional[tuple[int, int]]:
        """``(B, s)`` of this rank's shard (``None`` if unknown)."""
        return None if self.position_ids is None else (int(self.position_ids.shape[0]), int(self.position_ids.shape[1]))

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
        sp_group: ranks that hold the shards of the same sequences. (A step's loss covers the global batch: its
            sums run over every rank, DP × SP, the default group.)
        ulysses_group: the ranks of the all-to-all around attention (the SP group when ``ring_size = 1``).
        ring_group: the ranks that exchange keys/values across ring groups (this rank alone when ``ring_size = 1``).
        ring_size: ring groups per SP group; 1: Ulysses only.
        gradients: the run's gradient factors (:class:`~lightning_ulysses.gradient_factor.GradientFactors`: the
            factor on an SP loss's local share and on the whole loss, the accumulation count).
        sdpa_per_document: with ``sdpa``, attend within each packed document by one SDPA call per document.
        shard_info: the current batch's :class:`ShardInfo`.
        token_stats: per-token ``(loss, argmax_correct)`` of this rank's shard, ``[B, s]`` each (loss 0 and correct
            False where there is no target), recorded by the loss of the last forward pass run without gradients
            (evaluation); ``None`` otherwise.
        tile_shard_len: the step's longest shard over all ranks, set when tile counts follow the shard length
            (``tiled_mlp``/``tiled_loss="auto"``) under ZeRO-3 with several replicas: every rank then runs the same
            number of tiles, so ZeRO-3 issues the same parameter gathers everywhere. ``None``: the local length.
        incoming_gradients: the gradients that reached the SP losses of the current backward pass (one per loss
            call), compared between SP peers before the optimizer step.
        in_step: a training/validation/test/predict step (or :meth:`evaluate_full_batch`) is running, so model calls
            get the step's shard facts.
        plain: the prepared models run as plain, unsharded models (generation): no exchange, no call completion.
        step_batch_tensors: the step batch's own ``position_ids`` / ``attention_mask`` tensors (a model call given
            exactly these needs no check).
        device_positions: the current shard's positions on the model's device, ``{(id(shard), device): (shard, [B, s])}``.
        zero_stage_3: ZeRO-3 partitions the parameters: sequence mixers register their submodules' weights as
            external parameters (:mod:`lightning_ulysses.mixers`).
        router_token_mask: ``[B, s]`` bool, the tokens of the last model call that count for the MoE router loss
            (not the padding to the SP multiple; not the batch's padding when the call was given its mask).
    """

    sp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    ring_size: int = 1
    gradients: GradientFactors = field(default_factory=GradientFactors)
    sdpa_per_document: bool = False
    shard_info: Optional[ShardInfo] = None
    tile_shard_len: Optional[int] = None
    token_stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    incoming_gradients: Optional[list] = None
    in_step: bool = False
    plain: bool = False
    step_batch_tensors: dict = field(default_factory=dict)
    device_positions: dict = field(default_factory=dict)
    router_token_mask: Optional[torch.Tensor] = None
    zero_stage_3: bool = False
