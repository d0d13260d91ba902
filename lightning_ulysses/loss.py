"""The full-sequence causal-LM loss from a sequence shard, with the gradient scale DeepSpeed's reduction needs.

Each SP rank holds logits for ``S / sp`` positions. The loss users expect is the mean over every valid token of the
whole sequence, the same number on every SP rank. Its gradient must be what DeepSpeed turns into the single-device
gradient after its reduction, which depends on the ZeRO stage (measured, see README "How the gradients stay exact"):

* ZeRO 0/1/2, and ZeRO 3 without ``reduce_scatter``: gradients are summed over all DP×SP ranks and divided by dp, so
  each rank must backpropagate only its local share ``local_sum / N_valid(whole sequence)`` (scale 1);
* ZeRO 3 with ``reduce_scatter`` (Lightning's default): gradients are averaged over all DP×SP ranks, so each rank
  backpropagates ``sp ×`` its local share.

The loss returned is ``grad_scale * share + (full_loss - grad_scale * share).detach()``: its value is the
full-sequence loss, its gradient ``grad_scale ×`` the local share. One all-reduce (2 numbers) per call.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def zero_gradient_scale(deepspeed_config: Mapping[str, Any], sp_size: int) -> float:
    """The factor on each SP rank's local loss share that makes DeepSpeed's reduced gradient exact."""
    zero = deepspeed_config.get("zero_optimization") or {}
    if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True):
        return float(sp_size)
    return 1.0


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    grad_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token cross-entropy over all valid tokens of the full sequences, from this rank's shard.

    Use it when your ``training_step`` computes the loss from logits instead of reading ``model(**batch).loss``;
    inside a LightningModule ``self.trainer.strategy.cross_entropy(logits, batch["shift_labels"])`` fills in the group
    and the gradient scale.

    Args:
        logits: ``[B, s, V]`` logits of this rank's sequence shard.
        shift_labels: ``[B, s]`` next-token targets of the shard (the collate step's ``shift_labels``); positions
            equal to ``ignore_index`` do not count. A shard without any valid token contributes 0, never NaN.
        group: the SP group (``None``: no sequence parallelism, plain mean).
        grad_scale: factor on the local share's gradient (see :func:`zero_gradient_scale`).
        ignore_index: label value of positions that carry no target.

    Returns:
        A 0-dim fp32 tensor whose value is the full-sequence loss, identical on every rank of the SP group.
    """
    vocab_size = logits.shape[-1]
    local_sum = F.cross_entropy(
        logits.float().reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )
    local_count = (shift_labels != ignore_index).sum()
    totals = torch.stack([local_sum.detach().double(), local_count.double()])  # [sum, count]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    total_valid = totals[1].clamp(min=1.0)
    full_loss = (totals[0] / total_valid).float()
    share = local_sum * (grad_scale / total_valid.float())
    return share + (full_loss - share).detach()


class SequenceParallelLossFunction:
    """Drop-in for a Hugging Face model's ``loss_function`` under SP (what ``model(**batch).loss`` calls)."""

    def __init__(self, group: dist.ProcessGroup, grad_scale: float = 1.0) -> None:
        self.group = group
        self.grad_scale = grad_scale

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
        return sequence_parallel_cross_entropy(logits, shift_labels, self.group, self.grad_scale, ignore_index)
