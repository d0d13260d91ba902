"""The strategy's DataLoader hooks: every loader Lightning prepares gets the sequence-sharding collate step and the
layers of :func:`lightning_ulysses.loaders.prepare_loader`; samplers split over the world are refused, workers are
seeded by the data-parallel rank, and a resume with another global batch moves Lightning's batch count. Mixed into
:class:`~lightning_ulysses.UlyssesDeepSpeedStrategy` before Lightning's ``DeepSpeedStrategy``."""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ulysses.agreement import sampler_split_error
from lightning_ulysses.data import automatic_batching_off_error, install_sharding_collate
from lightning_ulysses.loaders import ShardInfoQueue, prepare_loader


class LoaderHooks:
    """``process_dataloader`` and what it needs; reads the strategy's layout, step context and agreement check."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        self._check_sampler(dataloader)
        self._seed_workers_by_dp_rank(dataloader)
        fingerprint = self._agreement is not None
        dataloader = install_sharding_collate(dataloader, self.sp_size, self.sp_rank, self._pad_token_id(),
                                              fingerprint=fingerprint, ring_size=self.ring_size)
        self._prepared_loaders.append(dataloader)  # its collate function is given back in teardown
        accumulation = self._context.accumulation if self._context is not None else 1
        trainer = getattr(self.lightning_module, "_trainer", None)
        kind = _loader_kind(trainer)
        on_exhausted = None
        if self._agreement is not None:
            agreement = self._agreement
            on_exhausted = lambda: agreement.verify_end_of_data(where=f"end of the {kind} data")  # noqa: E731
        dataloader = prepare_loader(dataloader, self._step_queues.setdefault(kind, ShardInfoQueue()),
                                    train=kind == "train", accumulation=accumulation,
                                    epoch_batches=self._batches_in_epoch, on_position_change=self._continue_epoch_at,
                                    on_exhausted=on_exhausted)
        return dataloader

    def _continue_epoch_at(self, batch: int) -> None:
        """A resume with another global batch continues the epoch at ``batch`` of this run's batches: Lightning's
        count of the epoch's batches (restored from the checkpoint in the saving run's batches) follows, so the
        epoch ends with the loader."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        shift = batch - current.ready  # keep the saved counts' differences (a save inside the batch's end hooks)
        current.ready, current.started = current.ready + shift, current.started + shift
        current.processed, current.completed = current.processed + shift, current.completed + shift

    def _check_sampler(self, dataloader: Any) -> None:
        """All ranks of an SP group must read the same samples: refuse a DistributedSampler split over the world."""
        sampler = getattr(dataloader, "sampler", None)
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
            message = sampler_split_error(candidate, self.dp_size, self.dp_rank, self.sp_size)
            if message is not None:
                raise ValueError(message)

    def _seed_workers_by_dp_rank(self, dataloader: Any) -> None:
        """``seed_everything(workers=True)`` makes Lightning seed DataLoader workers by the *global* rank, so SP peers
        would draw different random crops; seed them by the data-parallel rank instead (SP peers alike, replicas
        apart; with ``sp_size=1`` this is Lightning's seeding)."""
        if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", 0) is None:
            from functools import partial

            from lightning.fabric.utilities.seed import pl_worker_init_function

            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=self.dp_rank)

    @override
    def _auto_select_batch_size(self) -> int:
        # Lightning reads `train_dataloader.batch_sampler.batch_size`, an AttributeError for an unbatched loader.
        data_source = self.lightning_module.trainer.fit_loop._data_source
        if data_source.is_defined():
            loader = data_source.dataloader()
            if isinstance(loader, DataLoader) and loader.batch_sampler is None:
                raise ValueError(automatic_batching_off_error())
        return super()._auto_select_batch_size()

    def _batches_in_epoch(self) -> float:
        """How many batches Lightning takes from the train loader this epoch (``limit_train_batches`` applied)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        return float(trainer.num_training_batches) if trainer is not None else float("inf")

    def _pad_token_id(self) -> int:
        for model in self._prepared_models:
            pad = getattr(model.config, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return 0


def _loader_kind(trainer: Any) -> str:
    """Which step kind the loader being prepared feeds: "train", "validate" (also the sanity check), "test" or
    "predict"."""
    if trainer is None or trainer.training:
        return "train"
    if trainer.testing:
        return "test"
    if trainer.predicting:
        return "predict"
    return "validate"
