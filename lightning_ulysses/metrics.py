"""Exact corpus-level evaluation numbers under sequence (and data) parallelism."""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lightning_ulysses.loss import IGNORE_INDEX


class TokenWeightedLoss(Metric):
    """Mean loss over every target token of the evaluated corpus (not the mean of per-batch means).

    Feed it the batch loss the model returns and the batch's ``shift_labels``::

        def validation_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.val_loss.update(loss, batch["shift_labels"])
            self.log("val_loss", self.val_loss, sync_dist=True)  # epoch level: exact corpus loss

    Under the strategy each rank holds a shard: the loss value is the global batch mean (the same on every rank) and
    each rank adds ``loss × its target tokens``; summed over all ranks at ``compute()`` that is the sum of every token's
    loss, divided by every token. Without SP it is the same arithmetic on one rank.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("loss_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, shift_labels: torch.Tensor) -> None:
        tokens = (shift_labels != self.ignore_index).sum().to(self.tokens)
        self.loss_sum += loss.detach().to(self.loss_sum) * tokens
        self.tokens += tokens

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.tokens.clamp(min=1)).float()


class TokenWeightedPerplexity(TokenWeightedLoss):
    """``exp`` of :class:`TokenWeightedLoss`: the corpus perplexity."""

    def compute(self) -> torch.Tensor:
        return super().compute().exp()
