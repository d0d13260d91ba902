"""Live tensor bytes of a training step, tensor by tensor: the peak a rank reaches and what is alive at that peak.

On CUDA, ``torch.cuda.max_memory_allocated`` gives a step's peak, but not what it is made of; on CPU there is no
allocator counter at all, and the process's RSS measures glibc's heap (fragmentation, its dynamic mmap threshold), not
tensors. :class:`TensorMemoryTracker` counts the bytes of every tensor storage created while it is active, from the
operation that creates it to the moment it is freed, on any device, and keeps the composition of the largest moment:
per storage its bytes, the module whose forward created it, and what it is for (:data:`KINDS`).

    with TensorMemoryTracker() as tracker:
        loss = model(**batch).loss
        loss.backward()
    print(tracker.report())  # peak bytes, by kind and by layer

In a Lightning run, :class:`TensorMemoryMonitor` tracks every training batch (forward, backward and optimizer step)
and keeps one :class:`StepMemory` per step. Only storages created while tracking count: parameters, the optimizer's
partitions and buffers allocated before the step are not part of its peak (as the growth of
``max_memory_allocated`` from the step's start). Tracking costs a Python call per operation: a profiling tool, not
for production runs.
"""

from __future__ import annotations

import re
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ulysses import _compat

#: What a live storage is for, in the order :meth:`StepMemory.report` lists them.
KINDS = (
    "saved for backward",  # activations autograd keeps for the backward pass
    "exchange buffers",  # made by the sequence-parallel exchanges (all-to-all, all-gather) and their layout copies
    "logits and loss",  # the LM head's output and what the loss makes of it
    "masks",  # bool tensors
    "positions and indices",  # integer tensors
    "gradients and optimizer",  # made outside every module's forward: activation gradients, ZeRO buckets, updates
    "temporaries",  # made in a forward and not saved: freed before the step ends
)
_UNSAVED_KINDS = ("temporaries", "gradients and optimizer")  # what a storage is unless autograd saves it
_EXCHANGE_FILE = "lightning_ulysses/parallel/exchange.py"
_LOSS_FILES = ("lightning_ulysses/training/loss.py",)
# the tiled loss's functions in the memory switches' module (the rest of it, the tiled MLP and the model's forward
# wrapped by the switches, is not the loss)
_LOSS_FUNCTIONS = {"lightning_ulysses/models/memory.py": ("tiled_cross_entropy_sum", "tiled_token_statistics",
                                                          "_chunk_loss_sum")}
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


@dataclass
class _Storage:
    nbytes: int
    module: str  # the innermost module in forward when it was made ("" outside every forward)
    kind: str  # one of KINDS, but "saved for backward", which autograd decides after the operation returns
    saved: bool = False


@dataclass
class StepMemory:
    """What one tracked span reached.

    Attributes:
        peak_bytes: the largest sum of live storage bytes made inside the span.
        end_bytes: what was still alive when the span ended (kept across steps: buffers made once).
        by_kind: ``{kind: bytes}`` of the storages alive at the peak (:data:`KINDS`).
        by_layer: ``{"layer 3" | "embedding" | "head" | "outside the model": bytes}`` at the peak.
        by_module: ``{module path: bytes}`` at the peak (the module whose forward made each storage).
    """

    peak_bytes: int = 0
    end_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_layer: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)

    def report(self, unit: int = 2**20) -> str:
        """The peak and its composition as text (MiB by default)."""
        lines = [f"peak {self.peak_bytes / unit:.1f} MiB"]
        lines += [f"  {kind:<24} {self.by_kind[kind] / unit:10.2f}" for kind in KINDS if self.by_kind.get(kind)]
        for name, nbytes in sorted(self.by_layer.items(), key=_layer_order):
            lines.append(f"  {name:<24} {nbytes / unit:10.2f}")
        return "\n".join(lines)


def _layer_order(item: tuple[str, int]) -> tuple[int, int]:
    name = item[0]
    if name.startswith("layer "):
        return (1, int(name.split()[1]))
    return ({"embedding": 0, "head": 2}.get(name, 3), 0)


def layer_of(module_path: str) -> str:
    """``"model.layers.3.mlp" -> "layer 3"``; embeddings, the head, or ``"outside the model"``."""
    match = _LAYER.search(module_path)
    if match:
        return f"layer {match.group(1)}"
    if not module_path:
        return "outside the model"
    return "embedding" if "embed" in module_path else "head"


class TensorMemoryTracker(TorchDispatchMode):
    """Counts live tensor storage bytes made while active; keeps the composition of the peak (see the module doc).

    Reusable: each ``with`` block is one span, whose result :meth:`result` gives (and ``spans`` keeps).
    Storages made in one span and still alive in the next (buffers made once, kept by a module or an optimizer)
    count in the span that made them only.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, _Storage] = {}  # storage data pointer -> what it is
        self._current = 0
        self._peak = StepMemory()
        self._snapshot: dict[int, _Storage] = {}
        self._snapshot_at = 0
        self._modules: list[str] = []
        self._hooks: list[Any] = []
        self._saved_hooks: Optional[Any] = None
        self.spans: list[StepMemory] = []

    # ------------------------------------------------------------------------------------------------- tracking
    def __enter__(self) -> "TensorMemoryTracker":
        self._live, self._snapshot, self._current, self._snapshot_at = {}, {}, 0, 0
        self._peak = StepMemory()
        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                       torch.nn.modules.module.register_module_forward_hook(self._leave_module, always_call=True)]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        super().__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._modules.clear()
        self._peak.end_bytes = self._current
        self._summarise_snapshot()
        self.spans.append(self._peak)
        self._live, self._snapshot = {}, {}  # storages freed later must not count against a later span

    def result(self) -> StepMemory:
        """The last span's :class:`StepMemory`."""
        return self.spans[-1]

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self._modules.append(_module_names.get(module, type(module).__name__))

    def _leave_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._modules:
            self._modules.pop()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor):
            item = self._live.get(_storage_key(tensor))
            if item is not None:
                item.saved = True  # also in the peak's snapshot, which holds the same object
        return tensor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage: nothing was allocated for them
        inputs = {_storage_key(t) for t in _tensors_in((args, kwargs))}
        for tensor in _tensors_in(out):
            if isinstance(tensor, torch.Tensor):
                self._record(tensor, inputs)
        return out

    def _record(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = _storage_key(tensor), storage.nbytes()
        if nbytes == 0 or key in self._live or key in inputs:
            return
        module = self._modules[-1] if self._modules else ""
        self._live[key] = _Storage(nbytes, module, _kind_of(tensor, module))
        self._current += nbytes
        live = self._live
        weakref.finalize(storage, _forget, self, live, key, nbytes)
        # the composition is taken again when the peak grew by 1/256 since the last one (the peak itself is exact)
        if self._current > self._peak.peak_bytes:
            self._peak.peak_bytes = self._current
            if self._current > self._snapshot_at * (1 + 1 / 256):
                self._snapshot_at, self._snapshot = self._current, dict(self._live)

    def _summarise_snapshot(self) -> None:
        by_kind: Counter = Counter()
        by_layer: Counter = Counter()
        by_module: Counter = Counter()
        for item in self._snapshot.values():
            kind = "saved for backward" if item.saved and item.kind in _UNSAVED_KINDS else item.kind
            by_kind[kind] += item.nbytes
            by_layer[layer_of(item.module)] += item.nbytes
            by_module[item.module or "(outside the model)"] += item.nbytes
        self._peak.by_kind, self._peak.by_layer, self._peak.by_module = dict(by_kind), dict(by_layer), dict(by_module)


_ACTIVE: list[TensorMemoryTracker] = []


def _storage_released(key: int, nbytes: int) -> None:
    """A storage freed in place (:func:`lightning_ulysses._compat.release_storage`), which a tracker does not see
    as an operation: the active trackers stop counting it."""
    for tracker in _ACTIVE:
        _forget(tracker, tracker._live, key, nbytes)


_compat.STORAGE_RELEASED.append(_storage_released)


def _tensors_in(found: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested tuples, lists and dicts), without pytree's generality:
    half of the tracker's own cost per op was in ``tree_flatten``."""
    if isinstance(found, torch.Tensor):
        return [found]
    if isinstance(found, (tuple, list)):
        return [t for item in found for t in _tensors_in(item)] if found else []
    if isinstance(found, dict):
        return [t for item in found.values() for t in _tensors_in(item)]
    return []


# a storage's identity (its views share it; meta storages too): the key every live storage is counted under
_storage_key = _compat.storage_key


def _forget(tracker: TensorMemoryTracker, live: dict, key: int, nbytes: int) -> None:
    if tracker._live is live and live.pop(key, None) is not None:
        tracker._current -= nbytes


def _kind_of(tensor: torch.Tensor, module: str) -> str:
    if tensor.dtype == torch.bool:
        return "masks"
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return "positions and indices"
    frames = _calling_frames()
    if any(_EXCHANGE_FILE in name for name, _ in frames):
        return "exchange buffers"
    if module.endswith("lm_head") or any(_in_loss(name, function) for name, function in frames):
        return "logits and loss"
    if not module:
        return "gradients and optimizer"
    return "temporaries"


def _in_loss(filename: str, function: str) -> bool:
    if any(loss in filename for loss in _LOSS_FILES):
        return True
    return any(path in filename and function in functions for path, functions in _LOSS_FUNCTIONS.items())


def _calling_frames(depth: int = 24) -> list[tuple[str, str]]:
    """(file, function) of the Python frames that led to the operation being recorded, innermost first."""
    frame, frames = sys._getframe(3), []
    while frame is not None and len(frames) < depth:
        frames.append((frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name))
        frame = frame.f_back
    return frames


# module -> its path in the model being tracked, registered by name_modules()
_module_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def name_modules(model: torch.nn.Module) -> None:
    """Let the tracker name ``model``'s submodules by their paths (``"model.layers.3.mlp"``) rather than classes."""
    for name, module in model.named_modules():
        _module_names[module] = name


class TensorMemoryMonitor(Callback):
    """Tracks the live tensor bytes of every training batch (forward, backward, optimizer step) of a Lightning run.

    ``Trainer(..., callbacks=[monitor := TensorMemoryMonitor()])``; after ``fit``, ``monitor.steps`` holds one
    :class:`StepMemory` per batch on this rank and ``monitor.steps[-1].report()`` prints the last one. The first step
    also holds what DeepSpeed allocates once (its gradient buckets); later steps show the steady state.

    Args:
        log: log ``tensor_memory/peak_mib`` per step through the LightningModule's ``log``.
    """

    def __init__(self, log: bool = False) -> None:
        self._tracker = TensorMemoryTracker()
        self._log = log
        self._active = False

    @property
    def steps(self) -> list[StepMemory]:
        return self._tracker.spans

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        name_modules(pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._tracker.__enter__()
        self._active = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._active:
            self._tracker.__exit__(None, None, None)
            self._active = False
            if self._log:
                pl_module.log("tensor_memory/peak_mib", self.steps[-1].peak_bytes / 2**20)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._active:
            self._tracker.__exit__(None, None, None)
            self._active = False
