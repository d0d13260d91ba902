"""Exact corpus-level evaluation numbers under sequence (and data) parallelism."""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lightning_ulysses.context import IGNORE_INDEX


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


class PositionalLoss(Metric):
    """Mean next-token loss (and argmax accuracy) by position in the context: does the loss keep falling far into
    the sequence? Exact under sequence and data parallelism: each rank adds the tokens of its shard into the buckets
    of their positions, and ``compute()`` sums the buckets over all ranks, so the curve is a single device's.

    The position of a target is the ``position_ids`` value of the token that predicts it (its context length minus
    one): the position in the row, or in its document for packed rows. Buckets: ``edges`` (ascending; bucket ``i``
    holds positions ``edges[i] <= p < edges[i+1]``), or ``num_buckets`` log-spaced edges up to ``max_position``.

    One line in ``validation_step`` (the strategy keeps the per-token losses of the forward pass, also with
    ``tiled_loss``)::

        loss = self.model(**batch).loss
        self.loss_by_position.update(self.trainer.strategy.token_losses(), batch,
                                     self.trainer.strategy.token_correct())

    and at epoch end ``self.log_dict(self.loss_by_position.as_dict("val_loss_at"))``, or ``.save("loss.png")``.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, max_position: int = 0, num_buckets: int = 16, edges: "list[int] | None" = None,
                 ignore_index: int = IGNORE_INDEX, **kwargs) -> None:
        super().__init__(**kwargs)
        if edges is None:
            if max_position <= 0:
                raise ValueError("PositionalLoss needs `max_position` (the longest sequence) or explicit `edges`.")
            edges = log_spaced_edges(max_position, num_buckets)
        if list(edges) != sorted(set(edges)) or edges[0] != 0:
            raise ValueError(f"`edges` must start at 0 and increase strictly, got {edges}.")
        self.edges = [int(e) for e in edges]
        self.ignore_index = ignore_index
        n = len(self.edges)  # the last bucket holds positions >= edges[-1]
        self.add_state("loss_sum", torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct", torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, token_losses: torch.Tensor, batch: dict, token_correct: "torch.Tensor | None" = None) -> None:
        """``token_losses`` ``[B, s]`` of this rank's shard; ``batch`` with its ``position_ids`` and ``shift_labels``
        (the strategy's collate step adds both)."""
        labels = batch["shift_labels"].to(token_losses.device)
        positions = batch["position_ids"].to(token_losses.device).expand_as(labels)
        valid = labels != self.ignore_index
        edges = torch.tensor(self.edges, device=token_losses.device)
        bucket = (torch.searchsorted(edges, positions[valid].contiguous(), right=True) - 1).to(self.tokens.device)
        self.loss_sum.index_add_(0, bucket, token_losses[valid].detach().to(self.loss_sum))
        self.tokens.index_add_(0, bucket, torch.ones_like(bucket, dtype=self.tokens.dtype))
        if token_correct is not None:
            self.correct.index_add_(0, bucket, token_correct[valid].to(self.correct))

    def compute(self) -> torch.Tensor:
        """``[num_buckets]`` mean loss per bucket (NaN for a bucket without tokens)."""
        return (self.loss_sum / self.tokens).float()

    def accuracy(self) -> torch.Tensor:
        """``[num_buckets]`` argmax accuracy per bucket (when ``token_correct`` was given)."""
        with self.sync_context():
            return (self.correct / self.tokens).float()

    def labels(self) -> list[str]:
        upper = [str(e - 1) for e in self.edges[1:]] + ["inf"]
        return [f"{lo}-{hi}" for lo, hi in zip(self.edges, upper)]

    def as_dict(self, prefix: str = "loss_at") -> dict[str, torch.Tensor]:
        """``{f"{prefix}/{lo}-{hi}": mean loss}`` for the buckets that have tokens (for ``self.log_dict``)."""
        values = self.compute()
        return {f"{prefix}/{label}": v for label, v in zip(self.labels(), values) if not torch.isnan(v)}

    def save(self, png: "str | None" = None, csv: "str | None" = None, title: str = "loss by position") -> None:
        """Write the curve as CSV (bucket, first position, tokens, loss, accuracy) and/or a PNG (matplotlib)."""
        values, accuracy = self.compute().tolist(), self.accuracy().tolist()
        with self.sync_context():
            tokens = self.tokens.tolist()
        if csv is not None:
            with open(csv, "w") as f:
                f.write("bucket,first_position,tokens,loss,accuracy\n")
                for label, first, n, v, a in zip(self.labels(), self.edges, tokens, values, accuracy):
                    f.write(f"{label},{first},{int(n)},{v:.6f},{a:.6f}\n")
        if png is not None:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            keep = [i for i, n in enumerate(tokens) if n > 0]
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot([max(self.edges[i], 1) for i in keep], [values[i] for i in keep], marker="o")
            ax.set_xscale("log")
            ax.set_xlabel("position in the context (bucket start)")
            ax.set_ylabel("mean next-token loss")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            fig.tight_layout()
            fig.savefig(png, dpi=120)
            plt.close(fig)


def log_spaced_edges(max_position: int, num_buckets: int) -> list[int]:
    """``0`` then up to ``num_buckets - 1`` distinct, roughly log-spaced integer edges below ``max_position``."""
    import math

    edges = {0}
    for i in range(1, num_buckets):
        edges.add(int(round(math.exp(math.log(max_position) * i / num_buckets))))
    return sorted(e for e in edges if e < max_position)
