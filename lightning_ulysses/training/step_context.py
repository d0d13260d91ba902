"""What the prepared models' attention and loss read during a step (:class:`StepContext`); the step runner
(:mod:`lightning_ulysses.training.step_runner`) is the one writer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.training.gradient_factor import GradientFactors


@dataclass
class StepContext:
    """Shared by the attention functions and the loss of the prepared models; the strategy updates it per step.

    Attributes:
        sp_group: ranks that hold the shards of the same sequences. (A step's loss covers the global batch: its
            sums run over every rank, DP × SP, the default group.)
        ulysses_group: the ranks of the all-to-all around attention (the SP group when ``ring_size = 1``).
        ring_group: the ranks that exchange keys/values across ring groups (this rank alone when ``ring_size = 1``).
        ring_size: ring groups per SP group; 1: Ulysses only.
        gradients: the run's gradient factors (:class:`~lightning_ulysses.training.gradient_factor.GradientFactors`: the
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
        device_positions: the current shard's positions on the model's device, ``{(id(shard), device): (shard, [B,
        s])}``. zero_stage_3: ZeRO-3 partitions the parameters: sequence mixers register their submodules' weights as
            external parameters (:mod:`lightning_ulysses.models.mixers`).
        inside_prepared_model: how many prepared models' forwards are running (a backbone called from inside its
            model's forward is not completed again).
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
    inside_prepared_model: int = 0
    batch_padding: Optional[tuple] = None  # (shard, padded on any SP rank): the encoder check's per-step verdict
