"""LitGPT's ``GPT`` under SP, found and prepared without a declaration.

LitGPT (Lightning's library of LLM implementations) builds every family from one ``litgpt.model.GPT``. Two things in
it see the sequence it is given as the whole sequence:

* **RoPE**: ``GPT.forward(idx)`` without ``input_pos`` takes ``cos = self.cos[:T]`` (and ``sin``) for the local
  length ``T``, so every rank would rotate its shard as positions ``0..s-1``. (``input_pos`` selects rows too, but it
  switches LitGPT to its KV-cache path.) While a prepared ``GPT`` runs inside a step, a forward pre-hook puts the rows
  of the shard's global positions in front: ``cos[:s]`` then *is* ``cos[positions]``; a forward hook puts the cache
  back (also when the forward raises).
* **Attention**: ``CausalSelfAttention.scaled_dot_product_attention(q, k, v, mask)`` is a method, not a module: each
  instance's method is replaced by the Ulysses exchange around the original (``q, k, v [B, n_head, s, hs]`` with ``k,
  v`` already expanded to ``n_head`` by LitGPT; the original runs on ``[B, n_head/sp, S, hs]`` with ``mask=None``,
  causal). A mask there (LitGPT's sliding-window layers) is refused: it is built for the local length.

Everything is undone by :func:`restore_litgpt`. LitGPT is optional: nothing here imports it unless a model's class
comes from it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.parallel.attention import ulysses_attention
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training.step_context import StepContext

_SAVED = "_ulysses_litgpt_saved"


def is_litgpt_gpt(module: nn.Module) -> bool:
    """LitGPT's ``GPT`` or a subclass of it (``litgpt.lora.GPT``, ``litgpt.adapter.GPT``, ...)."""
    return hasattr(module, "cos") and any(cls.__module__ == "litgpt.model" and cls.__name__ == "GPT"
                                          for cls in type(module).__mro__)


def find_litgpt_models(root: nn.Module) -> list[nn.Module]:
    """The outermost LitGPT ``GPT`` modules in ``root``."""
    found: list[nn.Module] = []
    covered: set[int] = set()
    for module in root.modules():
        if id(module) not in covered and is_litgpt_gpt(module):
            found.append(module)
            covered.update(id(m) for m in module.modules())
    return found


def _attention_blocks(model: nn.Module) -> list[nn.Module]:
    """LitGPT's attention blocks: modules whose LitGPT class defines ``scaled_dot_product_attention``."""
    return [m for m in model.modules()
            if any("scaled_dot_product_attention" in cls.__dict__ for cls in type(m).__mro__
                   if cls.__module__.startswith("litgpt"))]


def changed_attention_kernels(model: nn.Module) -> list[str]:
    """The attention classes of ``model`` whose ``scaled_dot_product_attention`` is not ``litgpt.model``'s own (e.g.
    ``litgpt.adapter``'s, which adds attention to a learned prefix for the local heads)."""
    changed = set()
    for block in _attention_blocks(model):
        owner = next(cls for cls in type(block).__mro__ if "scaled_dot_product_attention" in cls.__dict__)
        if owner.__module__ != "litgpt.model":
            changed.add(f"{owner.__module__}.{owner.__qualname__}")
    return sorted(changed)


def prepare_litgpt(model: nn.Module, context: StepContext) -> None:
    """Global RoPE rows and the Ulysses exchange for a LitGPT ``GPT`` (idempotent)."""
    if held_on_instance(model, _SAVED):
        return
    blocks = _attention_blocks(model)
    for block in blocks:
        put_on_instance(block, "scaled_dot_product_attention", functools.partial(_ulysses_sdpa, block, context))
    put_on_instance(model, _SAVED, (blocks, _register_rope_hooks(model, context)))


def _register_rope_hooks(model: nn.Module, context: StepContext) -> list:
    """The pre-hook that puts the global positions' RoPE rows first and the hook that puts the cache back."""
    return [model.register_forward_pre_hook(functools.partial(_rows_of_global_positions, context=context),
                                            with_kwargs=True),
            model.register_forward_hook(_restore_rope_cache, always_call=True)]


def restore_litgpt(model: nn.Module) -> None:
    saved = take_from_instance(model, _SAVED, None)
    if saved is None:
        return
    blocks, handles = saved
    for block in blocks:
        take_from_instance(block, "scaled_dot_product_attention", None)
    for handle in handles:
        handle.remove()


def reinstall_hooks(model: nn.Module, context: StepContext) -> None:
    """The RoPE hooks again, after something cleared every module's hooks (Lightning's DeepSpeed inference set-up)."""
    saved = on_instance(model, _SAVED)
    if saved is None:
        return
    blocks, handles = saved
    for handle in handles:
        handle.remove()
    handles[:] = _register_rope_hooks(model, context)


def has_hooks(model: nn.Module) -> bool:
    saved = on_instance(model, _SAVED)
    return saved is not None and all(_compat.hook_is_registered(model, h) for h in saved[1])


_CACHE = "_ulysses_litgpt_rope_cache"


def rope_rows(model: nn.Module, positions: torch.Tensor) -> None:
    """Put the RoPE cache rows of ``positions`` ``[T]`` first, so that LitGPT's ``cos[:T]`` takes them (undone by
    :func:`put_back_rope_rows`)."""
    cos, sin = model.cos, model.sin
    put_on_instance(model, _CACHE, (cos, sin))
    index = positions.to(cos.device)
    model.cos, model.sin = cos.index_select(0, index), sin.index_select(0, index)  # [T, n_elem]


def put_back_rope_rows(model: nn.Module) -> None:
    cached = take_from_instance(model, _CACHE, None)
    if cached is not None:
        model.cos, model.sin = cached


def _rows_of_global_positions(model: nn.Module, args: tuple, kwargs: dict, context: StepContext) -> None:
    shard = context.shard_info
    if context.plain or not context.in_step or shard is None or shard.position_ids is None:
        return
    if kwargs.get("input_pos") is not None:
        raise ValueError(
            f"{type(model).__name__} (LitGPT) was called with `input_pos`, which switches LitGPT to its KV-cache"
            " path. Inside a training/evaluation step call it as `model(batch[\"input_ids\"])`: the strategy"
            " gives it the shard's global positions."
        )
    idx = args[0] if args else kwargs.get("idx")
    if not isinstance(idx, torch.Tensor) or idx.ndim != 2 or idx.shape[1] != shard.position_ids.shape[1]:
        return
    positions = shard.position_ids[: idx.shape[0]]  # [B, s]
    if not bool((positions == positions[:1]).all()):
        raise ValueError(
            f"{type(model).__name__} (LitGPT) takes one RoPE row per position for the whole batch, but this batch's"
            " rows have different positions (packed documents): under sequence parallelism give LitGPT models one"
            " document per row, or rows packed identically."
        )
    rope_rows(model, positions[0])


def _restore_rope_cache(model: nn.Module, args: tuple, output: Any) -> None:
    put_back_rope_rows(model)


def _ulysses_sdpa(block: nn.Module, context: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    original = type(block).scaled_dot_product_attention
    if context.plain or not context.in_step:
        return original(block, q, k, v, mask)
    if mask is not None:
        raise ValueError(
            f"{type(block).__name__} (LitGPT) passes its attention a mask built for the local sequence (its sliding"
            " window layers): under sequence parallelism the strategy runs causal attention over the whole sequence"
            " and supports LitGPT configs without sliding windows."
        )

    def whole_sequence(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        # [B, h, S, hs] ×3 -> [B, h, S, hs]: LitGPT's own kernel (scale, softcapping), causal
        return original(block, q_, k_, v_, None).transpose(1, 2)

    out = ulysses_attention(q.contiguous(), k.contiguous(), v.contiguous(), context.ulysses_group,
                            whole_sequence)  # [B, n_head, s, hs]
    return out.transpose(1, 2)  # [B, s, n_head, hs], as LitGPT's method returns
