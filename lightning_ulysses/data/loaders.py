"""The layers the strategy adds to a DataLoader Lightning prepared, in one place and one order.

Each layer is a wrapper object around the loader (or around the next layer): it iterates its inner loader and adds
one thing; any other attribute (``sampler``, ``dataset``, ``batch_size``, ...) and ``len()`` are the inner loader's.
The DataLoader object Lightning handed over is not changed by them (its collate function is, and
:func:`restore_loader` gives it back in teardown). From the inside out (:func:`prepare_loader`):

1. **resume position** (train): knows how many batches of which epoch it handed out; on ``fit(ckpt_path=...)``
   skips exactly those (at the index level: no skipped sample is loaded), also when the global batch changed;
2. **accumulation window** (train, ``accumulate_grad_batches > 1``): reads one gradient-accumulation window ahead
   and gives each batch's :class:`~lightning_ulysses.context.ShardInfo` the target-token count of its window;
3. **step state** (every loader, outermost): takes each batch's ``ShardInfo`` out of the batch as it leaves the
   loader and queues it for its step; calls the end-of-data check when the loader is exhausted.

The sequence-sharding collate step itself is :func:`lightning_ulysses.data.sharding.install_sharding_collate`.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_ulysses.context import IGNORE_INDEX, SHARD_INFO_KEY, ShardInfo
from lightning_ulysses.data.sharding import SHIFT_LABELS


def prepare_loader(dataloader: Any, queue: "ShardInfoQueue", *, train: bool, accumulation: int = 1,
                   epoch_batches: Callable[[], float] = lambda: float("inf"),
                   on_position_change: Optional[Callable[[int], None]] = None,
                   on_exhausted: Optional[Callable[[], None]] = None) -> "LoaderLayer":
    """The strategy's layers around ``dataloader``, in their one order (see the module docstring)."""
    skipped: Callable[[], int] = lambda: 0  # noqa: E731
    if train:
        dataloader = install_resumable_loader(dataloader, on_position_change)
        if isinstance(dataloader, ResumePosition):
            skipped = dataloader.skipped_this_epoch
    if train and accumulation > 1:
        dataloader = AccumulationWindow(dataloader, accumulation, epoch_batches, skipped)
    return StepState(dataloader, queue, on_exhausted)


def restore_loader(dataloader: Any) -> None:
    """Give the loader object the strategy was handed back its own collate function (the one change made to an
    object the strategy did not create: it may be the user's own DataLoader)."""
    from lightning_ulysses.data.sharding import SequenceShardingCollate

    collate = getattr(dataloader, "collate_fn", None)
    if isinstance(collate, SequenceShardingCollate):
        dataloader.collate_fn = collate.collate_fn


class LoaderLayer:
    """A wrapper around ``inner`` (a DataLoader or another layer) that adds one thing to its iteration; every other
    attribute, read or set, and ``len()`` are the inner loader's (Lightning sets sampler epochs and reads batch sizes
    through them)."""

    _own: tuple[str, ...] = ("inner",)

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str) -> Any:  # only for names the layer does not have itself
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def dataloader(self) -> Any:
        """The DataLoader inside all layers."""
        inner = self.inner
        return inner.dataloader if isinstance(inner, LoaderLayer) else inner

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------- resume position
class _SkipFirst:
    """A batch sampler (or sampler) without its first ``skip`` entries (their indices are never handed to the
    dataset)."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batch_sampler)
        for _ in range(self.skip):
            if next(iterator, None) is None:
                return
        yield from iterator

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)


def _sampler_epoch(loader: Any) -> Optional[int]:
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if hasattr(sampler, "epoch"):
            return int(sampler.epoch)
    return None


def _global_batch(loader: Any) -> Optional[int]:
    """Samples per step over all replicas: the loader's batch size × the sampler's number of replicas."""
    batch_size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size",
                                                                None)
    if batch_size is None:
        return None
    sampler = getattr(loader, "sampler", None)
    return int(batch_size) * int(getattr(sampler, "num_replicas", 1))


def skipping_loader(loader: DataLoader, skip: int) -> DataLoader:
    """A DataLoader over the same data, batches, collate function and workers as ``loader`` without its first
    ``skip`` batches (for one resumed epoch; the skipped samples are never loaded). A DataLoader subclass runs this
    epoch as a plain DataLoader with its dataset, batch sampler and settings."""
    batched = loader.batch_sampler is not None
    order = _SkipFirst(loader.batch_sampler if batched else loader.sampler, skip)
    workers = loader.num_workers
    return DataLoader(
        loader.dataset,
        batch_size=1 if batched else None,  # 1: DataLoader's default, required next to a batch sampler
        sampler=None if batched else order,
        batch_sampler=order if batched else None,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=False,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


class ResumePosition(LoaderLayer):
    """A train DataLoader that knows its position: ``state_dict()`` gives the epoch (its sampler's) and the number of
    batches handed out in it; after ``load_state_dict()``, the next iteration of *that* epoch skips those batches.

    Lightning saves the state of such ("stateful") loaders in the checkpoint and loads it on resume before iterating.
    The resumed epoch runs on :func:`skipping_loader`, so the skipped samples are never loaded. A checkpoint saved at
    the end of an epoch resumes with the next epoch, unskipped.
    """

    _own = ("inner", "position", "resume", "skipped", "on_position_change")

    def __init__(self, inner: DataLoader, on_position_change: Optional[Callable[[int], None]] = None) -> None:
        super().__init__(inner)
        self.position: tuple[Optional[int], int] = (None, 0)  # (epoch, batches handed out in it)
        self.resume: Optional[dict[str, Any]] = None
        self.skipped = 0  # batches of the current epoch skipped at its start (resume)
        self.on_position_change = on_position_change

    def skipped_this_epoch(self) -> int:
        return self.skipped

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self.position
        return {"epoch": epoch, "batches": batches, "global_batch": _global_batch(self.inner)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved, current = state.get("global_batch"), _global_batch(self.inner)
        if state.get("batches") and saved is not None and current is not None and saved != current:
            # The epoch's order is one shuffled permutation consumed `global batch` samples per step whatever dp is,
            # so the position is a number of samples: continue at the last step boundary of this run at or before it.
            seen = int(state["batches"]) * int(saved)
            state["batches"] = seen // current
            again = seen - state["batches"] * current
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(
                f"The checkpoint was taken {seen} samples into epoch {state.get('epoch')} with {saved} samples per"
                f" step (micro-batch × data-parallel replicas); this run reads {current} per step, so the epoch"
                f" continues at its sample {state['batches'] * current} (batch {state['batches']})"
                + (f", {again} samples of the previous step seen again" if again else "")
                + ". The steps from here are not those of the uninterrupted run (another global batch); keep"
                " micro-batch × dp the same for an exact continuation."
            )
            if self.on_position_change is not None:
                self.on_position_change(state["batches"])
        self.resume = state

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs at the first next(), after Lightning has set the sampler's epoch.
        epoch = _sampler_epoch(self.inner)
        resume, self.resume = self.resume, None
        skip = 0
        if resume and resume.get("batches") and resume.get("epoch") == epoch:
            skip = int(resume["batches"])
            if skip >= len(self.inner):
                skip = 0  # the epoch was complete: Lightning has moved on to the next one
        self.skipped = skip
        position = skip
        for batch in (skipping_loader(self.inner, skip) if skip else self.inner):
            position += 1
            self.position = (epoch, position)
            yield batch


def install_resumable_loader(dataloader: Any, on_position_change: Optional[Callable[[int], None]] = None) -> Any:
    """The train DataLoader inside a :class:`ResumePosition` layer; loaders over an ``IterableDataset`` (no index to
    skip to) are returned unchanged. ``on_position_change(batch)``: called when a resume with another global batch
    continues the epoch at ``batch`` (the strategy aligns Lightning's count of the epoch's batches with it)."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return dataloader
    return ResumePosition(dataloader, on_position_change)


# ----------------------------------------------------------------------------------------------- accumulation window
class AccumulationWindow(LoaderLayer):
    """Adds look-ahead: batches are read one gradient-accumulation window at a time, and each batch's
    :class:`ShardInfo` gets this rank's count of target tokens over its whole window, so the loss can weight every
    token of the window equally, as one larger batch would.

    Windows are Lightning's: every epoch starts a window, one ends every ``window`` batches and at the end of the
    epoch (the batches Lightning takes: ``epoch_batches()``, with ``limit_train_batches`` applied). A resumed epoch
    (``skipped()`` batches skipped at its start) continues the window its first batch belongs to."""

    _own = ("inner", "window", "epoch_batches", "skipped")

    def __init__(self, inner: Any, window: int, epoch_batches: Callable[[], float],
                 skipped: Callable[[], int]) -> None:
        super().__init__(inner)
        self.window = window
        self.epoch_batches = epoch_batches
        self.skipped = skipped

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.inner)
        first = next(iterator, _END)  # the resume layer knows what it skipped once its iteration has begun
        if first is _END:
            return
        iterator = itertools.chain([first], iterator)
        skipped = self.skipped()
        remaining = self.epoch_batches() - skipped
        size = self.window - skipped % self.window
        while remaining > 0:
            window = [batch for _, batch in zip(range(int(min(size, remaining))), iterator)]
            if not window:
                return
            remaining -= len(window)
            tokens = sum((b[SHIFT_LABELS] != IGNORE_INDEX).sum() for b in window if SHIFT_LABELS in b)
            for batch in window:
                if SHARD_INFO_KEY in batch:
                    batch[SHARD_INFO_KEY].window_tokens = torch.as_tensor(tokens)
                yield batch
            size = self.window
        yield from iterator  # past Lightning's epoch length: not trained (Lightning stops first)


_END = object()


# ----------------------------------------------------------------------------------------------- step state
class ShardInfoQueue:
    """The :class:`ShardInfo` of every batch a loader handed out whose step has not run yet, oldest first.

    Lightning fetches one batch ahead (and a sequence of validation loaders runs the next loader's first fetch
    before the previous loader's last step), so the facts of a step's batch are a queue, not one slot. Each entry
    remembers the loader iteration it came from, so a new iteration of a loader drops what an abandoned iteration of
    the same loader left behind (``max_steps`` reached with a batch prefetched), and nothing else.
    """

    def __init__(self) -> None:
        self._entries: deque[tuple[object, ShardInfo]] = deque()

    def push(self, iteration: object, shard: ShardInfo) -> None:
        self._entries.append((iteration, shard))

    def pop(self) -> Optional[ShardInfo]:
        return self._entries.popleft()[1] if self._entries else None

    def drop(self, iterations: set) -> None:
        self._entries = deque(entry for entry in self._entries if entry[0] not in iterations)

    def __len__(self) -> int:
        return len(self._entries)


class StepState(LoaderLayer):
    """Outermost layer of a prepared DataLoader: takes each batch's :class:`ShardInfo` out of the batch as it leaves
    the loader (before Lightning's or the user's hooks can drop or trip over it) and queues it for the step; when the
    loader is exhausted it calls ``on_exhausted`` (the SP-peer end-of-data check)."""

    _own = ("inner", "queue", "on_exhausted", "iterations")

    def __init__(self, inner: Any, queue: ShardInfoQueue, on_exhausted: Optional[Callable[[], None]] = None) -> None:
        super().__init__(inner)
        self.queue = queue
        self.on_exhausted = on_exhausted
        self.iterations: set = set()  # this loader's iterations whose entries the queue may still hold

    def __iter__(self) -> Iterator[Any]:
        self.queue.drop(self.iterations)
        iteration = object()
        self.iterations.add(iteration)
        for batch in self.inner:
            if not isinstance(batch, dict) or SHARD_INFO_KEY not in batch:
                raise RuntimeError(
                    "A batch left the DataLoader without the strategy's sequence-sharding step (its collate_fn was"
                    f" replaced after Lightning prepared the loader?): got {type(batch).__name__}."
                )
            self.queue.push(iteration, batch.pop(SHARD_INFO_KEY))
            yield batch
        if self.on_exhausted is not None:
            self.on_exhausted()
