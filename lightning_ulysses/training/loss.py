"""The causal-LM loss (and any token-weighted mean) from sequence shards, with exact gradients.

Each rank holds logits for ``S / sp`` positions of its replica's micro-batch. The single-device run that SP must
reproduce takes the mean over every target token of the whole (global) batch. So every rank computes the *sum* over
its shard's valid tokens, and one all-reduce over all ranks (DP × SP) gives the global sum and token count:

* the returned value is the global micro-batch mean: the same number on every rank, equal to the single-device loss;
* its gradient is ``grad_scale × local_sum / N``, where ``N`` counts the target tokens of the micro-batch, or of the
  whole gradient-accumulation window when the train loader looked ahead to count it (exact token weighting across
  micro-batches of different lengths, as one k-times larger batch would give).

The factors on the gradients (of the whole loss a step returns, and of an SP loss's local share) are stated in
:mod:`lightning_ulysses.training.gradient_factor`, their one owner.

The loss returned carries ``value`` bitwise (the same fp32 number on every rank) and passes its gradient to the local
share (:class:`ValueWithGradientOf`), recording that gradient for the SP-peer check of the step. One all-reduce of
3 numbers per call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses.context import IGNORE_INDEX
from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.training.step_context import StepContext


def scale_gradient(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """``loss`` with the same value whose gradient is multiplied by ``factor`` on the way back."""
    if factor == 1.0 or not loss.requires_grad:
        return loss
    return _ScaledGradient.apply(loss, factor)


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.factor, None


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    grad_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    window_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over all target tokens of the batch, computed from this rank's shard.

    Use it when your ``training_step`` computes the loss from logits instead of reading ``model(**batch).loss``;
    inside a LightningModule, ``self.trainer.strategy.cross_entropy(logits, batch["shift_labels"])`` fills in the
    group, the gradient scale and the accumulation window.

    Args:
        logits: ``[B, s, V]`` logits of this rank's sequence shard.
        shift_labels: ``[B, s]`` next-token targets of the shard (the collate step's ``shift_labels``); positions
            equal to ``ignore_index`` do not count. A shard without any target contributes 0, never NaN.
        group: the ranks whose shards make up the batch (``None``: every rank of the default group, if initialised).
        grad_scale: factor on the local share's gradient (under the strategy:
            :attr:`~lightning_ulysses.training.gradient_factor.GradientFactors.sp_loss_share`).
        ignore_index: label value of positions that carry no target.
        window_tokens: this rank's target-token count over the gradient-accumulation window; the gradient is then
            normalised by the window's global count instead of the micro-batch's.

    Returns:
        A 0-dim fp32 tensor whose value is the global micro-batch mean, identical on every rank of ``group``.
    """
    local_sum = cross_entropy_sum(logits, shift_labels, ignore_index)
    return normalize_loss_sum(local_sum, shift_labels, group, grad_scale, ignore_index, window_tokens)


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` upcast to fp32 for the loss, as transformers' losses do; a float64 tensor stays float64."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def cross_entropy_sum(logits: torch.Tensor, shift_labels: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """fp32 (fp64 for a float64 model) sum of the token cross-entropies of ``[B, s, V]`` logits against ``[B, s]``
    targets (0 if none)."""
    return F.cross_entropy(at_least_fp32(logits).reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum")


def token_statistics(logits: torch.Tensor, shift_labels: torch.Tensor,
                     ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 cross-entropy ``[B, s]`` (0 where there is no target) and whether the argmax is the target
    ``[B, s]`` (False where there is none), from ``[B, s, V]`` logits."""
    labels = shift_labels.to(logits.device)
    correct = (logits.argmax(-1) == labels) & (labels != ignore_index)
    return token_cross_entropy(logits, labels, ignore_index), correct


def normalize_loss_sum(
    local_sum: torch.Tensor,
    shift_labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    grad_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    window_tokens: Optional[torch.Tensor] = None,
    record: Optional[list] = None,
) -> torch.Tensor:
    """Turn this rank's summed token loss into the batch mean with exact gradients (see the module docstring)."""
    local_count = (shift_labels != ignore_index).sum().to(local_sum.device)
    return normalize_weighted_sum(local_sum, local_count, group, grad_scale, window_tokens, record)


def normalize_weighted_sum(
    local_sum: torch.Tensor,
    local_weight: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    grad_scale: float = 1.0,
    window_weight: Optional[torch.Tensor] = None,
    record: Optional[list] = None,
) -> torch.Tensor:
    """``sum over all ranks of local_sum / sum over all ranks of local_weight`` (0 when the weights sum to 0), whose
    gradient reaches this rank's ``local_sum`` as ``grad_scale / total window weight`` (the micro-batch's total when
    ``window_weight`` is ``None``). ``record``: a list the incoming gradient is appended to in backward."""
    local_weight = local_weight.to(local_sum.device)
    window = local_weight if window_weight is None else window_weight.to(local_sum.device)
    totals = torch.stack([local_sum.detach().double(), local_weight.detach().double(),
                          window.detach().double()])  # [sum, weight, window weight]
    if group_size(group) > 1:
        dist.all_reduce(totals, group=group)
    dtype = at_least_fp32(local_sum).dtype  # fp32, or fp64 for a float64 model
    value = (totals[0] / _nonzero(totals[1])).to(dtype)
    share = local_sum * (grad_scale / _nonzero(totals[2]).to(dtype))
    # Not `share + (value - share).detach()`: that rounds in fp32 (differently per rank when share > value).
    return ValueWithGradientOf.apply(value, share, record)


def _nonzero(total: torch.Tensor) -> torch.Tensor:
    """The total, or 1 where it is 0 (a batch without targets: the sum is 0 too, so the mean is 0, never NaN)."""
    return torch.where(total == 0, torch.ones_like(total), total)


class ValueWithGradientOf(torch.autograd.Function):
    """Forward: ``value`` exactly. Backward: the incoming gradient goes to ``share`` (``d out / d share = 1``) and is
    appended to ``record`` (if given) for the SP-peer check."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, share: torch.Tensor,  # type: ignore[override]
                record: Optional[list] = None) -> torch.Tensor:
        ctx.record = record
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:  # type: ignore[override]
        if ctx.record is not None:
            ctx.record.append(grad.detach())
        return None, grad, None


def step_normalization(context: StepContext) -> tuple[float, Optional[torch.Tensor]]:
    """The share factor and accumulation-window token count of the current step."""
    window = context.shard_info.window_tokens if context.shard_info is not None else None
    return context.gradients.sp_loss_share_for(window_normalised=window is not None), window


def step_cross_entropy(
    context: StepContext, logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`sequence_parallel_cross_entropy` with the group, gradient scale and window of the current step;
    ``weight``: ``[B]`` sample or ``[B, s]`` token weights (a weighted mean over the target tokens)."""
    if weight is not None:
        losses = token_cross_entropy(logits, shift_labels, ignore_index)  # [B, s], 0 where no target
        weights = broadcast_token_weights(weight, shift_labels) * (shift_labels != ignore_index).to(losses.device)
        return step_token_mean(context, losses, weights)
    if not torch.is_grad_enabled():  # evaluation: keep the per-token losses for position / retrieval metrics
        context.record.record_token_stats(token_statistics(logits, shift_labels, ignore_index))
        local_sum = context.token_stats[0].sum()
    else:
        local_sum = cross_entropy_sum(logits, shift_labels, ignore_index)
    return step_loss_from_sum(context, local_sum, shift_labels, ignore_index)


def step_loss_from_sum(context: Optional[StepContext], local_sum: torch.Tensor, shift_labels: torch.Tensor,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The step's mean token loss over the whole batch from this rank's summed token losses (a scalar) and its
    ``[B, s]`` ``shift_labels``, with the current step's gradient scale and accumulation window, recorded for the
    SP peers' agreement check; ``context=None`` (a model used outside the strategy): a plain mean over all ranks."""
    if context is None:
        return normalize_loss_sum(local_sum, shift_labels, None, 1.0, ignore_index, None, None)
    scale, window = step_normalization(context)
    # group None: every rank (DP × SP), the global batch
    return normalize_loss_sum(local_sum, shift_labels, None, scale, ignore_index, window, context.incoming_gradients)


def token_cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[B, s]`` fp32 (fp64 for a float64 model) token cross-entropies of ``[B, s, V]`` logits (0 where there is no
    target)."""
    labels = shift_labels.to(logits.device)
    return F.cross_entropy(at_least_fp32(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="none").view(labels.shape)


def broadcast_token_weights(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` (one weight per sample) or ``[B, s]`` (per token) weights as ``[B, s]`` fp32 on ``like``'s device."""
    weight = torch.as_tensor(weight, device=like.device)
    if weight.ndim == 1 and weight.shape[0] == like.shape[0]:
        weight = weight[:, None].expand(like.shape[:2])
    if tuple(weight.shape) != tuple(like.shape[:2]):
        raise ValueError(f"Weights must be [B] (per sample) or [B, s] (per token of this rank's shard) ="
                         f" {list(like.shape[:2])}, got {list(weight.shape)}.")
    return weight.float()


def step_token_mean(context: StepContext, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(values · weights) / sum(weights)`` over the whole batch (every rank's shard), exact gradients; the mean
    is taken per micro-batch (with accumulation, the micro-batches are averaged as Lightning does on one device)."""
    weights = weights.to(values.device).float()
    local_sum = (values.float() * weights).sum()
    return normalize_weighted_sum(local_sum, weights.sum(), None, context.gradients.sp_loss_share, None,
                                  context.incoming_gradients)


class SequenceParallelLossFunction:
    """Drop-in for a Hugging Face model's ``loss_function`` under SP (what ``model(**batch).loss`` calls)."""

    def __init__(self, context: StepContext) -> None:
        self.context = context

    def __call__(
        self,
        logits: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        vocab_size: Optional[int] = None,
        shift_labels: Optional[torch.Tensor] = None,
        ignore_index: int = IGNORE_INDEX,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            raise ValueError(
                "Under sequence parallelism the loss needs `shift_labels` (next-token targets across the shard"
                " boundaries). The strategy builds them when the model is called with `labels` inside a step; call"
                " the model with the batch's `labels` (or `shift_labels=batch[\"shift_labels\"]`)."
            )
        return step_cross_entropy(self.context, logits, shift_labels, ignore_index)


def zero3_parameters_outside_forward_error() -> str:
    return (
        "A term of the training step's loss uses model parameters outside the model's forward under ZeRO stage 3,"
        " where parameters are partitioned across the ranks (outside a forward pass each rank holds [0]-sized"
        " placeholders), so its gradient cannot be formed; no weight was changed. For a weight regulariser"
        " (`sum(p.pow(2).sum() for p in self.parameters())`) use the optimizer's `weight_decay`; compute other terms"
        " inside the model's forward (e.g. a forward hook), or train with ZeRO stage 1 or 2."
    )
