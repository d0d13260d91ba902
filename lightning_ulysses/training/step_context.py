"""What the prepared models' attention and loss read during a step (:class:`StepContext`), in three parts with one
writer each:

- :class:`RunFacts` (frozen): the groups, the ring size, the gradient factors, the ZeRO-3 flag: fixed once the
  DeepSpeed config is final. Completed by the step runner (:meth:`StepRunner.complete_run_facts`).
- :class:`StepFacts` (frozen): the running step's shard facts and mode. The step runner
  (:mod:`lightning_ulysses.training.step_runner`) replaces the object per step; code that runs a model with other
  facts for a while (the model-form check's probe, generation's plain mode) passes its own whole object to
  :meth:`StepContext.facts_for`, which gives the previous one back after the block.
- :class:`StepRecord`: what a forward pass produces for the rest of the step (per-token statistics, the router's token
  mask, the gradients that reach the SP losses, the padding verdict, the call depth), written through its methods.

Every field reads as an attribute of the context (``context.shard_info``, ``context.sp_group``, ...); none can be
assigned there.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.parallel.geometry import SequenceGeometry
from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.training.gradient_factor import GradientFactors

_NO_TENSORS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RunFacts:
    """Fixed for a stage.

    Attributes:
        sp_group: ranks that hold the shards of the same sequences. (A step's loss covers the global batch: its
            sums run over every rank, DP × SP, the default group.)
        ulysses_group: the ranks of the all-to-all around attention (the SP group when ``ring_size = 1``).
        ring_group: the ranks that exchange keys/values across ring groups (this rank alone when ``ring_size = 1``).
        ring_size: ring groups per SP group; 1: Ulysses only.
        gradients: the run's gradient factors (:class:`~lightning_ulysses.training.gradient_factor.GradientFactors`).
        sdpa_per_document: with ``sdpa``, attend within each packed document by one SDPA call per document.
        zero_stage_3: ZeRO-3 partitions the parameters: sequence mixers register their submodules' weights as
            external parameters (:mod:`lightning_ulysses.models.mixers`).
        geometry: the layout's token placement over the SP group (``None``: derived from the SP group's size and
            ``ring_size``, for contexts made without a layout).
        attention_chunk: positions per chunk of the offloaded attention (``offload_attention``; ``None``: off).
    """

    sp_group: Optional[dist.ProcessGroup]
    ulysses_group: Optional[dist.ProcessGroup]
    ring_group: Optional[dist.ProcessGroup]
    ring_size: int = 1
    gradients: GradientFactors = field(default_factory=GradientFactors)
    sdpa_per_document: bool = False
    zero_stage_3: bool = False
    geometry: Optional[SequenceGeometry] = None
    attention_chunk: Optional[int] = None


@dataclass(frozen=True)
class StepFacts:
    """The running step's facts (replaced as a whole, never changed).

    Attributes:
        shard_info: the current batch's :class:`ShardInfo`.
        tile_shard_len: the step's longest shard over all ranks, set when tile counts follow the shard length
            (``tiled_mlp``/``tiled_loss="auto"``) under ZeRO-3 with several replicas: every rank then runs the same
            number of tiles, so ZeRO-3 issues the same parameter gathers everywhere. ``None``: the local length.
        in_step: a training/validation/test/predict step (or :meth:`evaluate_full_batch`) is running, so model calls
            get the step's shard facts.
        plain: the prepared models run as plain, unsharded models (generation): no exchange, no call completion.
        step_batch_tensors: the step batch's own ``position_ids`` / ``attention_mask`` / ``shift_labels`` /
            ``labels`` tensors (read-only mapping).
    """

    shard_info: Optional[ShardInfo] = None
    tile_shard_len: Optional[int] = None
    in_step: bool = False
    plain: bool = False
    step_batch_tensors: Mapping[str, Any] = field(default_factory=lambda: _NO_TENSORS)


class StepRecord:
    """What the forward passes of a step produce for the rest of it; written through the methods only.

    Attributes (read):
        token_stats: per-token ``(loss, argmax_correct)`` of this rank's shard, ``[B, s]`` each, recorded by the loss
            of the last forward pass run without gradients (evaluation); ``None`` otherwise.
        incoming_gradients: the list the SP losses of the current backward pass record the gradients that reach them
            into (one per loss call), compared between SP peers before the optimizer step.
        router_token_mask: ``[B, s]`` bool, the tokens of the last model call that count for the MoE router loss.
        batch_padding: ``(shard, padded on any SP rank)``: the encoder check's per-step verdict.
        inside_prepared_model: how many prepared models' forwards are running (a backbone called from inside its
            model's forward is not completed again).
    """

    def __init__(self, incoming_gradients: Optional[list] = None) -> None:
        self.token_stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.incoming_gradients: Optional[list] = incoming_gradients
        self.router_token_mask: Optional[torch.Tensor] = None
        self.batch_padding: Optional[tuple] = None
        self.inside_prepared_model = 0
        self._device_positions: dict = {}

    def record_token_stats(self, stats: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.token_stats = stats

    def record_router_token_mask(self, mask: torch.Tensor) -> None:
        self.router_token_mask = mask

    def record_batch_padding(self, shard: ShardInfo, padded: bool) -> None:
        self.batch_padding = (shard, padded)

    def enter_prepared_model(self) -> None:
        self.inside_prepared_model += 1

    def leave_prepared_model(self) -> None:
        self.inside_prepared_model -= 1

    def new_gradient_list(self) -> list:
        """Start a new list of incoming gradients (per backward pass); the previous one is returned to the caller
        that checks it."""
        previous, self.incoming_gradients = self.incoming_gradients, []
        return previous if previous is not None else []

    def begin_batch(self, train: bool) -> None:
        """A new batch: no call in progress (a call that raised may have left one counted), no statistics yet."""
        self.inside_prepared_model = 0
        self.token_stats = None
        if train:
            self.incoming_gradients = []

    def device_positions(self, shard: ShardInfo, device: torch.device) -> torch.Tensor:
        """``[B, s]``: the shard's global positions on ``device``, copied once per shard and device."""
        key = (id(shard), str(device))
        cached = self._device_positions.get(key)
        if cached is None or cached[0] is not shard:  # the shard is held, so its id is not reused while cached
            self._device_positions.clear()
            cached = self._device_positions[key] = (shard, shard.position_ids.to(device))  # type: ignore[union-attr]
        return cached[1]


class StepContext:
    """Shared by the attention functions and the loss of the prepared models (see the module docstring).

    Keyword arguments are the fields of :class:`RunFacts` and :class:`StepFacts` (and ``incoming_gradients``).
    """

    def __init__(self, sp_group: Optional[dist.ProcessGroup], ulysses_group: Optional[dist.ProcessGroup],
                 ring_group: Optional[dist.ProcessGroup], ring_size: int = 1,
                 gradients: Optional[GradientFactors] = None, sdpa_per_document: bool = False,
                 zero_stage_3: bool = False, incoming_gradients: Optional[list] = None,
                 geometry: Optional[SequenceGeometry] = None, attention_chunk: Optional[int] = None,
                 **step_facts: Any) -> None:
        self._run = RunFacts(sp_group, ulysses_group, ring_group, ring_size, gradients or GradientFactors(),
                             sdpa_per_document, zero_stage_3, geometry, attention_chunk)
        if "step_batch_tensors" in step_facts:
            step_facts["step_batch_tensors"] = MappingProxyType(dict(step_facts["step_batch_tensors"]))
        self._facts = StepFacts(**step_facts)
        self.record = StepRecord(incoming_gradients)

    # ------------------------------------------------------------------------------------------ writers
    def set_run_facts(self, run: RunFacts) -> None:
        """The stage's facts (the step runner, once the DeepSpeed config is final)."""
        self._run = run

    def set_step_facts(self, facts: StepFacts) -> None:
        """The running step's facts (the step runner, per step)."""
        self._facts = facts

    @contextmanager
    def facts_for(self, facts: StepFacts) -> Iterator[None]:
        """Run the block with ``facts`` (a whole object of the caller's), then the previous facts again."""
        previous, self._facts = self._facts, facts
        try:
            yield
        finally:
            self._facts = previous

    @contextmanager
    def plain_calls(self) -> Iterator[None]:
        """The prepared models run as plain, unsharded models inside the block (generation)."""
        with self.facts_for(replace(self._facts, plain=True)):
            yield

    # ------------------------------------------------------------------------------------------ readers
    @property
    def run(self) -> RunFacts:
        return self._run

    @property
    def facts(self) -> StepFacts:
        return self._facts

    sp_group = property(lambda self: self._run.sp_group)
    ulysses_group = property(lambda self: self._run.ulysses_group)
    ring_group = property(lambda self: self._run.ring_group)
    ring_size = property(lambda self: self._run.ring_size)
    gradients = property(lambda self: self._run.gradients)
    sdpa_per_document = property(lambda self: self._run.sdpa_per_document)
    attention_chunk = property(lambda self: self._run.attention_chunk)
    zero_stage_3 = property(lambda self: self._run.zero_stage_3)

    @property
    def geometry(self) -> SequenceGeometry:
        """Where the SP group's ranks hold the tokens (the layout's own object when the strategy made the context)."""
        if self._run.geometry is not None:
            return self._run.geometry
        return SequenceGeometry(group_size(self._run.sp_group), self._run.ring_size)
    shard_info = property(lambda self: self._facts.shard_info)
    tile_shard_len = property(lambda self: self._facts.tile_shard_len)
    in_step = property(lambda self: self._facts.in_step)
    plain = property(lambda self: self._facts.plain)
    step_batch_tensors = property(lambda self: self._facts.step_batch_tensors)
    token_stats = property(lambda self: self.record.token_stats)
    incoming_gradients = property(lambda self: self.record.incoming_gradients)
    router_token_mask = property(lambda self: self.record.router_token_mask)
    batch_padding = property(lambda self: self.record.batch_padding)
    inside_prepared_model = property(lambda self: self.record.inside_prepared_model)
