"""What a call of a prepared model receives inside a step, completed or refused before any compute.

Under SP a model call sees only this rank's shard, so what a single-device call would derive from the row itself is
wrong on a shard: positions counted from 0, labels shifted inside the shard, a padding mask of the shard. A forward
pre-hook on every prepared model (:func:`install_call_completion`) fixes that for the ways people call their model:

* ``position_ids`` missing or ``None``: the shard's global positions (from the collate step); given ones must equal
  them (positions computed inside the step from the shard, e.g. ``torch.arange(s)``, would be wrong);
* ``attention_mask``: the batch's ``[B, s]`` padding mask (or all ones) is accepted and left out of the call: the
  collate step checked right padding, for which causal attention over the full sequence is exact;
* ``labels`` without ``shift_labels``: the next-token targets are built across shard boundaries (one all-gather of
  the first label of each run over the SP group; pads and packed-document starts are no targets);
* inputs whose sequence length is not the shard's (e.g. ``input_ids[:, :-1]``, a shift inside the shard) are refused
  with the replacement code.

A call outside a step (a callback running the model itself) is refused: its input is not a shard the strategy cut.
Run full batches with :meth:`~lightning_ulysses.UlyssesDeepSpeedStrategy.evaluate_full_batch` and generate with
``model.generate`` (plain generation, :mod:`lightning_ulysses.models.generation`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.data.halo import shift_labels_across_shards
from lightning_ulysses.models import position_numbering, vision_language
from lightning_ulysses.families.multimodal_positions import (given_multimodal_positions, multimodal_call_positions,
                                                           refuse_flat_packed_positions)
from lightning_ulysses.parallel.layout import group_size
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training.step_context import StepContext

_HOOK_HANDLE = "_ulysses_call_hook"

REPLACEMENT = (
    "    out = self.model(input_ids=batch[\"input_ids\"], position_ids=batch[\"position_ids\"])\n"
    "    loss = self.trainer.strategy.cross_entropy(out.logits, batch[\"shift_labels\"])"
)


def install_call_completion(model: nn.Module, context: StepContext, hf_model: bool) -> None:
    """Add the completing pre-hook to ``model`` (idempotent). ``hf_model``: a Hugging Face model (positions, mask and
    labels completed); else a module of the user's own model whose ``forward`` takes ``position_ids`` (positions
    only)."""
    if held_on_instance(model, _HOOK_HANDLE):
        return
    hook = functools.partial(_complete_hf_call if hf_model else _complete_own_call, context=context)
    put_on_instance(model, _HOOK_HANDLE, model.register_forward_pre_hook(hook, with_kwargs=True))


def has_call_completion(model: nn.Module) -> bool:
    """Whether ``model``'s completing pre-hook is installed and still registered on it."""
    handle = on_instance(model, _HOOK_HANDLE)
    return handle is not None and _compat.hook_is_registered(model, handle)


def remove_call_completion(model: nn.Module) -> None:
    handle = take_from_instance(model, _HOOK_HANDLE, None)
    if handle is not None:
        handle.remove()
    remove_backbone_call_completion(model)


_BACKBONE_HOOKS = "_ulysses_backbone_hooks"


def install_backbone_call_completion(model: nn.Module, backbone: nn.Module, context: StepContext) -> None:
    """Complete direct calls of a prepared model's backbone (``model.model(...)``, for an extra head on the hidden
    states) as calls of the model are completed: the shard's global positions, the batch's mask accepted. Calls of
    the backbone from inside the model's own forward (already completed) pass through: a pre-hook and an
    always-called post-hook on the model count how deep the step is inside it."""
    if held_on_instance(model, _BACKBONE_HOOKS):
        return

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        context.record.enter_prepared_model()

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        context.record.leave_prepared_model()

    def complete(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        if context.inside_prepared_model > 0:
            return None
        return _complete_hf_call(module, args, kwargs, context)

    put_on_instance(model, _BACKBONE_HOOKS, [
        model.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
        model.register_forward_hook(leave, with_kwargs=True, always_call=True),
        backbone.register_forward_pre_hook(complete, with_kwargs=True),
    ])


def remove_backbone_call_completion(model: nn.Module) -> None:
    for handle in take_from_instance(model, _BACKBONE_HOOKS, []):
        handle.remove()


def position_taking_roots(root: nn.Module, cores: list[nn.Module]) -> list[nn.Module]:
    """The outermost modules below ``root`` that contain one of ``cores`` and whose ``forward`` takes optional
    positions (``position_ids``, or LitGPT's ``input_pos``): an own model's top module, typically."""
    core_ids = {id(core) for core in cores}
    found: list[nn.Module] = []
    covered: set[int] = set()
    for _, module in root.named_modules():
        if module is root or id(module) in covered or position_parameter(module) is None:
            continue
        if any(id(m) in core_ids for m in module.modules()):
            found.append(module)
            covered.update(id(m) for m in module.modules())
    return found


POSITION_PARAMETERS = ("position_ids", "input_pos")


def position_parameter(module: nn.Module) -> Optional[str]:
    """The name of ``module.forward``'s optional positions parameter (``position_ids`` or ``input_pos``), if any."""
    signature = _signature(type(module))
    for name in POSITION_PARAMETERS:
        parameter = signature.parameters.get(name) if signature is not None else None
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return name
    return None


def accepts_position_ids(module: nn.Module) -> bool:
    """Whether ``module.forward`` has a ``position_ids`` parameter that may be left out."""
    return accepts_argument(module, "position_ids")


def accepts_argument(module: nn.Module, name: str) -> bool:
    """Whether ``module.forward`` takes ``name`` (by name, or through ``**kwargs``)."""
    signature = _signature(type(module))
    if signature is None:
        return False
    if name in signature.parameters:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


def _as_keywords(module: nn.Module, args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """The call's arguments by name (positional ones bound to ``forward``'s parameters), or ``None`` if they do not
    bind (the model's own error will say why)."""
    signature = _signature(type(module))
    if signature is None:
        return None
    try:
        bound = signature.bind_partial(module, *args, **kwargs)
    except TypeError:
        return None
    named: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:  # without `self`
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        else:
            named[name] = value
    return named


def outside_step_error(name: str) -> str:
    return (
        f"{name} was called outside a training/validation/test/predict step while UlyssesDeepSpeedStrategy has it"
        " prepared for sequence parallelism: its input is not a shard the strategy cut, so its attention would"
        " exchange the wrong tokens. From a callback, run a full batch (the same on every rank) with"
        " `trainer.strategy.evaluate_full_batch(model, batch)`, or generate with `model.generate(...)` (plain,"
        " unsharded generation)."
    )


def same_data(given: Any, batch: Any) -> bool:
    """Whether ``given`` is the step batch's tensor by what it is: a tensor over the same memory with the same layout.
    DeepSpeed's ZeRO-3 hooks hand each module ``detach()``ed copies of its inputs (new objects over the batch's
    memory), as wrappers may, so object identity would take them for other tensors. Decided on the host, without
    reading the device. A copy with its own memory (``clone()``, a dtype change) is not the batch's tensor."""
    if given is batch:
        return True
    return (isinstance(given, torch.Tensor) and isinstance(batch, torch.Tensor) and given.device == batch.device
            and given.dtype == batch.dtype and given.shape == batch.shape and given.stride() == batch.stride()
            and given.storage_offset() == batch.storage_offset()
            and given.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr())


def _same_tensor(given: Any, batch: Any) -> bool:
    """``given`` holds the step batch's tensor's values: its memory (:func:`same_data`), or a copy of it."""
    if same_data(given, batch):
        return True
    return (isinstance(given, torch.Tensor) and isinstance(batch, torch.Tensor) and given.shape == batch.shape
            and bool(torch.equal(given, batch.to(given.device))))


def own_numbering_copy_error(name: str) -> str:
    return (
        f"{name} numbers its positions itself when given none (RoBERTa-style embeddings: from padding_idx + 1), and"
        " this batch had no `position_ids` (the strategy's collate step filled in the shard's 0..S-1). The call was"
        " given `position_ids` that are not the batch's tensor (a copy, or positions computed in the step), so the"
        " strategy cannot tell whether one device would have numbered them itself (no `position_ids` in its batch)"
        " or used yours. Leave `position_ids` out of the call (the model numbers them as on one device) or pass"
        " `batch[\"position_ids\"]` itself."
    )


def num_items_error(name: str) -> str:
    return (
        f"{name} was given `num_items_in_batch`, which its loss divides the summed token losses by. Under sequence"
        " parallelism a count computed inside the step (e.g. `(batch[\"labels\"] != -100).sum()`) counts this rank's"
        " shard only, and the strategy cannot know what your expression means on the whole batch, so it refuses"
        " rather than replace it. Leave `num_items_in_batch` out: the loss is then the mean over the target tokens"
        " of the whole batch (over the whole accumulation window when accumulating), what one device computes for"
        " `model(**batch).loss`. For another weighting, compute the loss from the logits with"
        " `strategy.cross_entropy(logits, batch[\"shift_labels\"], weight=...)` (a weighted mean over the whole"
        " batch) or `strategy.token_mean(...)`."
    )


def _complete_hf_call(model: nn.Module, args: tuple, kwargs: dict, context: StepContext) -> Optional[tuple]:
    if context.plain:
        return None
    name = type(model).__name__
    if not context.in_step or context.shard_info is None:
        raise RuntimeError(outside_step_error(name))
    named = _as_keywords(model, args, kwargs)
    if named is None:
        return None
    if named.get("num_items_in_batch") is not None:
        raise ValueError(num_items_error(name))
    shard = context.shard_info
    tokens = named.get("input_ids")
    if tokens is None:
        tokens = named.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or shard.shard_shape is None:
        return None
    rows, length = _check_length(name, tokens, shard)  # shard shapes are equal on every SP rank
    given_positions, given_mask = named.get("position_ids"), named.pop("attention_mask", None)
    batch_tensors = context.step_batch_tensors
    # The batch's own tensors (recognised by their memory, not by object: ZeRO-3 hands modules detached copies) are
    # right by construction and need no check, so no device read. Anything else is compared with the shard's values,
    # which can fail on one rank and not on another (rank 0's positions start at 0 too), so the SP group agrees on the
    # verdict before anyone raises (one all-reduce, only on such calls).
    whole_rows = rows == shard.shard_shape[0]
    own_positions = given_positions is not None and whole_rows and same_data(given_positions,
                                                                              batch_tensors.get("position_ids"))
    own_mask = given_mask is not None and whole_rows and same_data(given_mask, batch_tensors.get("attention_mask"))
    trusted = (given_positions is None or own_positions) and (given_mask is None or own_mask)
    problem = None
    numbering = position_numbering.own_numbering_padding_index(model)
    try:
        named["position_ids"] = (given_positions if own_positions
                                 else _positions(name, given_positions, rows, shard, context, tokens.device))
        filled = given_positions is None or (shard.positions_filled and own_positions)
        if shard.positions_filled and not filled and numbering is not None:
            raise ValueError(own_numbering_copy_error(name))
        if filled:  # not the user's positions: numbered as the model numbers its own (RoBERTa-style embeddings)
            named["position_ids"] = position_numbering.numbered_as_the_model_does(
                named["position_ids"], named.get("input_ids"), numbering)
        if not own_mask:
            _check_attention_mask(name, given_mask, rows, shard)
    except ValueError as err:
        problem = err
    if not trusted:
        _agree_on_call(problem, name, context, tokens.device)
    elif problem is not None:
        raise problem
    refuse_flat_packed_positions(model, shard)  # an M-RoPE decoder packs only with [4, B, S] positions
    if given_multimodal_positions(shard):  # the batch's [4, B, S] / [3, B, S] positions, as one device gets them
        named["position_ids"] = multimodal_call_positions(named["position_ids"], shard.multimodal["position_ids"],
                                                          shard, rows)  # [4, rows, s]
    if vision_language.is_vision_language_model(model):
        vision_language.complete_call(model, named, shard, context)  # M-RoPE positions, this shard's image rows
    counted = shard.global_index[None, :] < shard.seq_len  # [1, s]: not the padding to the SP multiple
    if given_mask is not None and shard.attention_mask is not None:
        counted = counted & shard.attention_mask[:rows].bool()
    context.record.record_router_token_mask(counted.expand(rows, length))
    masked_lm = getattr(model, "loss_type", None) == "ForMaskedLM"
    if masked_lm and named.get("labels") is not None and _same_tensor(named.get("shift_labels"),
                                                                      batch_tensors.get("shift_labels")):
        named.pop("shift_labels", None)  # the collate step's next-token targets mean nothing to a masked LM
    if getattr(model, "loss_type", None) == "ForSequenceClassification":
        return (), named  # its labels are per row: its pooling and loss run over the whole sequence
    if (not masked_lm and named.get("labels") is not None and not same_data(named["labels"], batch_tensors.get("labels"))
            and _same_tensor(named.get("shift_labels"), batch_tensors.get("shift_labels"))):
        # labels edited in the step (`batch["labels"] = batch["labels"].masked_fill(...)`, then `**batch`): the
        # collate step's shift_labels were built from the loader's labels, so they are built again from these (the
        # same on every rank: each one ran the same step code, so every SP rank takes this branch)
        named.pop("shift_labels")
    if named.get("labels") is not None and named.get("shift_labels") is None:
        labels = named["labels"]
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape[:2]) != shard.shard_shape:
            raise ValueError(
                f"{name} was given `labels` of shape {_shape(labels)} but this rank's shard is {list(shard.shard_shape)}"
                ": under sequence parallelism labels must be the shard's (e.g. `batch[\"labels\"]` or"
                " `batch[\"input_ids\"]`), so that their next-token targets can be built across the shard boundary."
            )
        if masked_lm and shard.window_tokens is not None:
            raise ValueError(
                f"{name} is a masked LM trained with gradient accumulation: the strategy counts an accumulation"
                " window's target tokens as next-token targets, which a masked LM does not have, so the loss"
                " would be normalised by the wrong count. Train masked LMs under sequence parallelism with"
                " accumulate_grad_batches=1 (a larger batch instead)."
            )
        if masked_lm:
            named["shift_labels"] = labels  # a masked LM's target at each position is its own label: no shift
        else:
            named["shift_labels"] = shift_labels_across_shards(labels, shard, context.sp_group)
    return (), named


def _complete_own_call(module: nn.Module, args: tuple, kwargs: dict, context: StepContext) -> Optional[tuple]:
    """Positions only, for a module of the user's own model whose forward takes ``position_ids`` or ``input_pos``."""
    if context.plain or not context.in_step or context.shard_info is None or context.shard_info.shard_shape is None:
        return None
    parameter = position_parameter(module)
    named = _as_keywords(module, args, kwargs)
    if parameter is None or named is None or named.get(parameter) is not None:
        return None
    tokens = next((v for v in named.values() if isinstance(v, torch.Tensor) and v.ndim >= 2), None)
    if tokens is None or tokens.shape[1] != context.shard_info.shard_shape[1]:
        return None
    named[parameter] = _positions(type(module).__name__, None, int(tokens.shape[0]), context.shard_info, context,
                                  tokens.device)
    return (), named


_REFUSED_ON_A_PEER = 1


def _agree_on_call(problem: Optional[ValueError], name: str, context: StepContext, device: torch.device) -> None:
    """Raise on every rank of the SP group if the call was refused on any of them."""
    verdict = torch.tensor([0 if problem is None else _REFUSED_ON_A_PEER], dtype=torch.int32, device=device)
    if group_size(context.sp_group) > 1:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=context.sp_group)  # [1]: refused anywhere?
    if problem is not None:
        raise problem
    if int(verdict.item()):
        raise ValueError(
            f"{name} was refused on another rank of this sequence-parallel group: the `position_ids` or"
            " `attention_mask` given to the model there are not that rank's positions / the batch's padding mask"
            " (see that rank's error). Leave them out of the call (the strategy fills in the shard's positions) or"
            " pass the batch's own `batch[\"position_ids\"]` / `batch[\"attention_mask\"]`."
        )


def _shape(value: Any) -> Any:
    return list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_length(name: str, tokens: torch.Tensor, shard: ShardInfo) -> tuple[int, int]:
    B, s = shard.shard_shape  # type: ignore[misc]
    rows, length = int(tokens.shape[0]), int(tokens.shape[1]) if tokens.ndim >= 2 else -1
    if length != s:
        shifted = " (one token short: a shift inside the shard, like `input_ids[:, :-1]`)" if length == s - 1 else ""
        raise ValueError(
            f"{name} was called on a sequence of {length} tokens{shifted}, but this rank's shard of the batch has {s}"
            f" (the full batch's {shard.seq_len} tokens cut over the sequence-parallel ranks). Under sequence"
            " parallelism call the model on the shard as the batch gives it and let the collate step's"
            " `shift_labels` hold the next-token targets (built before the sequence was cut):\n" + REPLACEMENT
        )
    if rows > B:
        raise ValueError(f"{name} was called on {rows} rows, but this step's batch has {B}.")
    return rows, length


def _positions(name: str, given: Any, rows: int, shard: ShardInfo, context: StepContext,
               device: torch.device) -> torch.Tensor:
    """The shard's global positions ``[rows, s]`` on ``device``; ``given`` positions must equal them."""
    expected = context.record.device_positions(shard, device)  # [B, s]
    B = expected.shape[0]
    if rows != B:
        if not bool((expected == expected[:1]).all()):
            raise ValueError(f"{name} was called on {rows} of the batch's {B} rows, whose positions differ (packed"
                             " documents): pass `position_ids` of those rows from the batch.")
        expected = expected[:rows]
    if given is None:
        return expected
    if not isinstance(given, torch.Tensor) or given.shape[-1] != expected.shape[-1] or not bool(
            (given.to(expected.device) == expected).all()):
        raise ValueError(
            f"{name} was given `position_ids` that are not this rank's positions in the sequence (expected the"
            f" batch's `position_ids`, global positions {int(expected[0, 0])}..{int(expected[0, -1])} on this rank)."
            " Under sequence parallelism each rank holds a slice of the sequence, so positions computed inside the"
            " step (e.g. `torch.arange(input_ids.shape[1])`) restart at 0 on every rank. Leave `position_ids` out"
            " (the strategy fills them in) or pass `batch[\"position_ids\"]`."
        )
    return given


def _check_attention_mask(name: str, mask: Any, rows: int, shard: ShardInfo) -> None:
    """Accept the batch's padding mask (or all ones); anything else would change attention in a way the full-sequence
    causal attention does not reproduce."""
    if mask is None:
        return
    B, s = shard.shard_shape  # type: ignore[misc]
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and tuple(mask.shape) == (rows, s):
        if bool(mask.bool().all()):
            return
        if shard.attention_mask is not None and bool(
                (mask.bool().cpu() == shard.attention_mask[:rows].bool()).all()):
            return
    raise ValueError(
        f"{name} was given an `attention_mask` ({_shape(mask)}) that is not this step's padding mask: under sequence"
        " parallelism the strategy runs causal attention over the full sequence, which is exact for the batch's own"
        " right-padding mask (`batch[\"attention_mask\"]`, checked by the collate step) and for no mask. Pass the"
        " batch's mask or none; custom masks are not supported."
    )
