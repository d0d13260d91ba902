"""One object runs every step: :class:`StepRunner` holds the per-step state (the step context the prepared models
read, the queues of shard facts the loaders fill, the step batch's ``shift_labels``, the SP-peer agreement check,
the accumulation window, the gradient factors) and is the only code that reads or writes it.

The strategy's Lightning hooks call its small surface: :meth:`StepRunner.step` around every
training/validation/test/predict step, :meth:`StepRunner.backward` around the training step's backward pass,
:meth:`StepRunner.follow_accumulation` before a training step, :meth:`StepRunner.gather_prediction` after a predict
step; the strategy's public step API (``strategy.cross_entropy``, ``token_mean``, ...) is the rest of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_ulysses.context import SHARD_INFO_KEY, ShardInfo
from lightning_ulysses.data import halo
from lightning_ulysses.data.loaders import ShardInfoQueue
from lightning_ulysses.parallel.layout import SequenceParallelLayout
from lightning_ulysses.parallel.outputs import gather_sequence_outputs
from lightning_ulysses.training.agreement import SPAgreement, sample_weights_from_shard_message
from lightning_ulysses.training.loss import (
    broadcast_token_weights,
    scale_gradient,
    step_cross_entropy,
    step_token_mean,
    zero3_parameters_outside_forward_error,
)
from lightning_ulysses.training import loss_graph
from lightning_ulysses.training import sequence_reductions as reductions
from lightning_ulysses.training.gradient_factor import GradientFactors
from lightning_ulysses.training.step_context import StepContext

if TYPE_CHECKING:  # the models layer sits above this one: only its type is named here
    from lightning_ulysses.models.preparation import PreparedModels

STEP_KINDS = ("train", "validate", "test", "predict")


def manual_backward_error() -> str:
    return (
        "With manual optimization, `optimizer.step()` was called with no backward pass through the strategy since"
        " the last step: `training_step` called `loss.backward()` itself. Under DeepSpeed (and sequence parallelism)"
        " the backward pass must go through the strategy: DeepSpeed reduces the ZeRO gradient partitions there, and"
        " the strategy applies the gradient factor and checks the loss. No weight was changed. Write"
        " `self.manual_backward(loss)` instead of `loss.backward()`."
    )


class StepRunner:
    """Runs the strategy's part of every step (see the module docstring).

    Args:
        layout: the DP×SP layout (groups, ranks, geometry).
        context: the step context the prepared models' attention and loss read.
        models: the prepared models (hooks check, packed-document support, the model-form check).
        agreement: the SP-peer agreement check, or ``None`` when it is off.
        device: the device of this rank's collectives.
        agree_on_tile_counts: tile counts follow the shard length under ZeRO-3 with several replicas, so every rank
            must run the step's longest shard's count (:meth:`_agreed_tile_shard_len`).
        gather_predictions: gather per-token ``predict_step`` outputs to the full sequence.
        check_model_form: run the model-form check before the first step of every stage.
    """

    def __init__(self, layout: SequenceParallelLayout, context: StepContext, models: "PreparedModels",
                 agreement: Optional[SPAgreement], device: torch.device, agree_on_tile_counts: bool,
                 gather_predictions: bool, check_model_form: bool) -> None:
        self.layout = layout
        self.context = context
        self.models = models
        self.agreement = agreement
        self.device = device
        self.agree_on_tile_counts = agree_on_tile_counts
        self.gather_predictions = gather_predictions
        self.check_model_form = check_model_form and layout.sp_size > 1
        self.queues = {kind: ShardInfoQueue() for kind in STEP_KINDS}
        self.shift_labels: Optional[torch.Tensor] = None  # the running step's batch["shift_labels"]
        self.form_check_pending = False
        self.form_checks_run = 0
        # called after each model-form check: the front end forgets the module trace ZeRO-3 recorded in the probe
        self.after_form_check: Callable[[], None] = lambda: None
        self.backward_calls = 0  # backward passes through the strategy since the last optimizer step
        # the front end's pre-flight memory check, before the stage's first training step computes anything
        self.preflight: Callable[[ShardInfo], None] = lambda shard: None
        self.preflight_pending = False

    def begin_stage(self) -> None:
        """A Trainer stage starts (fit, validate, test, predict): the model-form check runs before its first step."""
        self.form_check_pending = self.check_model_form
        self.preflight_pending = True

    def complete_run_facts(self, gradients: GradientFactors, zero_stage_3: bool) -> None:
        """The stage's gradient factors and ZeRO-3 flag, once the DeepSpeed config is final."""
        self.context.set_run_facts(replace(self.context.run, gradients=gradients, zero_stage_3=zero_stage_3))

    def set_in_step(self, in_step: bool) -> None:
        """Model calls get the step's shard facts (``True``) or run outside a step (Fabric's forward hooks)."""
        self.context.set_step_facts(replace(self.context.facts, in_step=in_step))

    # ------------------------------------------------------------------------------------------ around a step
    @contextmanager
    def step(self, kind: str, batch: Any) -> Iterator[None]:
        """Around a ``kind`` step of ``batch``: its shard facts into the step context (checked first), the model-form
        check before the stage's first step, the context's in-step state cleared after."""
        if batch is not None and hasattr(batch, "__next__"):
            raise ValueError(
                f"UlyssesDeepSpeedStrategy does not support a {kind} step that takes the dataloader iterator"
                " (`dataloader_iter`): the strategy pairs every batch with its sharding facts when the loop fetches"
                " it. Take `batch` as the step's argument instead."
            )
        shard = self.queues[kind].pop()
        if shard is None:
            raise RuntimeError(
                f"UlyssesDeepSpeedStrategy has no sharding facts for this {kind} batch: it did not come from a"
                " DataLoader the strategy prepared (Lightning passes every loader of the Trainer through"
                " `strategy.process_dataloader`; iterating a loader yourself inside a step is not supported)."
            )
        self.begin_batch(kind, shard, batch)
        self.set_in_step(True)
        try:
            yield
        finally:
            self.set_in_step(False)
            self.shift_labels = None

    def begin_batch(self, kind: str, shard: ShardInfo, batch: Any) -> None:
        """A step of ``batch`` (this rank's shard, as its loader gave it) begins, before any compute: check that the
        SP peers hold the same batch and that packing is supported, put its facts into the step context, and run
        the model-form check if it is the stage's first step. The Trainer's hooks call it through :meth:`step`;
        Fabric's front end at the first forward pass on a new batch."""
        self._begin(kind, shard)
        context = self.context
        self.shift_labels = batch.get("shift_labels") if isinstance(batch, dict) else None
        own = ({key: batch.get(key) for key in ("position_ids", "attention_mask", "shift_labels", "labels")}
               if isinstance(batch, dict) else {})
        context.set_step_facts(replace(context.facts, step_batch_tensors=MappingProxyType(own)))
        context.record.begin_batch(train=kind == "train")
        if kind == "train" and self.preflight_pending:
            self.preflight_pending = False
            self.preflight(shard)
        if self.form_check_pending:  # before the first step of this stage computes anything
            self.form_check_pending = False
            if self.models.check_form(batch, context, self.layout, self.device):
                self.form_checks_run += 1
                self.after_form_check()

    def _begin(self, kind: str, shard: ShardInfo) -> None:
        """Check the facts of this step's batch (before any compute): the prepared models' hooks are in place, the SP
        peers hold the same batch, packing is supported; then put them into the step context."""
        self.models.check_hooks()
        if self.agreement is not None and shard.fingerprint is not None:
            self.agreement.verify(shard.fingerprint, shard.seq_len, shard.batch_size, where=f"{kind} step")
        if shard.packed and self.layout.ring_size == 1:  # the ring kernel keeps documents apart itself
            self.models.refuse_unsupported_packing(self.context.sdpa_per_document)
        self._enter_shard(shard)

    def _enter_shard(self, shard: ShardInfo) -> None:
        self.context.set_step_facts(replace(self.context.facts, shard_info=shard,
                                            tile_shard_len=self._agreed_tile_shard_len(shard)))
        self.context.record.record_token_stats(None)

    def _agreed_tile_shard_len(self, shard: ShardInfo) -> Optional[int]:
        """With tile counts that follow the shard length under ZeRO-3 and several replicas, the step's longest shard
        over all ranks (one scalar all-reduce per step), so that every rank runs as many tiles: ZeRO-3 gathers the
        tiled modules' weights once per tile and all ranks must issue the same gathers. Else ``None``."""
        if not self.agree_on_tile_counts:
            return None
        local = torch.tensor([shard.padded_len // self.layout.sp_size], dtype=torch.int64, device=self.device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)  # [1]: max shard length, world
        return int(local.item())

    # ------------------------------------------------------------------------------------------ training
    def follow_accumulation(self, engine: Any, window_continues: Callable[[], bool]) -> None:
        """DeepSpeed's accumulation boundary (gradient reduction and optimizer step) follows Lightning's windows:
        ``window_continues()`` is Lightning's answer for the coming micro-batch."""
        if self.context.gradients.accumulation > 1:
            engine.set_gradient_accumulation_boundary(not window_continues())

    def backward(self, loss: torch.Tensor, run_backward: Callable[[torch.Tensor], Any], zero_stage_3: bool,
                 where: str) -> None:
        """Back-propagate the step's ``loss`` through ``run_backward`` with the whole-loss gradient factor (terms that
        are the same on every rank stay exact), then, before any weight changes, check that the SP peers
        back-propagated the same loss through the same use of the strategy's SP losses."""
        context = self.context
        self.backward_calls += 1
        received = context.incoming_gradients  # the SP losses of this step's forward record into this list
        value = loss.detach()
        shard_local = (loss_graph.shard_local_path(loss, self.agreement.group_ranks) if self.agreement is not None
                       else None)
        if self.agreement is not None:
            self._verify_parameters_reached(loss, where)
        try:
            run_backward(scale_gradient(loss, context.gradients.whole_loss))
        except RuntimeError as err:
            if zero_stage_3 and "invalid gradient" in str(err) and "got [0]" in str(err):
                raise ValueError(zero3_parameters_outside_forward_error()) from err
            raise
        finally:
            context.record.new_gradient_list()  # for the next forward pass
        if self.agreement is not None:
            self.agreement.verify_loss(value, received, where=where, shard_local=shard_local,
                                       model_form_checked=self.check_model_form)

    def _verify_parameters_reached(self, loss: torch.Tensor, where: str) -> None:
        """Before backward: the SP peers' losses reach the same trainable parameters (a parameter some ranks' shards
        do not use, such as an MoE expert their tokens skip, would make DeepSpeed sum different parameters'
        gradients)."""
        named = [(name, p) for name, p in self.models.trainable_parameters() if p.requires_grad]
        reached = loss_graph.parameters_reached(loss)
        self.agreement.verify_parameters_reached([id(p) in reached for _, p in named], [n for n, _ in named], where)

    def before_manual_optimizer_step(self) -> None:
        """Manual optimization: an optimizer step with no backward pass through the strategy since the last one
        means the step called ``loss.backward()`` itself (DeepSpeed's ZeRO step then fails inside with a KeyError,
        and the loss had neither the gradient factor nor the checks): refused before the weights change."""
        if self.backward_calls == 0:
            raise ValueError(manual_backward_error())
        self.backward_calls = 0

    # ------------------------------------------------------------------------------------------ predictions
    def gather_prediction(self, output: Any, local_shape: Optional[tuple[int, int]]) -> Any:
        """A predict step's per-token outputs (``[B, s, ...]``) gathered to the full ``[B, S, ...]`` on every SP rank
        (in sequence order, also for ring's zigzag shards); other outputs unchanged."""
        shard = self.context.shard_info
        if not self.gather_predictions or local_shape is None or shard is None:
            return output
        geometry = self.layout.geometry
        order = geometry.full_order(shard.padded_len) if geometry.contiguous_span(shard.padded_len, 0) is None else None
        return gather_sequence_outputs(output, local_shape, shard.seq_len, self.layout.sp_group, order)

    # ------------------------------------------------------------------------------------------ step API
    def shard_positions(self, shard_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[shard_len]`` global positions of this rank's shard of a padded row of ``shard_len · sp`` tokens."""
        index = self.layout.geometry.shard_index(shard_len * self.layout.sp_size, self.layout.sp_rank)
        return index.to(device or self.device)

    def token_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self.context.token_stats
        if stats is None:
            raise RuntimeError(
                "No per-token losses recorded for this step: they come from the loss of a prepared Hugging Face"
                " model's forward pass with labels, run without gradients (validation/test/predict). Call"
                " `self.model(**batch)` with the batch's labels first."
            )
        return stats

    def cross_entropy(self, logits: torch.Tensor, shift_labels: torch.Tensor,
                      weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        per_token = weight if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None
        self._check_weights("cross_entropy", samples=weight, tokens=per_token)
        return step_cross_entropy(self.context, logits, shift_labels, weight=weight)

    def _check_weights(self, what: str, samples: Optional[torch.Tensor] = None,
                       tokens: Optional[torch.Tensor] = None) -> None:
        """Weights computed in the step from shard tensors (this rank's count of a row's targets, e.g.
        ``1 / (batch["shift_labels"] != -100).sum(1)``) differ between the SP ranks, and are refused on every rank
        before the loss exists (``[B]`` weights always; ``[B, s]`` ones with the SP-peer agreement check,
        ``check_sp_agreement``, whose ``False`` is the way out of a row that is legitimately constant per rank).

        ``samples``: ``[B]`` per-sample weights, properties of whole rows, compared across the SP ranks (one
        all-reduce of ``[2B]``). ``tokens``: float ``[B, s]`` per-token weights (a float mask), refused if they hold
        one value per row on each rank but not the same one on every rank
        (:func:`~lightning_ulysses.training.sequence_reductions.check_row_weights`, one all-reduce of ``[2B + 1]``);
        bool masks cost nothing."""
        if self.layout.sp_size == 1:
            return
        if isinstance(samples, torch.Tensor) and samples.ndim == 1:  # always: per-sample weights must agree
            self._check_sample_weights(samples, what)
        if tokens is not None and self.agreement is not None:  # with the agreement check (its way out)
            reductions.check_row_weights(tokens, self.layout.sp_group, self.device, what)

    def _check_sample_weights(self, weights: torch.Tensor, what: str) -> None:
        """``[B]`` weights: the same on every SP rank (one all-reduce of ``[2B]``)."""
        w = weights.detach().to(self.device, torch.float64)
        both = torch.cat([w, -w])  # [2B] MAX over the group: each row's max and -min
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.layout.sp_group)
        top, bottom = both[:w.numel()], -both[w.numel():]
        if bool(((top != bottom) & torch.isfinite(top)).any()):
            raise ValueError(sample_weights_from_shard_message(what, "[B]"))

    def token_mean(self, values: torch.Tensor, weights: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        shard = self.context.shard_info
        if shard is None or shard.shard_shape is None:
            raise RuntimeError("token_mean is for use inside a step, on tensors of this rank's shard.")
        if tuple(values.shape[:2]) != shard.shard_shape:
            raise ValueError(f"token_mean: values must be [B, s] = {list(shard.shard_shape)} (this rank's shard),"
                             f" got {list(values.shape)}.")
        if mask is None:
            mask = self._default_token_mask(shard)
        w = mask.to(values.device).float()
        if weights is not None:
            w = w * broadcast_token_weights(weights, values)
        per_sample = weights if isinstance(weights, torch.Tensor) and weights.ndim == 1 else None
        if weights is not None and per_sample is None:
            tokens: Optional[torch.Tensor] = w  # [B, s] weights as they count: mask · weights
        else:
            tokens = mask if mask.is_floating_point() else None  # a float mask is a weight too
        self._check_weights("token_mean", samples=per_sample, tokens=tokens)
        return step_token_mean(self.context, values, w)

    def _default_token_mask(self, shard: ShardInfo) -> torch.Tensor:
        """``[B, s]`` bool: the step's target tokens, or without labels its real tokens."""
        if self.shift_labels is not None:
            return self.shift_labels != -100
        return reductions.real_positions(shard, shard.global_index.device)

    # per-sequence reductions (sequence_reductions.py): over the SP group, the same [B, ...] on every SP rank
    def _sequence_mask(self, values: torch.Tensor, mask: Optional[torch.Tensor], what: str,
                       targets_by_default: bool) -> tuple[ShardInfo, torch.Tensor]:
        shard = reductions.check_shard_values(values, self.context.shard_info, what)
        if mask is None:
            mask = (self._default_token_mask(shard) if targets_by_default
                    else reductions.real_positions(shard, values.device))
        elif tuple(mask.shape) != tuple(shard.shard_shape):
            raise ValueError(f"{what}: mask must be [B, s] = {list(shard.shard_shape)} (this rank's shard), got"
                             f" {list(mask.shape)}.")
        return shard, mask.to(values.device)

    def sequence_sum(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        _, mask = self._sequence_mask(values, mask, "sequence_sum", targets_by_default=True)
        self._check_weights("sequence_sum", tokens=mask)
        return reductions.sequence_sum(values, mask, self.layout.sp_group, self.context.gradients.sequence_share,
                                       self.context.incoming_gradients)

    def sequence_mean(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        _, mask = self._sequence_mask(values, mask, "sequence_mean", targets_by_default=True)
        self._check_weights("sequence_mean", tokens=mask)
        total = reductions.sequence_sum(values, mask, self.layout.sp_group, self.context.gradients.sequence_share,
                                        self.context.incoming_gradients)  # [B, ...]
        count = reductions.sequence_count(mask, self.layout.sp_group).to(total.dtype)  # [B]
        return total / count.view(-1, *([1] * (total.ndim - 1)))

    def sequence_count(self, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        shard = self.context.shard_info
        if mask is None:
            if shard is None or shard.shard_shape is None:
                raise RuntimeError("sequence_count is for use inside a step.")
            mask = self._default_token_mask(shard)
        return reductions.sequence_count(mask, self.layout.sp_group)

    def last_token(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        shard, mask = self._sequence_mask(values, mask, "last_token", targets_by_default=False)
        return reductions.last_token(values, mask, shard, self.layout.sp_group, self.context.gradients.sequence_share,
                                     self.context.incoming_gradients)

    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor:
        shard = reductions.check_shard_values(values, self.context.shard_info, "gather_sequence")
        return reductions.gather_sequence(values, shard, self.layout.sp_group, self.context.incoming_gradients)

    def next_token_values(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        shard = self.context.shard_info
        if shard is None or shard.halo is None:
            raise RuntimeError("next_token_values is for use inside a step, on tensors of this rank's shard.")
        return halo.next_token_values(values, shard, self.layout.sp_group, fill)

    @torch.no_grad()
    def evaluate_full_batch(self, model: Module, batch: dict[str, torch.Tensor], pad_token_id: int
                            ) -> dict[str, torch.Tensor]:
        """``model`` on this rank's shard of a full ``batch``, outside the Trainer's loops (see the strategy's
        ``evaluate_full_batch``)."""
        from lightning_ulysses.data.sharding import shard_batch

        layout = self.layout
        shard = shard_batch(batch, layout.sp_size, layout.sp_rank, pad_token_id, ring_size=layout.ring_size)
        info = shard.pop(SHARD_INFO_KEY)
        context = self.context
        previous_stats = context.token_stats
        facts = replace(context.facts, shard_info=info, tile_shard_len=self._agreed_tile_shard_len(info), in_step=True)
        context.record.record_token_stats(None)
        try:
            with context.facts_for(facts):
                shard = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
                model(**shard)
                losses, correct = self.token_stats()
        finally:
            context.record.record_token_stats(previous_stats)
        return {"loss": losses, "correct": correct, "shift_labels": shard["shift_labels"],
                "position_ids": shard["position_ids"]}
