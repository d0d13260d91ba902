"""Steps without step hooks: where a step begins under Lightning Fabric.

The Trainer tells the strategy where each step begins (``training_step`` and its siblings). Fabric does not: the
user's loop fetches a batch from a loader set up with ``fabric.setup_dataloaders`` and calls the model. So the Fabric
front end keeps the batches its loaders handed out (:class:`RecordedBatches`, the outermost loader layer: each
batch's :class:`~lightning_ulysses.context.ShardInfo` with the batch's own tensors) and, at every forward pass of the
set-up model (a forward pre-hook on the DeepSpeed engine, :class:`ForwardSteps`), decides which batch the call is
on:

* the call's token tensor (``input_ids``, LitGPT's ``idx``, or the first 2-D integer tensor) is matched with the
  recorded batches', the ones not used yet first, then the current one: a batch not used yet begins a new step
  (the checks before compute, the model-form check on the first step), the current one continues its step (a
  second forward pass on the same batch, e.g. a policy and a reference pass). A call on the batch's own tensor or
  its first rows is recognised by its memory, on the host; only a tensor with memory of its own (the device copy
  Fabric's loader makes on a GPU, a copy of the user's) is compared by value, and then kept as the batch's, so
  that the step's further calls on it are recognised by memory: at most one comparison per batch, none per call;
* a call without a token tensor (``inputs_embeds``) takes the oldest batch not used yet, else the current one;
* a call whose tokens match no recorded batch raises before compute: the strategy would not know the positions
  and lengths of the shard, so the result would be silently wrong;
* a call given ``input_pos`` (LitGPT's KV-cache generation) is not a step: it runs plain, as on one device.

The step's facts stay in force after the forward pass (the loss is computed from the outputs afterwards) until the
next step begins; the models run sequence-parallel only inside the forward pass of the engine.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.data.loaders import LoaderLayer, ShardInfoQueue
from lightning_ulysses.training.step_runner import StepRunner

KEEP = 16  # batches handed out and not used yet that are remembered (the oldest are forgotten first)
STEP_KEYS = ("input_ids", "position_ids", "attention_mask", "shift_labels")  # what a step reads of its batch


@dataclass
class RecordedBatch:
    """A batch a set-up loader handed out: its facts and the shard's token tensors as the loader gave them."""

    shard: ShardInfo
    batch: dict[str, Any]

    @property
    def tokens(self) -> Optional[torch.Tensor]:
        ids = self.batch.get("input_ids")
        return ids if isinstance(ids, torch.Tensor) else None


class ForwardSteps:
    """Begins the steps of the Fabric front end at the forward passes of the set-up model (module docstring)."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.unused: deque[RecordedBatch] = deque()
        self.current: Optional[RecordedBatch] = None
        self._entered: list[bool] = []  # per forward pass in progress: whether it set the context's in_step

    def record(self, shard: ShardInfo, batch: dict[str, Any]) -> None:
        kept = {key: batch[key] for key in STEP_KEYS if key in batch}  # not the pixels of a vision batch
        self.unused.append(RecordedBatch(shard, kept))
        while len(self.unused) > KEEP:
            self.unused.popleft()

    # ------------------------------------------------------------------------------------------ engine hooks
    def before_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        context = self.runner.context
        if context.in_step or context.plain or _given_input_pos(getattr(module, "module", module), args, kwargs):
            self._entered.append(False)  # inside another step's call (form check, evaluate_full_batch), or generation
            return
        tokens = _token_tensor(args, kwargs)
        entry = self._entry_for(tokens, kwargs)
        if entry is not self.current:
            self.unused.remove(entry)
            self.runner.begin_batch("train", entry.shard, entry.batch)
            self.current = entry
        self.runner.set_in_step(True)
        self._entered.append(True)

    def after_forward(self, module: Any, args: tuple, output: Any) -> None:
        if self._entered and self._entered.pop():
            self.runner.set_in_step(False)

    def _entry_for(self, tokens: Optional[torch.Tensor], kwargs: dict) -> RecordedBatch:
        if tokens is None:
            entry = self.unused[0] if self.unused else self.current
            if entry is None:
                raise RuntimeError(no_batch_error())
            return entry
        candidates = [*self.unused, *([self.current] if self.current is not None else [])]
        for entry in candidates:  # the batch's own memory: decided on the host
            if _shares_rows(tokens, entry.tokens):
                return entry
        for entry in candidates:  # a copy (Fabric's device copy): compared once, then known by its memory
            if _same_rows(tokens, entry.tokens):
                _adopt_copies(entry, tokens, kwargs)
                return entry
        raise ValueError(unmatched_call_error(tokens, self.current, len(self.unused)))


def _given_input_pos(model: Any, args: tuple, kwargs: dict) -> bool:
    """The call passes ``input_pos`` (LitGPT's KV-cache path, e.g. ``litgpt.generate``'s ``model(x, input_pos)``),
    by name or by position in ``model.forward``'s signature."""
    if kwargs.get("input_pos") is not None:
        return True
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("input_pos") is not None


def _token_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for key in ("input_ids", "idx"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    for value in args:
        if isinstance(value, torch.Tensor) and value.ndim == 2 and not value.is_floating_point():
            return value
    return None


def _shares_rows(given: torch.Tensor, recorded: Optional[torch.Tensor]) -> bool:
    """``given`` is ``recorded`` or a view of its first rows (the same memory, read on the host only)."""
    if recorded is None:
        return False
    if given is recorded:
        return True
    return (given.ndim == 2 and given.device == recorded.device and given.dtype == recorded.dtype
            and given.shape[1] == recorded.shape[1] and given.shape[0] <= recorded.shape[0]
            and given.stride() == recorded.stride() and given.storage_offset() == recorded.storage_offset()
            and given.untyped_storage().data_ptr() == recorded.untyped_storage().data_ptr())


def _adopt_copies(entry: RecordedBatch, tokens: torch.Tensor, kwargs: dict) -> None:
    """The call's copies of the whole batch's tensors become the batch's (the token tensor matched by value; each other
    step tensor after one comparison of its own), so that the step's later calls, and the call completion's check of
    the given positions and mask (:func:`lightning_ulysses.models.calls.same_data`), recognise them by memory."""
    recorded = entry.tokens
    if recorded is None or tokens.shape != recorded.shape:
        return  # first rows only: the batch keeps its own tensors
    entry.batch["input_ids"] = tokens
    for key in STEP_KEYS[1:]:
        given, own = kwargs.get(key), entry.batch.get(key)
        if isinstance(given, torch.Tensor) and isinstance(own, torch.Tensor) and given is not own \
                and given.shape == own.shape and bool(torch.equal(given, own.to(given.device))):
            entry.batch[key] = given


def _same_rows(given: torch.Tensor, recorded: Optional[torch.Tensor]) -> bool:
    """``given`` holds ``recorded``'s values (e.g. a device copy), or its first rows' (a device read)."""
    if recorded is None:
        return False
    if given.ndim != 2 or given.shape[1] != recorded.shape[1] or given.shape[0] > recorded.shape[0]:
        return False
    return bool(torch.equal(given, recorded[: given.shape[0]].to(given.device)))


def no_batch_error() -> str:
    return (
        "UlyssesDeepSpeedStrategy (Fabric): the model was called before any batch came from a DataLoader set up with"
        " `fabric.setup_dataloaders(...)`. Under sequence parallelism every rank holds a shard of each sequence, and"
        " the strategy learns the shard's positions and lengths from the loaders it set up: set up your loaders"
        " with Fabric and call the model on their batches (for a full batch outside the loaders use"
        " `fabric.strategy.evaluate_full_batch(model, batch)`)."
    )


def unmatched_call_error(tokens: torch.Tensor, current: Optional[RecordedBatch], unused: int) -> str:
    shard = f" (the current batch's shard is {list(current.tokens.shape)})" if current is not None and \
        current.tokens is not None else ""
    return (
        f"UlyssesDeepSpeedStrategy (Fabric): the model was called on tokens of shape {list(tokens.shape)} that are"
        f" not a batch a loader set up with `fabric.setup_dataloaders(...)` handed out{shard}; {unused} batch(es)"
        " handed out are not used yet. Under sequence parallelism the strategy must know the positions and lengths"
        " of the shard a call runs on, and it would not here: call the model on the batches of the set-up loaders"
        " as they come (`model(**batch)`, `model(batch[\"input_ids\"])`, or their first rows). For a full batch"
        " outside the loaders use `fabric.strategy.evaluate_full_batch(model, batch)`; generation with LitGPT's"
        " KV cache (`input_pos`) runs plain."
    )


class RecordedBatches(LoaderLayer):
    """Outermost layer of a loader Fabric set up: every batch leaving it is recorded with its facts (taken from the
    queue the step-state layer under it filled) for :class:`ForwardSteps`."""

    _own = ("inner", "queue", "steps")

    def __init__(self, inner: Any, queue: ShardInfoQueue, steps: ForwardSteps) -> None:
        super().__init__(inner)
        self.queue = queue
        self.steps = steps

    def __iter__(self) -> Iterator[Any]:
        for batch in self.inner:
            shard = self.queue.pop()
            if shard is None:  # the step-state layer queues one entry per batch it hands out
                raise RuntimeError("A batch left a set-up DataLoader without its sharding facts.")
            self.steps.record(shard, batch)
            yield batch
