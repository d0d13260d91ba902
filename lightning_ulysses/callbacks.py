"""Callbacks that count each sample once under sequence parallelism."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import ThroughputMonitor


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
