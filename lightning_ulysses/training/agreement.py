"""SP-peer agreement: every rank of an SP group must cut its shard from the SAME full batch.

If peers hold different samples (a user's own ``DistributedSampler`` over the whole world, an ``IterableDataset``
split by global rank, random augmentation seeded per rank), equal lengths train on stitched shards of different
samples with normal-looking losses, unequal lengths abort inside the all-to-all, and unequal batch counts hang. So
the collate step fingerprints the full batch before cutting the shard
(:func:`lightning_ulysses.data.fingerprint.batch_fingerprint`, in the loader's workers), and before each step's
compute the SP group compares fingerprints with one tiny all-reduce (:class:`SPAgreement`). A rank whose loader is
exhausted takes part once more with an end-of-data marker, so a peer that still has a batch fails the comparison
instead of waiting forever in its next collective.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

END_OF_DATA = -1  # the fingerprint a rank reports when its loader has no further batch
class SPPeerMismatchError(RuntimeError):
    """The ranks of an SP group do not hold the same full batch (or not the same number of batches)."""


class SPLossMismatchError(RuntimeError):
    """The loss a training step back-propagates is not the same function on every rank of an SP group."""


# Stands for NaN in the loss comparison, so that NaN on every rank reads as the same loss, not a mismatch. The check
# is one all-reduce MAX of ``[v, -v]`` that compares the group's max with its min, and NaN cannot take part: NaN != NaN,
# and how MAX treats NaN depends on the backend. So NaN becomes this finite float64 before the reduction: its negation
# is exact, no loss or gradient sum of a training step comes near it, and messages show it as "nan".
NAN_SENTINEL = -1.2345e300


def _comparable(value: float) -> float:
    return NAN_SENTINEL if value != value else value


_STEP_REPLACEMENT = (
    "    out = self.model(**batch)                 # or self.model(input_ids=batch[\"input_ids\"])\n"
    "    loss = out.loss                           # or self.trainer.strategy.cross_entropy(out.logits,"
    " batch[\"shift_labels\"])"
)


_SEQUENCE_API = (
    " Per-sequence values: `strategy.sequence_sum(values, mask)` (a sequence's log-probability for DPO/KTO/GRPO),"
    " `strategy.sequence_mean(values, mask)` (SimPO, per-sample means, mean pooling), `strategy.last_token(values)`"
    " (reward and value heads, last-token embeddings), `strategy.sequence_count(mask)` (per-row counts);"
    " per-token means: `strategy.token_mean(values, weights)`, `strategy.cross_entropy(logits, shift_labels)`;"
    " whole rows: `strategy.gather_sequence(values)` (`strategy` is `self.trainer.strategy`; see"
    " docs/post-training.md). Validation and test metrics fed from the same own shift are off too, and nothing is"
    " back-propagated there to stop them: feed them from `batch[\"shift_labels\"]`, which lines up with this"
    " rank's logits (docs/lightning-ecosystem.md, 'Metrics: torchmetrics, own shifts')."
)


_MODEL_FORM_UNCHECKED = (
    " The model-form check is off (`check_model_form=False`), so the model itself may be what differs: a model that"
    " computes something from its shard as if it were the whole sequence (positions from `torch.arange(T)`, an"
    " attention the strategy does not recognise) gives a different loss on every rank with correct loss code. Run"
    " with the check on: it names such a module before any weight changes. If it passes, the loss code is the"
    " cause:"
)


def loss_mismatch_message(ranks: list[int], where: str, low: float, high: float,
                          model_form_checked: bool = True) -> str:
    return (
        f"UlyssesDeepSpeedStrategy: the loss of the {where} differs between the ranks {ranks} of one"
        f" sequence-parallel group (from {_show(low)} to {_show(high)}); no weight was changed. Each rank holds a"
        " slice of every sequence, so a loss computed from this rank's tokens alone is a different function on every"
        " rank and would train the wrong weights." + ("" if model_form_checked else _MODEL_FORM_UNCHECKED) +
        " Likely code: (1) `F.cross_entropy(...)` on the shard's logits (a"
        " mean over this rank's tokens), also with your own shift (`logits[:, :-1]` against `input_ids[:, 1:]`,"
        " which also drops the target at every shard boundary); (2) an extra term on shard tensors, e.g."
        " `0.01 * logits.pow(2).mean()`; (3) losses combined by hand across ranks. Fix: take means over the whole"
        " sequence with the strategy's losses, which are the same number on every rank:\n" + _STEP_REPLACEMENT +
        "\nPer-token values or weights: `self.trainer.strategy.token_mean(values, weights)`,"
        " `self.trainer.strategy.cross_entropy(logits, batch[\"shift_labels\"], weight=w)`. Terms that are the same"
        " on every rank (a weight regulariser) can be added as they are. The check runs before every optimizer step;"
        " `UlyssesDeepSpeedStrategy(check_sp_agreement=False)` turns it off." + _SEQUENCE_API
    )


def shard_local_message(ranks: list[int], where: str, reached: Optional[str]) -> str:
    if reached is not None and reached.startswith("two sequence-parallel reductions"):
        return (
            f"UlyssesDeepSpeedStrategy: the loss of the {where} reduces over the sequence-parallel group values that"
            f" were reduced over it already ({reached}), on the ranks {ranks}; no weight was changed. After one SP"
            " reduction (`strategy.sequence_sum`/`sequence_mean`/`cross_entropy`/`token_mean`, or a"
            " torch.distributed.nn collective over the SP group) every rank holds the whole sequence's value: a"
            " second one counts it once per rank. Reduce once. (The loss code of DeepSpeed's / accelerate's Ulysses"
            " tutorial does this: a differentiable all-gather of every rank's loss, weighted by its token count. The"
            " strategy's losses, `self.model(**batch).loss`, `strategy.cross_entropy`, `strategy.token_mean`, already"
            " are the whole batch's token mean with exact gradients: return them as they are.)" + _SEQUENCE_API
        )
    if reached is not None and reached.startswith("torch.distributed.nn"):
        return (
            f"UlyssesDeepSpeedStrategy: the loss of the {where} reduces the model's sharded values with {reached}"
            f" (the ranks {ranks} of one sequence-parallel group); no weight was changed. A collective counts as a"
            " sequence-parallel reduction only over the SP group: over the world it also sums the rows of other"
            " data-parallel replicas (DeepSpeed averages the gradients over those already), over a smaller group it"
            " leaves part of each sequence out. Pass `group=strategy.sp_group`, or use the strategy's reductions."
            + _SEQUENCE_API
        )
    return (
        f"UlyssesDeepSpeedStrategy: the loss of the {where} depends on this rank's shard of the model's activations"
        f" through local operations only (its autograd graph reaches the model's sharded computation `{reached}`"
        " without an SP reduction), on the ranks"
        f" {ranks} of one sequence-parallel group; no weight was changed. Each rank holds a slice of every sequence,"
        " so a mean or sum over this rank's tokens is a different function on every rank, even where its value"
        " happens to agree (DPO's first step: policy = reference gives log 2 on every rank). Reduce over the whole"
        " sequence with the strategy's API instead." + _SEQUENCE_API
    )


def non_finite_loss_message(ranks: list[int], where: str, value: str) -> str:
    return (
        f"UlyssesDeepSpeedStrategy: the loss of the {where} is {value} on every rank {ranks} of one sequence-parallel"
        " group; no weight was changed (a non-finite loss is never counted as agreement: DeepSpeed would apply its"
        " finite gradients). Under SP a NaN is usually a per-row mean over this rank's shard, in which some rows"
        " have no target tokens (0 / 0), e.g. `(logps * mask).sum(-1) / mask.sum(-1)`: take it over the whole"
        " sequence; an inf, a log of zero or a division by a zero count in the loss code." + _SEQUENCE_API
    )


def gradient_mismatch_message(ranks: list[int], where: str, low: list[float], high: list[float]) -> str:
    """``low``/``high``: the group's min/max of (number of SP losses back-propagated, sum of their gradients, ...)."""
    if low[0] != high[0]:
        detail = f"the strategy's SP losses were back-propagated {int(low[0])} to {int(high[0])} times per rank"
    else:
        detail = f"the gradients reaching them sum to {_show(low[1])} .. {_show(high[1])} across the ranks"
    return (
        f"UlyssesDeepSpeedStrategy: the loss of the {where} is the same number on the ranks {ranks} of one"
        f" sequence-parallel group, but not the same function of the strategy's SP losses: {detail}; no weight was"
        " changed. This is what combining per-rank losses with rank-dependent weights does, e.g. the loss code of"
        " DeepSpeed's / accelerate's Ulysses tutorial (a differentiable all-gather of every rank's loss, weighted by"
        " its token count). The strategy's losses (`self.model(**batch).loss`, `strategy.cross_entropy`,"
        " `strategy.token_mean`) already are the whole batch's token mean with exact gradients: return them as they"
        " are (scaling or adding terms that are the same on every rank is fine):\n" + _STEP_REPLACEMENT
    )


def parameters_mismatch_message(ranks: list[int], where: str, low: list[int], high: list[int], total: int,
                                unreached_here: list[str]) -> str:
    shown = ", ".join(unreached_here[:6]) + (f" and {len(unreached_here) - 6} more" if len(unreached_here) > 6 else "")
    here = (f"on this rank {len(unreached_here)} of them get no gradient ({shown})" if unreached_here else
            "on this rank every one of them gets a gradient")
    return (
        f"UlyssesDeepSpeedStrategy: the loss of the {where} reaches different trainable parameters on the ranks"
        f" {ranks} of one sequence-parallel group ({low[0]} to {high[0]} of {total} get a gradient); {here}; no weight"
        " was changed. A parameter used for some tokens only (an MoE expert that no token of a rank's shard is routed"
        " to and that the forward then skips, a branch taken for some positions) gets a gradient on the ranks whose"
        " shard uses it and none on the others. DeepSpeed's ZeRO gradient reduction then fills its buckets"
        " differently on each rank: it sums slices of different parameters, or aborts where the sizes differ. Make"
        " every such parameter take part on every rank: run every expert, also on an empty slice of tokens (its"
        " weights are then in the graph with a zero gradient), or keep the experts in one tensor (transformers'"
        " fused experts, `gate_up_proj` [E, ...])."
    )


_WHOLE_ROW_COUNTS = (
    " Per-row counts over the whole sequence: `strategy.sequence_count(mask)`; per-row sums and means:"
    " `strategy.sequence_sum`, `strategy.sequence_mean` (docs/post-training.md)."
)


def sample_weights_from_shard_message(what: str, shape: str) -> str:
    """Per-sample weights (``shape``: how they were given) that differ between the SP ranks."""
    return (
        f"{what}: the per-sample weights {shape} differ between the ranks of a sequence-parallel group, so they were"
        " computed from this rank's shard (e.g. `1 / (batch[\"shift_labels\"] != -100).sum(1)`, which counts this"
        " rank's targets only); no weight was changed." + _WHOLE_ROW_COUNTS
    )


def row_weights_from_shard_message(what: str, rows: list[int], low: float, high: float) -> str:
    """``[B, s]`` weights that hold one value per row on each SP rank, a different one on each rank (``rows``: those
    rows; ``low``/``high``: the first one's smallest and largest value over the ranks)."""
    shown = ", ".join(str(r) for r in rows[:8]) + (f" and {len(rows) - 8} more" if len(rows) > 8 else "")
    return (
        f"UlyssesDeepSpeedStrategy: {what}: the weights [B, s] hold one value per row on each rank of a"
        f" sequence-parallel group, but not the same one on every rank (rows {shown}; row {rows[0]}: from"
        f" {_show(low)} to {_show(high)}); no weight was changed. Such weights were computed from this rank's shard: a"
        " per-row statistic of this rank's tokens broadcast over them, e.g. `mask * (adv / mask.sum(1))[:, None]`,"
        " where `mask.sum(1)` counts only this rank's tokens of each row. Every rank then weights its part of a row"
        " differently, and the sum is not the one-device sum (the update is silently wrong). Take the whole row's"
        " count: `mask * (adv / strategy.sequence_count(mask))[:, None]`, or the per-row mean itself:"
        " `strategy.sequence_mean(values * adv[:, None], mask)`; per-row sums: `strategy.sequence_sum(values, mask)`"
        " (docs/post-training.md). Weights that are the same on every rank (bool or 0/1 masks, `mask * adv[:, None]`)"
        " or vary along a row pass. The check is part of"
        " `UlyssesDeepSpeedStrategy(check_sp_agreement=True)`, the default."
    )


def _show(value: float) -> str:
    return "nan" if value == NAN_SENTINEL else f"{value:.9g}"


class SPAgreement:
    """Compares the batch every rank of an SP group is about to train on (one all-reduce of 6 int64 per step).

    Args:
        group: the SP group.
        group_ranks: its global ranks (for the error message).
        device: where the collective's tensor lives (CUDA for nccl).
    """

    def __init__(self, group: dist.ProcessGroup, group_ranks: list[int], device: torch.device) -> None:
        self.group = group
        self.group_ranks = group_ranks
        self.device = device

    def verify(self, fingerprint: int, seq_len: int, batch_size: int, where: str) -> None:
        """Raise :class:`SPPeerMismatchError` on every rank of the group unless all hold the same batch."""
        # [6] int64: (S, B, fp) and their negatives; MAX over the group gives each one's max and -min.
        values = torch.tensor([seq_len, batch_size, fingerprint], dtype=torch.int64)
        both = torch.cat([values, -values]).to(self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = both[:3].tolist(), [-v for v in both[3:].tolist()]
        if high != low:
            raise SPPeerMismatchError(self._message(where, high, low))

    def verify_loss(self, value: torch.Tensor, incoming: list[torch.Tensor], where: str,
                    shard_local: Optional[str] = None, model_form_checked: bool = True) -> None:
        """Raise on every rank of the group unless the loss a step back-propagated is the same finite number on
        every rank, depends on the model's sharded computation only through SP reductions (``shard_local``: the
        sharded computation this rank's loss reached without one, from
        :func:`~lightning_ulysses.training.loss_graph.shard_local_path`), and the gradient that reached each of the
        strategy's SP losses is the same on every rank (one all-reduce of 10 float64 per backward pass)."""
        gradients = [float(g.double().sum()) for g in incoming]
        loss = float(value.detach().double().sum()) if value.numel() == 1 else float("nan")
        values = torch.tensor([_comparable(loss), float(len(gradients)), sum(gradients),
                               sum((i + 1) * g for i, g in enumerate(gradients)), float(shard_local is not None)],
                              dtype=torch.float64)
        # NaN becomes a sentinel (NaN compares unequal to itself); infinities stay infinities (nan_to_num's default
        # would make +inf the largest float, a finite number every rank agrees on)
        values = torch.nan_to_num(values, nan=NAN_SENTINEL, posinf=float("inf"), neginf=float("-inf"))
        both = torch.cat([values, -values]).to(self.device)  # [10]: MAX over the group gives max and -min of each
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = both[:5].tolist(), [-v for v in both[5:].tolist()]
        if high[0] != low[0]:
            raise SPLossMismatchError(loss_mismatch_message(self.group_ranks, where, low[0], high[0],
                                                            model_form_checked))
        if high[0] == NAN_SENTINEL or abs(high[0]) == float("inf"):
            raise SPLossMismatchError(non_finite_loss_message(self.group_ranks, where, _show(high[0])))
        if high[4] > 0:
            raise SPLossMismatchError(shard_local_message(self.group_ranks, where, shard_local))
        if high[1:4] != low[1:4]:
            raise SPLossMismatchError(gradient_mismatch_message(self.group_ranks, where, low[1:4], high[1:4]))

    def verify_parameters_reached(self, reached: list[bool], names: list[str], where: str) -> None:
        """Raise on every rank of the group unless the loss about to be back-propagated reaches the same trainable
        parameters on every rank (``reached[i]``: the ``i``-th trainable parameter, ``names[i]``, is in this rank's
        graph). Before backward: DeepSpeed's gradient reduction during backward assumes the same parameters get a
        gradient on every rank. One all-reduce of 4 int64."""
        count = sum(reached)
        # a hash of which ones: sum of a multiplicative hash of each reached index (exact in int64)
        digest = sum(((i + 1) * 2654435761) % (1 << 31) for i, r in enumerate(reached) if r)
        values = torch.tensor([count, digest], dtype=torch.int64)
        both = torch.cat([values, -values]).to(self.device)  # [4]: MAX over the group gives max and -min of each
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        read = both.tolist()  # one device read
        high, low = read[:2], [-v for v in read[2:]]
        if high != low:
            unreached = [name for name, r in zip(names, reached) if not r]
            raise SPLossMismatchError(parameters_mismatch_message(self.group_ranks, where, low, high, len(reached),
                                                                  unreached))

    def verify_end_of_data(self, where: str) -> None:
        """Called when this rank's loader is exhausted; fails if a peer still has a batch."""
        self.verify(END_OF_DATA, END_OF_DATA, END_OF_DATA, where)

    def _message(self, where: str, high: list[int], low: list[int]) -> str:
        if low[2] == END_OF_DATA:
            what = ("some ranks' data loaders ran out of batches while others still had one (unequal numbers of"
                    " batches)")
        elif high[0] != low[0] or high[1] != low[1]:
            what = (f"the ranks hold full batches of different shapes ([B, S] from [{low[1]}, {low[0]}] to"
                    f" [{high[1]}, {high[0]}])")
        else:
            what = "the ranks hold different full batches of the same shape (their contents differ)"
        return (
            f"UlyssesDeepSpeedStrategy: the ranks {self.group_ranks} of one sequence-parallel group must train on the"
            f" SAME full batch ({where}), and {what}. The strategy cuts every rank's shard from the full batch, so"
            " SP peers must read identical samples; only data-parallel replicas read different ones. Likely causes:"
            " (1) your own `DistributedSampler(dataset)`: it splits over all ranks; use"
            " `DistributedSampler(dataset, num_replicas=trainer.strategy.dp_size, rank=trainer.strategy.dp_rank)` or"
            " let Lightning add the sampler (`use_distributed_sampler=True`, the default);"
            " (2) an `IterableDataset` that splits its stream by global rank: split by `trainer.strategy.dp_rank`"
            " of `trainer.strategy.dp_size` instead;"
            " (3) random cropping/augmentation seeded per rank (e.g. `worker_init_fn` using the global rank, or"
            " per-rank seeds): seed it by the data-parallel rank. The check runs before every step; turn it off"
            " with `UlyssesDeepSpeedStrategy(check_sp_agreement=False)` only if your peers provably agree."
        )
