"""``model.generate(...)`` during fit (e.g. from a callback): plain, unsharded generation on every rank or on one.

A prepared model exchanges sequence shards inside attention; generation instead runs the whole prompt on each rank
that calls it, so :func:`install_plain_generate` wraps the prepared model's ``generate`` to run it in
:func:`lightning_ulysses.models.hf.plain_mode` (the model's own attention and KV cache, no collective).

* ZeRO 0-2: every rank holds all weights, so generation needs no other rank: it works on every rank (greedy decoding
  gives every rank the same tokens) and on one rank alone (``if trainer.is_global_zero``).
* ZeRO-3: weights are partitioned, so every forward pass gathers them from all ranks; generation must run on every
  rank, with ``synced_gpus=True`` (set here) so that ranks finishing early keep joining the gathers. A rendezvous
  through the process group's store comes first: if not every rank arrives within :data:`RENDEZVOUS_SECONDS`
  (generation called on one rank only) this rank raises a clear error instead of hanging in the first gather.

Inside a step (``predict_step``, ``validation_step``, ...) the prompt a user passes is the batch's ``input_ids``:
this rank's shard. Generation then runs on the whole prompt, gathered over the SP group (one all-gather of the token
ids, and of the ``attention_mask`` when given), so every rank returns one device's tokens.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

import torch
from torch import nn

from lightning_ulysses.models import hf
from lightning_ulysses.parallel.layout import group_rank, group_size
from lightning_ulysses.patches import held_on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training import sequence_reductions
from lightning_ulysses.training.step_context import StepContext

RENDEZVOUS_SECONDS = float(os.environ.get("ULYSSES_GENERATE_RENDEZVOUS_SECONDS", 30))
_ORIGINAL = "_ulysses_original_generate"


class GenerationRendezvousError(RuntimeError):
    """``generate()`` at ZeRO-3 was not called on every rank."""


def install_plain_generate(model: nn.Module, context: StepContext, zero_stage_3: bool) -> None:
    """Make ``model.generate`` plain generation while the model is prepared (idempotent; undone by
    :func:`remove_plain_generate`)."""
    if held_on_instance(model, _ORIGINAL) or not callable(getattr(model, "generate", None)):
        return
    original: Callable[..., Any] = model.generate
    put_on_instance(model, _ORIGINAL, original)
    calls = {"n": 0}

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _whole_prompt(args, kwargs, context)
        if zero_stage_3 and group_size() > 1:
            calls["n"] += 1
            _rendezvous(f"ulysses_generate/{calls['n']}", type(model).__name__)
            kwargs.setdefault("synced_gpus", True)
        with hf.plain_mode(model, context):
            return original(*args, **kwargs)

    put_on_instance(model, "generate", generate)


def _whole_prompt(args: tuple, kwargs: dict, context: StepContext) -> tuple[tuple, dict]:
    """Inside a step, a prompt that is this rank's shard of the batch (``[B, s]``) replaced by the whole rows
    (``[B, S]``, gathered over the SP group), its ``attention_mask`` too; anything else as given."""
    shard = context.shard_info
    if not context.in_step or shard is None or shard.shard_shape is None or context.plain:
        return args, kwargs
    prompt = args[0] if args else kwargs.get("input_ids")
    if not isinstance(prompt, torch.Tensor) or prompt.ndim != 2 or tuple(prompt.shape) != tuple(shard.shard_shape):
        return args, kwargs
    whole = sequence_reductions.gather_sequence(prompt, shard, context.sp_group, None)  # [B, s] -> [B, S]
    if args:
        args = (whole, *args[1:])
    else:
        kwargs = {**kwargs, "input_ids": whole}
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(shard.shard_shape):
        kwargs["attention_mask"] = sequence_reductions.gather_sequence(mask, shard, context.sp_group, None)
    return args, kwargs


def remove_plain_generate(model: nn.Module) -> None:
    if take_from_instance(model, _ORIGINAL, None) is not None:
        take_from_instance(model, "generate", None)


def _rendezvous(key: str, name: str) -> None:
    """Wait until every rank has reached this generate call; raise if they do not within the time limit."""
    from torch.distributed.distributed_c10d import _get_default_store

    store, world = _get_default_store(), group_size()
    store.add(key, 1)
    deadline = time.monotonic() + RENDEZVOUS_SECONDS
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise GenerationRendezvousError(
                f"{name}.generate() was called on rank {group_rank()} but only {store.add(key, 0)} of the {world}"
                f" ranks arrived within {RENDEZVOUS_SECONDS:.0f} s. Under ZeRO stage 3 every rank holds a part of the"
                " weights and every forward pass gathers them from all ranks, so generation must run on every rank:"
                " call generate() on all ranks (not under `if trainer.is_global_zero` / `@rank_zero_only`) and log"
                " the text from rank 0, or train with ZeRO stage 1 or 2, where one rank can generate alone."
            )
        time.sleep(0.01)
