"""The causal-LM loss from sequence shards, token-weighted like the single-device run, with exact gradients.

Each rank holds logits for ``S / sp`` positions of its replica's micro-batch. The single-device run that SP must
reproduce takes the mean over every target token of the whole (global) batch. So every rank computes the *sum* over
its shard's valid tokens, and one all-reduce over all ranks (DP × SP) gives the global sum and token count:

* the returned value is the global micro-batch mean: the same number on every rank, equal to the single-device loss;
* its gradient is ``grad_scale × local_sum / N``, where ``N`` counts the target tokens of the micro-batch, or of the
  whole gradient-accumulation window when the train loader looked ahead to count it (exact token weighting across
  micro-batches of different lengths, as one k-times larger batch would give).

``grad_scale`` undoes what DeepSpeed does to gradients (measured per ZeRO stage, pinned by tests/test_parity.py):
it sums gradients over all DP × SP ranks and divides by dp (ZeRO 0/1/2, ZeRO 3 without ``reduce_scatter``) or by
dp × sp (ZeRO 3 with ``reduce_scatter``, Lightning's default); with gradient accumulation Lightning and DeepSpeed
each divide the loss by the number of accumulation steps.

The loss returned carries ``value`` bitwise (the same fp32 number on every rank) and passes its gradient to the local
share (:class:`_ValueWithGradientOf`). One all-reduce of 3 numbers per call.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses.context import StepContext

IGNORE_INDEX = -100


def zero_gradient_scale(deepspeed_config: Mapping[str, Any], sp_size: int, dp_size: int = 1) -> float:
    """The factor on each rank's ``local_sum / N`` that makes DeepSpeed's reduced gradient exact."""
    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True):
        return float(dp_size * sp_size)
    return float(dp_size)


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
        grad_scale: factor on the local share's gradient (see :func:`zero_gradient_scale`).
        ignore_index: label value of positions that carry no target.
        window_tokens: this rank's target-token count over the gradient-accumulation window; the gradient is then
            normalised by the window's global count instead of the micro-batch's.

    Returns:
        A 0-dim fp32 tensor whose value is the global micro-batch mean, identical on every rank of ``group``.
    """
    local_sum = cross_entropy_sum(logits, shift_labels, ignore_index)
    return normalize_loss_sum(local_sum, shift_labels, group, grad_scale, ignore_index, window_tokens)


def cross_entropy_sum(logits: torch.Tensor, shift_labels: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """fp32 sum of the token cross-entropies of ``[B, s, V]`` logits against ``[B, s]`` targets (0 if none)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum")


def token_statistics(logits: torch.Tensor, shift_labels: torch.Tensor,
                     ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 cross-entropy ``[B, s]`` (0 where there is no target) and whether the argmax is the target
    ``[B, s]`` (False where there is none), from ``[B, s, V]`` logits."""
    labels = shift_labels.to(logits.device)
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             ignore_index=ignore_index, reduction="none").view(labels.shape)
    correct = (logits.argmax(-1) == labels) & (labels != ignore_index)
    return losses, correct


def normalize_loss_sum(
    local_sum: torch.Tensor,
    shift_labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    grad_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    window_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Turn this rank's summed token loss into the batch mean with exact gradients (see the module docstring)."""
    local_count = (shift_labels != ignore_index).sum().to(local_sum.device)
    window = local_count if window_tokens is None else window_tokens.to(local_sum.device)
    totals = torch.stack([local_sum.detach().double(), local_count.double(), window.double()])  # [sum, count, window]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    value = (totals[0] / totals[1].clamp(min=1.0)).float()
    share = local_sum * (grad_scale / totals[2].clamp(min=1.0).float())
    # Not `share + (value - share).detach()`: that rounds in fp32 (differently per rank when share > value).
    return _ValueWithGradientOf.apply(value, share)


class _ValueWithGradientOf(torch.autograd.Function):
    """Forward: ``value`` exactly. Backward: the incoming gradient goes to ``share`` (``d out / d share = 1``)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, share: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        return None, grad


def step_normalization(context: StepContext) -> tuple[float, Optional[torch.Tensor]]:
    """The gradient scale and accumulation-window token count of the current step."""
    window = context.shard.window_tokens if context.shard is not None else None
    # With accumulation, Lightning divides the training_step loss by the steps (its closure) and DeepSpeed divides
    # it again (engine.backward): a window-normalised share must be multiplied by steps² (measured, tests pin it).
    return context.grad_scale * (context.accumulation**2 if window is not None else 1), window


def step_cross_entropy(
    context: StepContext, logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """:func:`sequence_parallel_cross_entropy` with the group, gradient scale and window of the current step."""
    scale, window = step_normalization(context)
    if not torch.is_grad_enabled():  # evaluation: keep the per-token losses for position / retrieval metrics
        context.token_stats = token_statistics(logits, shift_labels, ignore_index)
        local_sum = context.token_stats[0].sum()
        return normalize_loss_sum(local_sum, shift_labels, context.loss_group, scale, ignore_index, window)
    return sequence_parallel_cross_entropy(logits, shift_labels, context.loss_group, scale, ignore_index, window)


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
                "Under sequence parallelism the loss needs `shift_labels` (next-token targets computed before the"
                " sequence was sharded). The strategy's collate step adds them from `labels`: pass batches through"
                " the DataLoader the strategy prepared, or add `shift_labels` to the batch yourself."
            )
        return step_cross_entropy(self.context, logits, shift_labels, ignore_index)
