"""The layers the strategy adds to a DataLoader Lightning prepared, in one place and one order.

Each layer is a mixin: the loader (same sampler, collate, workers, state) is copied into an instance of a subclass
with the mixin in front (:func:`_with_layer`; the object Lightning handed over is not changed by it). From the inside
out (:func:`prepare_loader`):

1. **accumulation window** (train, ``accumulate_grad_batches > 1``): reads one gradient-accumulation window ahead
   and gives each batch's :class:`~lightning_ulysses.context.ShardInfo` the target-token count of its window;
2. **resume position** (train): knows how many batches of which epoch it handed out; on ``fit(ckpt_path=...)``
   skips exactly those (at the index level: no skipped sample is loaded), also when the global batch changed;
3. **step state** (every loader, outermost): takes each batch's ``ShardInfo`` out of the batch as it leaves the
   loader and queues it for its step; calls the end-of-data check when the loader is exhausted.

The sequence-sharding collate step itself is :func:`lightning_ulysses.data.install_sharding_collate`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader

from lightning_ulysses.context import SHARD_INFO_KEY, ShardInfo
from lightning_ulysses.data import SHIFT_LABELS
from lightning_ulysses.loss import IGNORE_INDEX



def prepare_loader(dataloader: Any, queue: "ShardInfoQueue", *, train: bool, accumulation: int = 1,
                   epoch_batches: Callable[[], float] = lambda: float("inf"),
                   on_position_change: Optional[Callable[[int], None]] = None,
                   on_exhausted: Optional[Callable[[], None]] = None) -> Any:
    """The strategy's layers on ``dataloader``, in their one order (see the module docstring)."""
    if train and accumulation > 1:
        dataloader = _with_layer(dataloader, _AccumulationWindowMixin, _ulysses_window=accumulation,
                                 _ulysses_epoch_batches=epoch_batches)
    if train:
        dataloader = install_resumable_loader(dataloader, on_position_change)
    return _with_layer(dataloader, _StepStateMixin, _ulysses_queue=queue, _ulysses_on_exhausted=on_exhausted,
                       _ulysses_iterations=set())


def restore_loader(dataloader: Any) -> None:
    """Give the loader object the strategy was handed back its own collate function (the one mutation made on an
    object the strategy did not create: it may be the user's own DataLoader). The layered copies
    :func:`prepare_loader` returned are the strategy's and keep their layers."""
    from lightning_ulysses.data import SequenceShardingCollate

    collate = getattr(dataloader, "collate_fn", None)
    if isinstance(collate, SequenceShardingCollate):
        dataloader.collate_fn = collate.collate_fn


def _with_layer(dataloader: Any, mixin: type, **state: Any) -> Any:
    """``dataloader`` as an instance of a subclass with ``mixin`` in front (a copy sharing its state; the original
    object is left alone), with ``state`` in its ``__dict__``; a loader that has the layer already gets the state."""
    cls = type(dataloader)
    if not issubclass(cls, mixin):
        layered_cls = type(f"{mixin.__name__.strip('_').replace('Mixin', '')}{cls.__name__}", (mixin, cls), {})
        layered = layered_cls.__new__(layered_cls)
        layered.__dict__.update(dataloader.__dict__)
        dataloader = layered
    dataloader.__dict__.update(state)
    return dataloader


# ----------------------------------------------------------------------------------------------- accumulation window
class _AccumulationWindowMixin:
    """Adds look-ahead to a DataLoader: batches are read one gradient-accumulation window at a time, and each batch's
    :class:`ShardInfo` gets this rank's count of target tokens over its whole window, so the loss can weight every
    token of the window equally, as one larger batch would.

    Windows are Lightning's: every epoch starts a window, one ends every ``steps`` batches and at the end of the
    epoch (the batches Lightning takes: ``epoch_batches()``, with ``limit_train_batches`` applied). A resumed epoch
    (the resumable loader sets ``_ulysses_skip``) continues the window its first batch belongs to."""

    _ulysses_window: int = 1
    _ulysses_epoch_batches: Callable[[], float] = staticmethod(lambda: float("inf"))

    def __iter__(self):
        iterator = super().__iter__()  # type: ignore[misc]
        skipped = int(self.__dict__.get("_ulysses_skip", 0))  # batches of this epoch already trained (resume)
        remaining = self._ulysses_epoch_batches() - skipped
        size = self._ulysses_window - skipped % self._ulysses_window
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
            size = self._ulysses_window
        yield from iterator  # past Lightning's epoch length: not trained (Lightning stops first)


# ----------------------------------------------------------------------------------------------- resume position
class _SkipFirst:
    """A batch sampler without its first ``skip`` batches (their indices are never handed to the dataset), once: a
    DataLoader iterator with persistent workers keeps this object and iterates it again every epoch."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        iterator = iter(self.batch_sampler)
        for _ in range(skip):
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


class ResumableLoaderMixin:
    """A train DataLoader that knows its position: ``state_dict()`` gives the epoch (its sampler's) and the number of
    batches handed out in it; after ``load_state_dict()``, the next iteration of *that* epoch skips those batches.

    Lightning saves the state of such ("stateful") loaders in the checkpoint and loads it on resume before iterating.
    The first batches are skipped in the batch sampler, so their samples are never loaded. A checkpoint saved at the
    end of an epoch resumes with the next epoch, unskipped.
    """

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self.__dict__.get("_ulysses_position", (None, 0))
        return {"epoch": epoch, "batches": batches, "global_batch": _global_batch(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved, current = state.get("global_batch"), _global_batch(self)
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
            on_change = self.__dict__.get("_ulysses_on_position_change")
            if on_change is not None:
                on_change(state["batches"])
        self.__dict__["_ulysses_resume"] = state

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs at the first next(), after Lightning has set the sampler's epoch.
        epoch = _sampler_epoch(self)
        resume = self.__dict__.pop("_ulysses_resume", None)
        skip = 0
        if resume and resume.get("batches") and resume.get("epoch") == epoch:
            skip = int(resume["batches"])
            if skip >= len(self):  # type: ignore[arg-type]
                skip = 0  # the epoch was complete: Lightning has moved on to the next one
        self.__dict__["_ulysses_skip"] = skip
        try:
            iterator = super().__iter__()  # type: ignore[misc]
            first = next(iterator, _END)  # the DataLoader's iterator reads _index_sampler when it starts
        finally:
            self.__dict__["_ulysses_skip"] = 0
        position = skip
        while first is not _END:
            position += 1
            self.__dict__["_ulysses_position"] = (epoch, position)
            yield first
            first = next(iterator, _END)

    @property
    def _index_sampler(self) -> Any:
        sampler = super()._index_sampler  # type: ignore[misc]
        skip = self.__dict__.get("_ulysses_skip", 0)
        return _SkipFirst(sampler, skip) if skip else sampler


_END = object()


def install_resumable_loader(dataloader: Any, on_position_change: Optional[Callable[[int], None]] = None) -> Any:
    """The same train DataLoader as an instance of a subclass with :class:`ResumableLoaderMixin`; loaders over an
    ``IterableDataset`` (no index to skip to) are returned unchanged. ``on_position_change(batch)``: called when a
    resume with another global batch continues the epoch at ``batch`` (the strategy aligns Lightning's count of the
    epoch's batches with it)."""
    from torch.utils.data import IterableDataset

    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return dataloader
    state = {} if on_position_change is None else {"_ulysses_on_position_change": on_position_change}
    return _with_layer(dataloader, ResumableLoaderMixin, **state)


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


class _StepStateMixin:
    """Outermost layer of a prepared DataLoader: takes each batch's :class:`ShardInfo` out of the batch as it leaves
    the loader (before Lightning's or the user's hooks can drop or trip over it) and queues it for the step; when the
    loader is exhausted it calls ``on_exhausted`` (the SP-peer end-of-data check)."""

    _ulysses_queue: ShardInfoQueue
    _ulysses_on_exhausted: Optional[Callable[[], None]] = None

    def __iter__(self):
        queue = self._ulysses_queue
        previous = self.__dict__.setdefault("_ulysses_iterations", set())
        queue.drop(previous)
        iteration = object()
        previous.add(iteration)
        for batch in super().__iter__():  # type: ignore[misc]
            if not isinstance(batch, dict) or SHARD_INFO_KEY not in batch:
                raise RuntimeError(
                    "A batch left the DataLoader without the strategy's sequence-sharding step (its collate_fn was"
                    f" replaced after Lightning prepared the loader?): got {type(batch).__name__}."
                )
            queue.push(iteration, batch.pop(SHARD_INFO_KEY))
            yield batch
        if self._ulysses_on_exhausted is not None:
            self._ulysses_on_exhausted()
