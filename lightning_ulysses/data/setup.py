"""What the strategy does to every DataLoader Lightning prepares (``strategy.process_dataloader``): samplers split over
the world are refused, workers are seeded by the data-parallel rank, the sequence-sharding collate step is installed
(given back in teardown), and the layers of :func:`lightning_ulysses.data.loaders.prepare_loader` are added, feeding the
queue of the step kind the loader serves. litdata's streaming datasets, which split their stream themselves, are split
over the data-parallel replicas (:mod:`lightning_ulysses.data.litdata_streams`)."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

from lightning_ulysses import _compat
from lightning_ulysses.data.litdata_streams import split_streams_by_dp
from lightning_ulysses.data.loaders import ShardInfoQueue, prepare_loader, restore_loader
from lightning_ulysses.data.sharding import install_sharding_collate
from lightning_ulysses.parallel.layout import SequenceParallelLayout
from lightning_ulysses.patches import PatchStack


def prepare_dataloader(dataloader: Any, layout: SequenceParallelLayout, queues: Mapping[str, ShardInfoQueue],
                       accumulation: int, end_of_data_check: Optional[Callable[[str], None]], trainer: Any,
                       pad_token_id: int, patches: PatchStack) -> Any:
    """``dataloader`` (as Lightning's ``DeepSpeedStrategy.process_dataloader`` returned it) with the strategy's
    sequence sharding and layers, feeding ``queues[kind]`` of the step kind it serves; the collate function of the
    object handed in is given back when ``patches`` closes. ``end_of_data_check(where)``: the SP peers' check when
    the loader is exhausted (``None``: the agreement checks are off, and batches are not fingerprinted)."""
    check_sampler(dataloader, layout)
    seed_workers_by_dp_rank(dataloader, layout.dp_rank)
    fingerprint = end_of_data_check is not None
    dataloader = install_sharding_collate(dataloader, layout.sp_size, layout.sp_rank, pad_token_id,
                                          fingerprint=fingerprint, ring_size=layout.ring_size)
    patches.apply(f"{type(dataloader).__name__}: sequence-sharding collate",
                  lambda: None, lambda loader=dataloader: restore_loader(loader))
    split_streams_by_dp(dataloader, layout, patches)  # litdata's streams: split by the dp replicas, not the world
    kind = loader_kind(trainer)
    on_exhausted = None
    if end_of_data_check is not None:
        on_exhausted = lambda: end_of_data_check(f"end of the {kind} data")  # noqa: E731

    def epoch_batches() -> float:  # the batches Lightning takes from the train loader this epoch
        return float(trainer.num_training_batches) if trainer is not None else float("inf")

    def continue_epoch_at(batch: int) -> None:
        if trainer is not None:
            _compat.continue_epoch_at(trainer, batch)

    return prepare_loader(dataloader, queues[kind], train=kind == "train",
                          accumulation=accumulation, epoch_batches=epoch_batches,
                          on_position_change=continue_epoch_at, on_exhausted=on_exhausted)


def check_sampler(dataloader: Any, layout: SequenceParallelLayout) -> None:
    """All ranks of an SP group must read the same samples: refuse a DistributedSampler split over the world."""
    sampler = getattr(dataloader, "sampler", None)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
        message = sampler_split_error(candidate, layout.dp_size, layout.dp_rank, layout.sp_size)
        if message is not None:
            raise ValueError(message)


def seed_workers_by_dp_rank(dataloader: Any, dp_rank: int) -> None:
    """``seed_everything(workers=True)`` makes Lightning seed DataLoader workers by the *global* rank, so SP peers
    would draw different random crops; seed them by the data-parallel rank instead (SP peers alike, replicas
    apart; with ``sp_size=1`` this is Lightning's seeding)."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", 0) is None:
        from functools import partial

        from lightning.fabric.utilities.seed import pl_worker_init_function

        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=dp_rank)


def loader_kind(trainer: Any) -> str:
    """Which step kind the loader being prepared feeds: "train", "validate" (also the sanity check), "test" or
    "predict"."""
    if trainer is None or trainer.training:
        return "train"
    if trainer.testing:
        return "test"
    if trainer.predicting:
        return "predict"
    return "validate"


def sampler_split_error(sampler: Any, dp_size: int, dp_rank: int, sp_size: int) -> Optional[str]:
    """The error for a ``DistributedSampler`` that does not split over the data-parallel replicas (``None`` if fine)."""
    from torch.utils.data import DistributedSampler

    if not isinstance(sampler, DistributedSampler):
        return None
    if (sampler.num_replicas, sampler.rank) == (dp_size, dp_rank):
        return None
    return (
        f"The DataLoader's DistributedSampler splits the data over {sampler.num_replicas} replicas (this rank:"
        f" {sampler.rank}), but under UlyssesDeepSpeedStrategy(sp_size={sp_size}) all ranks of a sequence-parallel"
        f" group must read the same samples: split over the {dp_size} data-parallel replicas, i.e."
        f" `DistributedSampler(dataset, num_replicas=trainer.strategy.dp_size, rank=trainer.strategy.dp_rank)`"
        f" (here num_replicas={dp_size}, rank={dp_rank}), or pass no sampler and let Lightning add it"
        " (`use_distributed_sampler=True`, the default)."
    )
