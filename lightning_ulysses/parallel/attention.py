"""Ulysses attention for plain PyTorch models: a function, a module, and the strategy's automatic wrapping.

Layout everywhere here is PyTorch SDPA's: ``[B, H, S, D]`` (batch, heads, sequence, head dim). Inputs and outputs
are this rank's *sequence shard* ``[B, H, s, D]`` (``s = S / sp``); the attention callable in between sees the
*full* sequence for its share of the heads, ``[B, h, S, D]``.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.parallel.exchange import head_to_sequence_shards, sequence_to_head_shards
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance

AttentionFn = Callable[..., torch.Tensor]
ModuleSelector = Union[type, str]


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    attention_fn: Optional[AttentionFn] = None,
    **attention_kwargs: Any,
) -> torch.Tensor:
    """Attention over the full sequence from sequence-sharded ``q, k, v`` (differentiable; CPU/gloo and CUDA/nccl).

    Args:
        query: ``[B, Hq, s, D]``, this rank's positions ``[sp_rank·s, (sp_rank+1)·s)`` of the sequence.
        key, value: ``[B, Hkv, s, D]`` with ``Hq % Hkv == 0`` (MHA, GQA, MQA). Any head count works: heads that
            ``sp`` does not divide are split unevenly.
        group: the SP group (``strategy.sp_group``).
        attention_fn: ``fn(q [B, hq, S, D], k [B, hkv, S, D], v, **attention_kwargs) -> [B, hq, S, D]``; default
            ``torch.nn.functional.scaled_dot_product_attention`` (with ``enable_gqa`` when ``hq != hkv``).
        **attention_kwargs: passed to ``attention_fn``, e.g. ``is_causal=True``.

    Returns:
        ``[B, Hq, s, D]``: the attention output for this rank's positions, all heads.
    """
    q, k, v = sequence_to_head_shards(query, key, value, group)  # [B, hq, S, D], [B, hkv, S, D] ×2
    out = local_attention(q, k, v, attention_fn, attention_kwargs)  # [B, hq, S, D]
    out = head_to_sequence_shards(out.transpose(1, 2), group, query.shape[1])  # [B, s, Hq, D]
    return out.transpose(1, 2)  # [B, Hq, s, D]


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: Optional[AttentionFn],
                    attention_kwargs: dict) -> torch.Tensor:
    """``attention_fn(q, k, v, **attention_kwargs)`` on one rank's tensors, PyTorch SDPA by default (with
    ``enable_gqa`` when ``k`` has fewer heads than ``q``)."""
    if attention_fn is None:
        attention_fn = F.scaled_dot_product_attention
        if k.shape[1] != q.shape[1]:
            attention_kwargs = {"enable_gqa": True, **attention_kwargs}
    return attention_fn(q, k, v, **attention_kwargs)


class UlyssesAttention(nn.Module):
    """:func:`ulysses_attention` as a module: drop it in where your model calls its attention kernel.

    Args:
        attention_fn: the local attention (default: PyTorch SDPA).
        group: the SP group; ``None`` until the strategy (or you) set ``.group``.
        **attention_kwargs: fixed keyword arguments for ``attention_fn`` (e.g. ``is_causal=True``).
    """

    def __init__(self, attention_fn: Optional[AttentionFn] = None, group: Optional[dist.ProcessGroup] = None,
                 **attention_kwargs: Any) -> None:
        super().__init__()
        self.attention_fn = attention_fn
        self.group = group
        self.attention_kwargs = attention_kwargs
        self.ulysses_attention_core = True  # the strategy gives it the SP group in setup

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        context = on_instance(self, "_ulysses_context")
        if context is not None and context.plain:  # the model-form check's whole run: plain attention
            return local_attention(query, key, value, self.attention_fn, {**self.attention_kwargs, **kwargs})
        if self.group is None:
            raise RuntimeError("UlyssesAttention has no SP group: train with UlyssesDeepSpeedStrategy or set .group.")
        return ulysses_attention(query, key, value, self.group, self.attention_fn, **{**self.attention_kwargs,
                                                                                        **kwargs})


def find_attention_cores(root: nn.Module, selectors: Sequence[ModuleSelector]) -> list[tuple[str, nn.Module]]:
    """Modules of ``root`` that are attention cores: instances of a selector class, names matching a selector
    pattern (``fnmatch``, e.g. ``"blocks.*.attn.core"``), or modules with ``ulysses_attention_core = True``."""
    found = []
    for name, module in root.named_modules():
        if getattr(module, "ulysses_attention_core", False) or any(
            (isinstance(sel, type) and isinstance(module, sel)) or (isinstance(sel, str) and fnmatch.fnmatch(name, sel))
            for sel in selectors
        ):
            found.append((name, module))
    return found


_ORIGINAL_FORWARD = "_ulysses_original_forward"


def wrap_attention_core(module: nn.Module, group: dist.ProcessGroup, context: Any = None) -> None:
    """Make ``module`` sequence-parallel: its ``forward(q, k, v, **kw)`` (``[B, H, S, D]`` in and out) now takes
    and returns this rank's shards, and runs on the full sequence for its share of the heads. Idempotent. With the
    strategy's step ``context``, it runs as the plain core while ``context.plain`` (the model-form check's whole
    run)."""
    if isinstance(module, UlyssesAttention):
        module.group = group
        put_on_instance(module, "_ulysses_context", context)
        return
    if held_on_instance(module, _ORIGINAL_FORWARD):
        put_on_instance(module, "_ulysses_group", group)
        return
    original = module.forward
    put_on_instance(module, _ORIGINAL_FORWARD, original)
    put_on_instance(module, "_ulysses_group", group)

    def sequence_parallel_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                                  **kwargs: Any):
        if context is not None and context.plain:
            return original(query, key, value, *args, **kwargs)
        if args:
            raise TypeError(
                f"{type(module).__name__} is declared as an attention core, so it must be called as"
                " `core(q, k, v, **keywords)` with q, k, v of shape [B, H, S, D]; it was called with"
                f" {3 + len(args)} positional arguments. Declare the module that does the attention product itself"
                " (the one whose forward takes q, k, v), not the attention block around it (which takes hidden"
                " states, masks, positions)."
            )
        return ulysses_attention(query, key, value, on_instance(module, "_ulysses_group"), original, **kwargs)

    module.forward = sequence_parallel_forward  # type: ignore[method-assign]


def unwrap_attention_core(module: nn.Module) -> None:
    """Undo :func:`wrap_attention_core`."""
    if isinstance(module, UlyssesAttention):
        module.group = None
        take_from_instance(module, "_ulysses_context", None)
        return
    original = take_from_instance(module, _ORIGINAL_FORWARD, None)
    take_from_instance(module, "_ulysses_group", None)
    if original is not None:
        del module.forward
