"""Decoder layers checkpointed by the strategy, their recompute's saved tensors in host memory (Ulysses-Offload).

With ``offload_checkpoints`` every decoder layer is checkpointed: its input waits in host memory, and in backward the
layer runs again to make what its backward needs. torch's non-reentrant checkpoint keeps everything that recompute
saves on the device until the layer's backward is through (for a Llama layer with the ALST switches the input, both
norms' outputs, the attention's output and the residual: five ``[s, H]`` tensors beside the gradients), and it keeps
whatever an ``autograd.Function`` holds on its ``ctx`` from the *first* forward (the chunked attention's store, so
every layer's chunks wait to the end of the forward, and the recompute's attention forward runs for nothing).

:func:`recompute_in_host_memory` is the checkpoint the strategy gives Hugging Face's decoder layers
(``_gradient_checkpointing_func``) with ``offload_attention`` and ``offload_checkpoints`` on: the first forward runs
without a graph (nothing of it stays but the layer's inputs, saved for backward: the strategy's checkpoint offload
moves them to host memory), and backward runs the layer again with autograd and back-propagates through it at once,
every tensor that recompute saves moving to pinned host memory on the chunk store's side stream
(:class:`~lightning_ulysses.parallel.offload_attention.ChunkStore`) and coming back when its backward node runs. On
the device a layer's backward then holds the gradients passing through and the one saved tensor in use, not the
layer's whole set. On other devices than CUDA there is no host to move to: the tensors stay where they are (the same
arithmetic, tested for exactness on CPU).

The layer runs in backward as in forward: the random generators replayed (dropout draws the masks it drew), the
autocast state restored. A layer called with a keyword tensor that needs a gradient (a value passed between layers)
is checkpointed by torch's own function instead: its gradient would not reach that tensor here.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ulysses import _compat
from lightning_ulysses.models.rng_replay import replayed_rng, rng_states
from lightning_ulysses.parallel import offload_attention
from lightning_ulysses.training import loss_graph

HOST_MIN_BYTES = 1 << 20  # saved tensors smaller than this (positions, norms' statistics) stay on the device


def _is_parameter_data(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` as a matmul saves it): it stays where it is."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


def host_saved_tensors(device: torch.device) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved tensors of ``HOST_MIN_BYTES`` or more on CUDA go to pinned host memory when saved and come back when
    their backward node unpacks them; smaller ones stay, as they are where their whole storage is small, else (a
    small view of a large storage) as a copy: no saved tensor shares a large storage, such as the layer's input or
    output, which backward frees (:func:`_release`). Parameters stay as they are; elsewhere than CUDA (no host to
    move to) all do. The planner's trace replaces this with a shapes-only form (:mod:`lightning_ulysses.plan.
    activations`)."""
    store = offload_attention.ChunkStore(device)  # looked up here: a benchmark's host emulation replaces it

    def pack(tensor: torch.Tensor) -> Any:
        if not store.offloads or _is_parameter_data(tensor):
            return tensor
        if tensor.numel() * tensor.element_size() < HOST_MIN_BYTES:
            return tensor if not _large_storage(tensor) else tensor.clone()
        return _OnHost(store.put(tensor))

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _OnHost):
            return store.ready(store.fetch(packed.handle))
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _large_storage(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() >= HOST_MIN_BYTES


def _reference_counts(tensors: list[torch.Tensor]) -> list[int]:
    return [sys.getrefcount(tensor) for tensor in tensors]


# What _reference_counts reads for a tensor that only the list handed to it references (this Python's own count)
_ONLY_IN_THE_LIST = _reference_counts([torch.empty(0)])[0]


def _release_unreferenced(tensors: list[torch.Tensor], held: Optional[int]) -> int:
    """Free the large storages among ``tensors`` (the recomputed layer's inputs as this checkpoint fetched them from
    the host, and its outputs) that nothing but this checkpoint references: no other tensor views the storage, and
    (``held`` not ``None``: a tensor the layer's code and hooks saw) no more than ``held`` Python references besides
    the list. Backward reads only their shapes (the input's gradient, the outputs' gradients), and until the layer's
    backward is through they would hold ``[s, H]`` each beside the gradients; no saved tensor shares a large storage
    (:func:`host_saved_tensors` moves or copies those). A tensor anything else holds (a user's forward hook that keeps
    the layer's output, or its input: the layer is given an alias of the checkpoint's own copy, so such a hook shows as
    another tensor viewing the storage; an attribute the layer's code set) keeps its bytes. Returns how many were
    freed."""
    freed = 0
    for tensor, count in zip(tensors, _reference_counts(tensors)):
        if _large_storage(tensor) and (held is None or count - _ONLY_IN_THE_LIST <= held) and \
                _compat.storage_use_count(tensor) == _compat.LONE_STORAGE_USE_COUNT:
            _compat.release_storage(tensor)
            freed += 1
    return freed


class _OnHost:
    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle


def _autocast_states(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in dict.fromkeys((device_type, "cpu")) if torch.amp.is_autocast_available(kind)]


class _RecomputedLayer(torch.autograd.Function):
    """``function(*args)`` run without a graph in forward; in backward run again with autograd (its saved tensors
    through :func:`host_saved_tensors`) and back-propagated at once. ``args``: the layer's positional arguments, the
    tensors among them the node's inputs (saved for backward: the checkpoint)."""

    @staticmethod
    def forward(ctx, function: Callable, layout: tuple, inputs_to_host: bool,  # type: ignore[override]
                *tensors: torch.Tensor) -> Any:
        device = tensors[0].device
        store = offload_attention.ChunkStore(device)
        ctx.function, ctx.layout, ctx.device = function, layout, device
        ctx.rng = rng_states(device)
        ctx.autocast = _autocast_states(device.type)
        # the layer's inputs (the checkpoint): with offload_checkpoints its floating-point ones wait in host memory,
        # put there here, so that backward knows the copies it gets back are its own; the rest saved for backward
        moved = [inputs_to_host and store.offloads and t.is_floating_point() for t in tensors]
        ctx.on_host = [store.put(t) if move else None for t, move in zip(tensors, moved)]
        ctx.save_for_backward(*[t for t, move in zip(tensors, moved) if not move])
        with torch.no_grad():
            outputs = function(*_arguments(layout, tensors))
        ctx.output_is_tensor = isinstance(outputs, torch.Tensor)
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        needs = ctx.needs_input_grad[3:]
        store = offload_attention.ChunkStore(ctx.device)
        parked = _park(grads, store)  # the incoming gradient waits in host memory while the layer runs again
        saved = iter(ctx.saved_tensors)
        fetched = [None if handle is None else store.ready(store.fetch(handle)) for handle in ctx.on_host]
        ctx.on_host = None
        inputs = [(next(saved) if t is None else t).detach().requires_grad_(need) for t, need in zip(fetched, needs)]
        fetched = [t is not None for t in fetched]  # the fetched copies: only `inputs` views them now
        with torch.enable_grad(), replayed_rng(ctx.device, ctx.rng), contextlib.ExitStack() as stack:
            for kind, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            with host_saved_tensors(ctx.device):  # the fetched copies as aliases: the layer never holds our own
                outputs = ctx.function(*_arguments(ctx.layout, [t.view_as(t) if f else t
                                                                for t, f in zip(inputs, fetched)]))
        outputs = (outputs,) if ctx.output_is_tensor else tuple(outputs)
        grads = _unpark(grads, parked, store)
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
        # every floating-point input is this checkpoint's own copy: no output can be a caller's tensor
        own_copies = any(fetched) and all(f or not t.is_floating_point() for t, f in zip(inputs, fetched))
        if own_copies:  # the fetched inputs, which only this checkpoint and its graph's leaves reference
            _release_unreferenced([t for t, f in zip(inputs, fetched) if f], held=None)
        root = None
        if pairs:
            # the outputs' gradients go to the engine through a box that backward empties: no Python name holds
            # them while the layer back-propagates (the first node to use one can add to it in place, or free it)
            box, roots = [[grad for _, grad in pairs]], [out for out, _ in pairs]
            del pairs, grads
            with torch.enable_grad():  # (a backward runs without a graph)
                root = _GradientSource.apply(box, *roots)  # []
            del roots
        if own_copies:  # the outputs: referenced here by `outputs` alone (and the list handed over)
            _release_unreferenced([out for out in outputs if isinstance(out, torch.Tensor)], held=1)
        if root is not None:
            torch.autograd.backward(root)
            del root
        handed_on = [t.grad if need else None for t, need in zip(inputs, needs)]
        for t in inputs:
            t.grad = None  # the engine's alone from here (what the layer below parks counts its references)
        for grad in handed_on:
            if grad is not None:
                hand_on(grad)
        return (None, None, None, *handed_on)


loss_graph.register_sharded_computation(_RecomputedLayer)  # a decoder layer on this rank's shard


class _GradientSource(torch.autograd.Function):
    """A zero-dimensional root over ``outputs`` whose backward hands the engine the gradients waiting in ``box``
    (a one-element list it empties): ``torch.autograd.backward(outputs, grads)`` would keep ``grads`` referenced by
    its own frames until the whole backward is through, so the layer's output gradient (``[s, H]``) stayed beside
    every gradient the layer made, and the residual's sum was a new tensor instead of an addition in place."""

    @staticmethod
    def forward(ctx, box: list, *outputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.box = box
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):  # type: ignore[override]
        grads, ctx.box = ctx.box.pop(), None
        return (None, *grads)


# Input gradients made by a backward here and handed to the engine (this checkpoint's, a tiled norm's) carry this
# attribute: in a stack of checkpointed layers, what the layer below receives as its output's gradient. Such a
# gradient is the engine's alone (made in that backward, passed on to its one consumer): while the layer below runs
# again it waits in host memory, its device bytes freed.
HANDED_ON = "_ulysses_handed_on"


def hand_on(tensor: torch.Tensor) -> None:
    """Mark ``tensor``, an input gradient a backward made and hands to the engine (this checkpoint's, a tiled
    norm's), as parkable by the checkpointed layer that receives it as its output's gradient."""
    setattr(tensor, HANDED_ON, True)


def _excess_references(grads: tuple) -> list[int]:
    """For each tensor of ``grads`` (a backward's incoming gradients), its Python references beyond the list's own."""
    tensors = [grad for grad in grads if isinstance(grad, torch.Tensor)]
    return [count - _ONLY_IN_THE_LIST for count in _reference_counts(tensors)]


@functools.cache
def _references_of_an_engines_gradient() -> int:
    """What :func:`_excess_references` reads, inside a backward, for a gradient the engine alone holds (made by the
    node above, held by nothing else), on this torch and this Python: measured once, on a two-node graph of CPU
    tensors (a backward inside the layer's backward, which the engine runs reentrantly)."""
    seen: list[int] = []

    class _Above(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return grad * 2

    class _Below(_Above):
        @staticmethod
        def backward(ctx, *grads: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            seen.extend(_excess_references(grads))
            return grads[0]

    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad():
        _Above.apply(_Below.apply(x)).sum().backward()
    return seen[0]


def _park(grads: tuple, store: Any) -> list[Any]:
    """Each of ``grads`` marked :data:`HANDED_ON` that nothing else holds (no other tensor views its storage, no
    Python reference beyond the engine's: a user's tensor hook that keeps the layer's output gradient keeps it whole),
    copied to host memory and its device storage freed; ``None`` for the others. Where the chunk store does not move
    to the host (not CUDA), nothing is parked."""
    parked: list[Any] = []
    if not store.offloads:
        return [None] * len(grads)
    excess = iter(_excess_references(grads))
    for grad in grads:
        references = next(excess) if isinstance(grad, torch.Tensor) else None
        lone = references is not None and getattr(grad, HANDED_ON, False) and \
            _compat.storage_use_count(grad) == _compat.LONE_STORAGE_USE_COUNT and \
            references <= _references_of_an_engines_gradient()  # measured once, at the first use
        if not lone:
            parked.append(None)
            continue
        parked.append(store.put(grad.contiguous()))
        _compat.release_storage(grad)
    return parked


def _unpark(grads: tuple, parked: list[Any], store: Any) -> tuple:
    return tuple(grad if handle is None else store.ready(store.fetch(handle)) for grad, handle in zip(grads, parked))


def _arguments(layout: tuple, tensors: Any) -> list[Any]:
    found, it = [], iter(tensors)
    for is_tensor, value in layout:
        found.append(next(it) if is_tensor else value)
    return found


def _keyword_tensors_need_grad(function: Callable) -> bool:
    keywords = getattr(function, "keywords", None) or {}
    pending = list(keywords.values())
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (tuple, list)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return not isinstance(function, functools.partial)  # an unknown callable: torch's checkpoint


def recompute_in_host_memory(function: Callable, *args: Any, inputs_to_host: bool = False, **kwargs: Any) -> Any:
    """A decoder layer's checkpoint (Hugging Face's ``_gradient_checkpointing_func(partial(forward, layer,
    **kwargs), *args)``) whose recompute keeps its saved tensors in host memory (module docstring);
    ``inputs_to_host``: the checkpoint itself (its floating-point inputs) waits there too (``offload_checkpoints``).
    Falls back to torch's non-reentrant checkpoint where a keyword tensor of the layer needs a gradient or no
    positional tensor does."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if kwargs or not any(t.requires_grad for t in tensors) or _keyword_tensors_need_grad(function):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    layout = tuple((isinstance(a, torch.Tensor), None if isinstance(a, torch.Tensor) else a) for a in args)
    return _RecomputedLayer.apply(function, layout, inputs_to_host, *tensors)


def use_for_layers(model: nn.Module, inputs_to_host: bool) -> list[tuple[nn.Module, Callable]]:
    """Give every checkpointed decoder layer of ``model`` (after ``gradient_checkpointing_enable``, the strategy's
    or the model's own) :func:`recompute_in_host_memory` (``inputs_to_host``: ``offload_checkpoints``); the layers
    and the functions they had, to put back."""
    replaced = []
    function = functools.partial(recompute_in_host_memory, inputs_to_host=inputs_to_host)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            replaced.append((module, module._gradient_checkpointing_func))
            module._gradient_checkpointing_func = function
    return replaced
