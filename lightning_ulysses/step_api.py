"""What a ``training_step`` (or a callback) asks the strategy during a step: the step's context and shard, the SP
losses for a step that computes its own loss (``cross_entropy``, ``token_mean``, ``next_token_values``), per-token
statistics of evaluation passes, and a full-batch evaluation outside the loops. Mixed into
:class:`~lightning_ulysses.UlyssesDeepSpeedStrategy` (``strategy.token_mean(...)``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn import Module

from lightning_ulysses import calls
from lightning_ulysses.context import SHARD_INFO_KEY, ShardInfo, StepContext
from lightning_ulysses.loss import broadcast_token_weights, step_cross_entropy, step_token_mean


class StepAPI:
    """The strategy's public step API; reads the strategy's step context, layout and prepared models."""

    @property
    def step_context(self) -> StepContext:
        """What the prepared models' attention and loss read during the current step."""
        if self._context is None:
            raise RuntimeError("The step context exists once the Trainer has set up the strategy.")
        return self._context

    def shard_positions(self, shard_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Global positions ``[shard_len]`` of this rank's sequence shard (for rotary/absolute position embeddings
        of your own model; batches from the strategy's loaders also carry them as ``position_ids``)."""
        if self.ring_size > 1:
            raise RuntimeError("shard_positions: with ring_size > 1 the shard is not contiguous; use the batch's"
                               " position_ids.")
        start = self.sp_rank * shard_len
        return torch.arange(start, start + shard_len, device=device or self.root_device)

    @property
    def current_shard_info(self) -> Optional[ShardInfo]:
        """Facts about the full batch of the current step (length before padding, packed documents)."""
        return self._context.shard_info if self._context is not None else None

    @property
    def prepared_models(self) -> list[Module]:
        """The Hugging Face models the strategy switched to Ulysses attention (during fit/validate/test/predict)."""
        return list(self._prepared_models)

    def token_losses(self) -> torch.Tensor:
        """Per-token cross-entropy ``[B, s]`` of this rank's shard from the last forward pass of a prepared model
        run without gradients (``validation_step``/``test_step``/``predict_step``), fp32, 0 where there is no
        target. Works with ``tiled_loss`` (no full logits). Pair it with the batch's ``position_ids`` and
        ``shift_labels`` (e.g. :class:`lightning_ulysses.PositionalLoss`)."""
        return self._token_stats()[0]

    def token_correct(self) -> torch.Tensor:
        """``[B, s]`` bool: whether the argmax of each position's logits is its target (see :meth:`token_losses`)."""
        return self._token_stats()[1]

    def _token_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self._context.token_stats if self._context is not None else None
        if stats is None:
            raise RuntimeError(
                "No per-token losses recorded for this step: they come from the loss of a prepared Hugging Face"
                " model's forward pass with labels, run without gradients (validation/test/predict). Call"
                " `self.model(**batch)` with the batch's labels first."
            )
        return stats

    @torch.no_grad()
    def evaluate_full_batch(self, model: Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run a prepared model on a FULL batch (``input_ids`` ``[B, S]``, ``labels``; the same on every rank of the
        SP group) outside the Trainer's loops, e.g. from a callback: the batch is cut into this rank's shard, the
        model runs sequence-parallel without gradients, and this rank's shard statistics come back:
        ``{"loss": [B, s], "correct": [B, s], "shift_labels": [B, s], "position_ids": [B, s]}``. Every rank of the
        world must call it the same number of times (the loss reduces over all ranks)."""
        from lightning_ulysses.data import shard_batch

        shard = shard_batch(batch, self.sp_size, self.sp_rank, self._pad_token_id(), ring_size=self.ring_size)
        info = shard.pop(SHARD_INFO_KEY)
        context = self.step_context
        previous = context.shard_info, context.tile_shard_len, context.token_stats, context.in_step
        context.shard_info, context.tile_shard_len, context.token_stats = info, self._agreed_tile_shard_len(info), None
        context.in_step = True
        try:
            shard = {k: v.to(self.root_device) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
            model(**shard)
            losses, correct = self._token_stats()
        finally:
            context.shard_info, context.tile_shard_len, context.token_stats, context.in_step = previous
        return {"loss": losses, "correct": correct, "shift_labels": shard["shift_labels"],
                "position_ids": shard["position_ids"]}

    def cross_entropy(self, logits: torch.Tensor, shift_labels: torch.Tensor,
                      weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the batch's target tokens from this rank's ``[B, s, V]`` logits and
        ``[B, s]`` ``shift_labels``, for a ``training_step`` that computes its own loss. Same value on every rank,
        the single-device value; exact gradients at every ZeRO stage and with gradient accumulation.

        ``weight``: ``[B]`` per-sample or ``[B, s]`` per-target weights (aligned with ``shift_labels``; for weights
        given per input token use :meth:`next_token_values`): the loss is then ``sum(w · ce) / sum(w)`` over the
        target tokens of the whole batch, as ``(ce * w).sum() / w.sum()`` on one device."""
        return step_cross_entropy(self.step_context, logits, shift_labels, weight=weight)

    def token_mean(self, values: torch.Tensor, weights: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Weighted mean of per-token ``values`` ``[B, s]`` over the whole batch (every rank's shard): the value a
        single device computes as ``(values * w).sum() / w.sum()`` on the full batch, the same number on every rank,
        with exact gradients. Use it for every per-token term of a loss (auxiliary losses on logits or hidden states,
        weighted token losses): a mean over this rank's shard would be a different function on every rank.

        Args:
            values: ``[B, s]`` per-token values of this rank's shard (e.g. ``F.cross_entropy(..., reduction="none")``
                against ``batch["shift_labels"]``, or ``logits.logsumexp(-1) ** 2``).
            weights: ``[B]`` per-sample or ``[B, s]`` per-token weights; ``None``: 1.
            mask: ``[B, s]`` which positions count; ``None``: the step's target tokens (``shift_labels != -100``),
                or, if the batch has no labels, its real tokens (no padding).

        With gradient accumulation the mean is taken per micro-batch, and the micro-batches are averaged as Lightning
        averages them on one device."""
        context = self.step_context
        shard = context.shard_info
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
        return step_token_mean(context, values, w)

    def _default_token_mask(self, shard: ShardInfo) -> torch.Tensor:
        if self._step_shift_labels is not None:
            return self._step_shift_labels != -100
        real = torch.ones(shard.shard_shape, dtype=torch.bool)  # type: ignore[arg-type]
        if shard.attention_mask is not None:
            real &= shard.attention_mask.bool()
        real &= shard.global_index[None, :] < shard.seq_len  # not the padding to the SP multiple
        return real

    def next_token_values(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """``[B, s, ...]`` -> ``[B, s, ...]``: at every position of this rank's shard, the value at the next position of
        the full sequence (``fill`` after the last one), across shard boundaries: what ``values[:, 1:]`` is on one
        device. For per-token tensors of the batch that must line up with the targets, e.g. token weights:
        ``strategy.cross_entropy(logits, batch["shift_labels"], weight=strategy.next_token_values(batch["w"]))``.
        One all-gather of ``[B, 1 or 2, ...]`` over the SP group; every SP rank must call it."""
        shard = self.step_context.shard_info
        if shard is None or shard.halo is None:
            raise RuntimeError("next_token_values is for use inside a step, on tensors of this rank's shard.")
        return calls.next_token_values(values, shard, self.sp_group, fill)

