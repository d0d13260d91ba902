"""Callbacks: throughput that counts each sample once under sequence parallelism, and a progress bar of optimizer
steps for runs bounded by ``max_steps``."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import ThroughputMonitor, TQDMProgressBar


def _local_batch_size(batch: Any) -> int:
    return int(batch["input_ids"].shape[0])


class SequenceParallelThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` for :class:`~lightning_ulysses.UlyssesDeepSpeedStrategy`.

    The stock monitor multiplies per-device numbers by ``trainer.world_size``, which counts every sample ``sp`` times
    (all SP peers hold the same samples). This one multiplies by the data-parallel size, and its default
    ``length_fn`` counts the full sequence (the shard length × ``sp``), so ``samples_per_sec`` and ``items_per_sec``
    (tokens) count each sample and each token once. Per-device values (``device/...``) are per SP group member.

    Args:
        batch_size_fn: samples in a batch (default: ``batch["input_ids"].shape[0]``).
        length_fn: tokens of the full sequences of a batch (default: shard length × sp × batch size).
        **kwargs: passed to :class:`lightning.fabric.utilities.throughput.Throughput` (``window_size``, ...).
    """

    def __init__(self, batch_size_fn: Callable[[Any], int] = _local_batch_size,
                 length_fn: Optional[Callable[[Any], int]] = None, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=batch_size_fn, length_fn=length_fn, **kwargs)
        self._sp_size = 1

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        strategy = trainer.strategy
        dp_size = getattr(strategy, "dp_size", trainer.world_size)
        self._sp_size = trainer.world_size // dp_size
        if self.length_fn is None:
            self.length_fn = lambda batch: int(batch["input_ids"].numel()) * self._sp_size
        for throughput in self._throughputs.values():
            throughput.world_size = dp_size


class StepProgressBar(TQDMProgressBar):
    """Lightning's TQDM progress bar, counting optimizer steps out of the run's total ("Step: 120/150") across
    epochs, where Lightning's counts the batches of the current epoch ("Epoch 0", whose length says nothing about a
    run that ``max_steps`` ends). The total is ``trainer.estimated_stepping_batches`` (``max_steps``, or fewer when
    ``max_epochs`` ends the run first; accumulation counted); where that is unknown (an iterable dataset without a
    length and no ``max_steps``) it is Lightning's bar.

    ``Trainer(..., max_steps=150, callbacks=[StepProgressBar()])``
    """

    _total: Optional[int] = None  # the run's optimizer steps, read at each epoch's start

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        self._total = total = _total_steps(trainer)
        if total is None:
            return super().on_train_epoch_start(trainer, *args)
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar  # one bar for the whole run: not reset at an epoch's start
        bar.total, bar.initial = total, 0
        bar.set_description("Step", refresh=False)
        self._show(bar, trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._total is None:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        if bar is not None and self._should_update(trainer.global_step, bar.total):
            self._show(bar, trainer.global_step)
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @staticmethod
    def _show(bar: Any, steps: int) -> None:
        if not bar.disable:
            bar.n = steps
            bar.refresh()


def _total_steps(trainer: Any) -> Optional[int]:
    """The run's optimizer steps, or ``None`` where Lightning cannot know them."""
    total = trainer.estimated_stepping_batches
    return int(total) if total != float("inf") else None
