"""Rotary embeddings whose frequencies depend on the length of the sequence, computed for the whole sequence.

Some RoPE variants choose their frequencies from the largest position they are given: transformers'
``dynamic_rope_update`` (``rope_type`` ``"dynamic"``: dynamic NTK rescales the base once ``max(position_ids) + 1``
passes ``max_position_embeddings``; ``"longrope"``: Phi-3's long factors once it passes
``original_max_position_embeddings``), and models that read ``torch.max(position_ids)`` in their rotary ``forward``
themselves (PhiMoE's ``mscale``). Under SP each rank's rotary module sees only its shard's positions, so rank 0
(positions ``0..s-1``) would pick the short-sequence frequencies while a single device, seeing ``0..S-1``, picks the
long ones: a silently different model.

:func:`wrap_length_dependent_rotaries` gives each such module one extra position to look at: the largest position
of the whole batch (:attr:`~lightning_ulysses.context.ShardInfo.max_position`, taken by the collate step before the
cut, so it is what one device sees: the longest packed document for packed rows). The module's own code then makes
the one-device choice, and the extra position's ``cos``/``sin`` are cut off again. Static variants (default,
linear, yarn, llama3, ...) do not depend on the length and are left alone.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training.step_context import StepContext

_ORIGINAL = "_ulysses_original_rotary_forward"


@functools.lru_cache(maxsize=1)
def _dynamic_update_code() -> Any:
    """The code object of transformers' ``dynamic_rope_update`` wrapper (to recognise decorated forwards)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _is_dynamic_update_decorated(function: Callable) -> bool:
    seen = 0
    while function is not None and seen < 8:
        if getattr(function, "__code__", None) is _dynamic_update_code():
            return True
        function, seen = getattr(function, "__wrapped__", None), seen + 1
    return False


def _length_dependent_type(rope_type: Any) -> bool:
    if isinstance(rope_type, dict):  # per layer type (Gemma 3 style)
        return any(_length_dependent_type(value) for value in rope_type.values())
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


@functools.lru_cache(maxsize=None)
def _reads_max_position(cls: type) -> bool:
    """The rotary ``forward`` itself derives something from the largest position (PhiMoE's ``mscale``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "max(position_ids)" in source or "position_ids.max()" in source


def is_length_dependent_rotary(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose output depends on the largest position it is given."""
    forward = type(module).__dict__.get("forward") or getattr(type(module), "forward", None)
    if forward is None:
        return False
    if _is_dynamic_update_decorated(forward) and _length_dependent_type(getattr(module, "rope_type", None)):
        return True
    return type(module).__name__.endswith("RotaryEmbedding") and _reads_max_position(type(module))


def wrap_length_dependent_rotaries(model: nn.Module, context: StepContext) -> list[nn.Module]:
    """Make every length-dependent rotary embedding of ``model`` choose its frequencies from the whole batch's
    largest position inside a step; returns the wrapped modules (undo with :func:`unwrap_rotaries`)."""
    wrapped = []
    for module in model.modules():
        if held_on_instance(module, _ORIGINAL) or not is_length_dependent_rotary(module):
            continue
        put_on_instance(module, _ORIGINAL, type(module).forward)
        put_on_instance(module, "forward", functools.partial(_whole_sequence_rotary, module, context))
        wrapped.append(module)
    return wrapped


def unwrap_rotaries(modules: list[nn.Module]) -> None:
    for module in modules:
        if take_from_instance(module, _ORIGINAL, None) is not None:
            take_from_instance(module, "forward", None)


def _whole_sequence_rotary(module: nn.Module, context: StepContext, x: torch.Tensor,
                           position_ids: Optional[torch.Tensor] = None, *args: Any, **kwargs: Any) -> Any:
    original = on_instance(module, _ORIGINAL)
    shard = context.shard_info
    if (context.plain or not context.in_step or shard is None or shard.max_position is None
            or not isinstance(position_ids, torch.Tensor)):
        return original(module, x, position_ids, *args, **kwargs)
    s = position_ids.shape[-1]
    # [..., s] -> [..., s + 1]: the last position is the whole batch's largest, so the module's max(position_ids)
    # is the one a single device computes
    whole_max = position_ids.new_full((*position_ids.shape[:-1], 1), shard.max_position)
    outputs = original(module, x, torch.cat([position_ids, whole_max], dim=-1), *args, **kwargs)
    position_dim = position_ids.ndim - 1  # cos/sin are [..., s + 1, D]: the positions' dims, then the features

    def cut(value: Any) -> Any:  # [..., s + 1, D] -> [..., s, D]
        if isinstance(value, torch.Tensor) and value.ndim > position_dim and value.shape[position_dim] == s + 1:
            return value.narrow(position_dim, 0, s)
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    return cut(outputs)
