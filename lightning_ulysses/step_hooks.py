"""What the strategy does around every step: before it, the step's shard facts are taken from the queue its loader
filled and checked (SP peers hold the same batch, packed documents are supported); during it, the prepared models
read them from the step context; at its backward, the whole loss gets the gradient factor that keeps it exact and
the SP peers check that they back-propagated the same loss; DeepSpeed's accumulation boundary follows Lightning's;
predictions are gathered to the full sequence. Mixed into :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy`
before Lightning's ``DeepSpeedStrategy``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ulysses import hf_attention
from lightning_ulysses import loss as loss_module
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.loss import scale_gradient
from lightning_ulysses.outputs import gather_sequence_outputs


class StepHooks:
    """The strategy's step hooks; read its loader queues, agreement check, step context and layout."""

    def _begin_step(self, kind: str, batch: Any = None) -> None:
        """Take the facts of this step's batch from the queue its loader filled (before any compute): check that the
        SP peers hold the same batch, check packing support, and put them into the step context."""
        if batch is not None and hasattr(batch, "__next__"):
            raise ValueError(
                f"UlyssesDeepSpeedStrategy does not support a {kind} step that takes the dataloader iterator"
                " (`dataloader_iter`): the strategy pairs every batch with its sharding facts when the loop fetches"
                " it. Take `batch` as the step's argument instead."
            )
        self._check_model_hooks()
        queue = self._step_queues.get(kind)
        shard = queue.pop() if queue is not None else None
        if shard is None:
            raise RuntimeError(
                f"UlyssesDeepSpeedStrategy has no sharding facts for this {kind} batch: it did not come from a"
                " DataLoader the strategy prepared (Lightning passes every loader of the Trainer through"
                " `strategy.process_dataloader`; iterating a loader yourself inside a step is not supported)."
            )
        if self._agreement is not None and shard.fingerprint is not None:
            self._agreement.verify(shard.fingerprint, shard.seq_len, shard.batch_size, where=f"{kind} step")
        if shard.packed and self.ring_size == 1:  # the ring kernel keeps documents apart itself
            for model in self._prepared_models:
                impl = hf_attention.attention_implementation(model)
                if not hf_attention.keeps_documents_apart(impl, self.sdpa_per_document):
                    raise ValueError(hf_attention.packed_documents_error(impl))
        if self._context is not None:
            self._context.shard_info = shard
            self._context.tile_shard_len = self._agreed_tile_shard_len(shard)
            self._context.token_stats = None

    def _agreed_tile_shard_len(self, shard: ShardInfo) -> Optional[int]:
        """With tile counts that follow the shard length under ZeRO-3 and several replicas, the step's longest shard
        over all ranks (one scalar all-reduce per step), so that every rank runs as many tiles: ZeRO-3 gathers the
        tiled modules' weights once per tile and all ranks must issue the same gathers. Else ``None``."""
        if not (self.memory_features.auto and self.zero_stage_3 and self.dp_size > 1):
            return None
        local = torch.tensor([-(-shard.seq_len // self.sp_size)], dtype=torch.int64, device=self.root_device)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)  # [1]: max shard length, world
        return int(local.item())

    @contextmanager
    def _step(self, kind: str, batch: Any) -> Generator[None, None, None]:
        self._begin_step(kind, batch)
        self._step_shift_labels = batch.get("shift_labels") if isinstance(batch, dict) else None
        if self._context is not None:
            self._context.in_step = True
            self._context.step_batch_tensors = (
                {key: batch.get(key) for key in ("position_ids", "attention_mask", "shift_labels")}
                if isinstance(batch, dict) else {})
            if kind == "train":
                self._context.incoming_gradients = []
        if self._form_check_pending:  # before the first step of this stage computes anything
            self._form_check_pending = False
            self._check_model_form(batch)
        try:
            yield
        finally:
            if self._context is not None:
                self._context.in_step = False
            self._step_shift_labels = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._follow_lightnings_accumulation()
        with self._step("train", batch):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step("validate", args[0] if args else kwargs.get("batch")):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step("test", args[0] if args else kwargs.get("batch")):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        local_shape = tuple(batch["input_ids"].shape[:2]) if isinstance(batch, dict) and "input_ids" in batch else None
        with self._step("predict", batch):
            output = super().predict_step(*args, **kwargs)
        if not self.gather_predictions or local_shape is None or self.current_shard_info is None:
            return output
        order = None
        if self.ring_size > 1:  # the shards are zigzag pieces: put the gathered ones back in sequence order
            geometry = self.layout.geometry
            order = geometry.full_order(geometry.padded_length(self.current_shard_info.seq_len))
        return gather_sequence_outputs(output, local_shape, self.current_shard_info.seq_len, self.sp_group, order)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """``False``: Lightning decides where an accumulation window ends (every ``accumulate_grad_batches`` batches
        and at the end of the epoch, as on one device) and calls the optimizer step only there; the strategy tells
        DeepSpeed each micro-batch whether it ends a window (:meth:`_follow_lightnings_accumulation`). Lightning's
        own DeepSpeed strategy lets DeepSpeed count windows across epochs, so a window that does not divide the epoch
        drifts away from Lightning's steps."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: DeepSpeed reduces gradients at the accumulation boundary the strategy sets (its
        ``no_sync`` refuses ZeRO 2/3, whose gradient partitioning needs the reduction hooks)."""
        yield None

    def _follow_lightnings_accumulation(self) -> None:
        """DeepSpeed's accumulation boundary (gradient reduction and optimizer step) follows Lightning's windows."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._context is None or self._context.accumulation <= 1 or trainer is None:
            return
        if self.lightning_module.automatic_optimization:
            self.deepspeed_engine.set_gradient_accumulation_boundary(not trainer.fit_loop._should_accumulate())

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        """Back-propagate the step's loss with the whole-loss gradient factor (terms that are the same on every
        rank stay exact), then, before any weight changes, check that the SP peers back-propagated the same loss
        through the same use of the strategy's SP losses."""
        context = self._context
        if context is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        received = context.incoming_gradients  # the SP losses of this step's forward record into this list
        value = closure_loss.detach()
        scaled = scale_gradient(closure_loss, context.loss_scale)
        try:
            super().backward(scaled, optimizer, *args, **kwargs)
        except RuntimeError as err:
            if self.zero_stage_3 and "invalid gradient" in str(err) and "got [0]" in str(err):
                raise ValueError(loss_module.zero3_parameters_outside_forward_error()) from err
            raise
        finally:
            context.incoming_gradients = []  # for the next forward pass
        if self._agreement is not None:
            step = self.lightning_module.trainer.global_step
            self._agreement.verify_loss(value, received, where=f"training step at global step {step}")
        return closure_loss
