"""ALST memory features for Hugging Face causal LMs, switched on per model and removed after the Trainer finishes.

* **Tiled MLP** (DeepSpeed's ``TiledMLP``): each decoder layer's MLP runs on ``tiles`` slices of the sequence and is
  recomputed slice by slice in backward, so the ``[s, intermediate]`` activations never exist for the whole shard.
* **Tiled logits + loss**: the LM head and the cross-entropy run on ``chunks`` slices of the sequence under
  activation checkpointing, so the ``[s, vocab]`` logits exist for one slice at a time, in forward and backward.
  The normalisation happens on the summed loss *outside* the chunks, through autograd (DeepSpeed's
  ``TiledFusedLogitsLoss`` computes weight gradients inside its forward, where a later scale is lost).
* **Checkpoint offload**: decoder layers run under activation checkpointing (``use_reentrant=False``) and the tensors
  autograd keeps (the layer inputs) move to host memory until backward (tensors already on the host stay put).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ulysses.context import StepContext
from lightning_ulysses.loss import IGNORE_INDEX, normalize_loss_sum, step_normalization


@dataclass(frozen=True)
class MemoryFeatures:
    """Which features to switch on (all off by default)."""

    tiled_mlp: int = 0  # number of sequence tiles per MLP call (0: off)
    tiled_loss: int = 0  # number of sequence chunks for LM head + loss (0: off)
    offload_checkpoints: bool = False  # checkpoint decoder layers, keep the checkpoints in CPU memory

    @property
    def any(self) -> bool:
        return bool(self.tiled_mlp or self.tiled_loss or self.offload_checkpoints)


_SAVED = "_ulysses_memory_saved"


def _decoder_mlps(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith(".mlp") and hasattr(m, "forward")]


def enable(model: nn.Module, features: MemoryFeatures, context: Optional[StepContext]) -> None:
    """Switch ``features`` on for the Hugging Face causal LM ``model`` (undo with :func:`disable`)."""
    if not features.any or _SAVED in model.__dict__:
        return
    saved: dict[str, Any] = {"mlps": [], "forward": None, "checkpointing": False}
    if features.tiled_mlp:
        for mlp in _decoder_mlps(model):
            _tile_mlp(mlp, features.tiled_mlp)
            saved["mlps"].append(mlp)
    if features.tiled_loss or features.offload_checkpoints:
        saved["forward"] = model.__dict__.get("forward")
        model.forward = _memory_forward(model, features, context)  # type: ignore[method-assign]
    if features.offload_checkpoints:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        saved["checkpointing"] = True
    model.__dict__[_SAVED] = saved


def disable(model: nn.Module) -> None:
    saved = model.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    for mlp in saved["mlps"]:
        mlp.__dict__.pop("forward", None)
    if "forward" in model.__dict__:
        del model.forward
    if saved["forward"] is not None:
        model.forward = saved["forward"]
    if saved["checkpointing"]:
        model.gradient_checkpointing_disable()


def _tile_mlp(mlp: nn.Module, tiles: int) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    original = type(mlp).forward
    params = list(mlp.parameters())

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:  # x: [B, s, H]
        # A fixed tile count keeps the number of ZeRO-3 gathers equal on every rank.
        return TiledMLP.apply(original, mlp, x, tiles, params)

    mlp.forward = tiled_forward  # type: ignore[method-assign]


def _memory_forward(model: nn.Module, features: MemoryFeatures, context: Optional[StepContext]):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward.__get__(model)

    def forward(*args: Any, labels: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
                **kwargs: Any):
        saving = _offload_to_host() if features.offload_checkpoints and torch.is_grad_enabled() else _null()
        with saving:
            if not features.tiled_loss or (labels is None and shift_labels is None):
                return original(*args, labels=labels, shift_labels=shift_labels, **kwargs)
            hidden = model.base_model(*args, **kwargs).last_hidden_state  # [B, s, H]
            if shift_labels is None:
                raise ValueError("Tiled loss needs `shift_labels` (the strategy's collate step adds them).")
            local_sum = tiled_cross_entropy_sum(hidden, model.get_output_embeddings(), shift_labels,
                                                features.tiled_loss)
            if context is None:
                scale, window, group = 1.0, None, None
            else:
                (scale, window), group = step_normalization(context), context.loss_group
            loss = normalize_loss_sum(local_sum, shift_labels, group, scale, IGNORE_INDEX, window)
            return CausalLMOutputWithPast(loss=loss, logits=None)

    return forward


def _offload_to_host() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved tensors on an accelerator move to (pinned) host memory until backward; host tensors stay as they are
    (``torch.autograd.graph.save_on_cpu`` would copy them, doubling what it should save)."""

    def pack(tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return tensor.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tiled_cross_entropy_sum(hidden: torch.Tensor, lm_head: nn.Module, shift_labels: torch.Tensor,
                            chunks: int) -> torch.Tensor:
    """``sum(CE(lm_head(hidden), shift_labels))`` over valid tokens with only one chunk's logits alive at a time.

    ``hidden [B, s, H]``, ``shift_labels [B, s]``; each chunk's logits are recomputed in backward.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.chunk(chunks, dim=1), shift_labels.chunk(chunks, dim=1)):
        total = total + checkpoint(_chunk_loss_sum, h, y, lm_head, use_reentrant=False)
    return total


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    logits = lm_head(hidden).float()  # [B, c, V]: one chunk only
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")
