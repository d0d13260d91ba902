"""Ulysses attention and the SP loss for Hugging Face ``PreTrainedModel``s, installed and removed per model.

Nothing process-global is replaced: the Ulysses attention functions are *added* to transformers'
``AttentionInterface`` under their own names (``ulysses_sdpa``, ...). Preparing a model points its config at those
names, gives its modules the SP group, installs the SP loss and turns the KV cache off; :func:`restore_model` undoes
all of it, so a model is plain again after ``trainer.fit`` and two Trainers can follow each other in one process.
"""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_ulysses.calls import install_call_completion, remove_call_completion
from lightning_ulysses.context import ShardInfo, StepContext
from lightning_ulysses.exchange import head_to_sequence_shards, sequence_to_head_shards
from lightning_ulysses.moe import has_load_balancing_loss
from lightning_ulysses.mixers import (
    find_sequence_mixers,
    uncovered_sequence_convolutions,
    unwrap_sequence_mixer,
    wrap_sequence_mixer,
)
from lightning_ulysses.loss import SequenceParallelLossFunction
from lightning_ulysses.ring import causal_window_mask, ring_attention

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_PREFIX = "ulysses_"
_CONTEXT_ATTR = "_ulysses_step_context"
# Keyword arguments that describe the *local* shard's positions; the attention over the full sequence must not see them.
_LOCAL_POSITION_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _pretrained_model_class() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


def find_pretrained_models(root: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face ``PreTrainedModel``s inside ``root`` (``root`` itself included)."""
    pretrained = _pretrained_model_class()
    found: list[nn.Module] = []
    covered: set[int] = set()
    for module in root.modules():
        if id(module) in covered or not isinstance(module, pretrained):
            continue
        found.append(module)
        covered.update(id(m) for m in module.modules())
    return found


def _configs(model: nn.Module) -> Iterator[Any]:
    config = model.config
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield sub


def validate_model(model: nn.Module, sp_size: int, device_type: str, ring_size: int = 1) -> None:
    """Raise a ``ValueError`` (before any compute) if ``model`` cannot run Ulysses attention at ``sp_size`` (the
    Ulysses part of it: ``sp_size / ring_size`` ranks share the heads)."""
    name = type(model).__name__
    impl = model.config._attn_implementation
    if impl is not None and impl.startswith(_PREFIX):
        impl = impl[len(_PREFIX) :]
    if not has_attention(model) and sequence_mixers(model):  # a pure state-space model: no attention to shard
        refuse_unsupported_architecture(model)
        if ring_size > 1:
            raise ValueError(f"{name} has no attention, only sequence mixers: use ring_size=1.")
        return
    if impl not in SUPPORTED_ATTENTION:
        usable = supported_implementations(model)
        raise ValueError(
            f"{name} uses attn_implementation={impl!r}, which UlyssesDeepSpeedStrategy cannot shard. Under sequence"
            f" parallelism it runs {list(SUPPORTED_ATTENTION)} ('flash_attention_2/3' and 'flex_attention' on CUDA);"
            + (f" {name} supports {usable}: build it with one of them, e.g."
               f" `AutoModelForCausalLM.from_config(config, attn_implementation={usable[0]!r})`"
               f" or `model.set_attn_implementation({usable[0]!r})`."
               if usable else f" {name} supports none of them, so it cannot train under sequence parallelism.")
            + (" On CPU only 'sdpa' runs, which this model does not support." if "sdpa" not in usable else "")
        )
    refuse_unsupported_architecture(model)
    if ring_size > 1 and sequence_mixers(model):
        raise ValueError(
            f"{name} has sequence mixers other than attention ({sorted({type(m).__name__ for m in sequence_mixers(model)})}),"
            f" which run on the whole sequence gathered over the SP group; with ring_size={ring_size} the shards are"
            " not contiguous. Use ring_size=1 for this architecture."
        )
    if ring_size > 1:
        if impl != "sdpa":
            raise ValueError(
                f"{name}: ring_size={ring_size} runs its ring attention with 'sdpa' only (this model:"
                f" {impl!r}); build the model with attn_implementation='sdpa' or use ring_size=1."
            )
        if any(_calls_sdpa_directly(m) for m in model.modules()):
            raise ValueError(f"{name} computes attention itself (direct SDPA calls): not supported with"
                             f" ring_size={ring_size}; use ring_size=1.")
    sp_size = sp_size // ring_size  # the heads are split over the Ulysses ranks only
    if impl == "flex_attention" and device_type == "cpu":
        raise ValueError(
            f"{name} uses attn_implementation='flex_attention', which has no backward pass on CPU in this PyTorch."
            " Use attn_implementation='sdpa' on CPU (flex_attention works on CUDA)."
        )
    for config in _configs(model):
        heads = getattr(config, "num_attention_heads", None)
        if heads is None:
            continue
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads < sp_size:
            what = f"sp_size={sp_size}" if ring_size == 1 else f"the Ulysses part sp_size/ring_size={sp_size}"
            raise ValueError(
                f"{name} has num_attention_heads={heads}, fewer than {what}: some SP ranks would hold"
                f" no head. Use sp_size <= {heads}, or split the sequence further with ring attention:"
                f" `UlyssesDeepSpeedStrategy(sp_size=..., ring_size=r)` with sp_size / r <= {heads}."
            )
        if heads % kv_heads != 0:
            raise ValueError(
                f"{name} has num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads};"
                " Ulysses attention needs whole query groups per KV head."
            )


def supported_implementations(model: nn.Module) -> list[str]:
    """Which of the implementations Ulysses attention wraps the model's class supports (transformers' flags)."""
    cls = type(model)
    flags = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
             "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}
    return [impl for impl, flag in flags.items() if getattr(cls, flag, False)]


_ATTENTION_LAYER_KINDS = {"full_attention", "sliding_attention"}
# Class names of sequence mixers other than attention; any of them that the mixer exchange does not take (found by
# structure, see lightning_ulysses.mixers) is refused.
_MIXER_CLASS = re.compile(r"(mixer|deltanet|deltaattention|shortconv|linearattention|lightningattention|recurrent\w*"
                          r"|rglru\w*|rwkv\w*|ssm)$", re.IGNORECASE)


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has attention modules the Ulysses exchange serves."""
    return any(_uses_attention_interface(m) for m in model.modules())


def sequence_mixers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that mix the sequence without attention and run whole under SP
    (:mod:`lightning_ulysses.mixers`)."""
    return find_sequence_mixers(model, _uses_attention_interface)


def _uses_attention_interface(module: nn.Module) -> bool:
    """An attention module that the Ulysses exchange serves (through transformers' interface or direct SDPA)."""
    if not re.search(r"Attention\d*$", type(module).__name__):
        return False
    source = _forward_source(module) or ""
    return ("ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source
            or "scaled_dot_product_attention(" in source)


def refuse_unsupported_architecture(model: nn.Module) -> None:
    """Raise a ``ValueError`` (before compute) for architectures whose training under SP would be silently wrong:

    * layers that mix the sequence without attention (linear attention, gated delta nets, Mamba/SSM, convolutions
      over the sequence): under SP they would see only the rank's shard;
    * attention modules that call SDPA themselves instead of transformers' attention interface (their attention
      would skip the exchange);
    * the MoE router's auxiliary load-balancing loss (``output_router_logits=True``), which transformers computes
      from this rank's tokens only.
    """
    name = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})"
    kinds: set[str] = set()
    for config in _configs(model):
        for key in ("layer_types", "layers_block_type"):
            kinds.update(str(kind) for kind in (getattr(config, key, None) or []))
    other_kinds = sorted(kinds - _ATTENTION_LAYER_KINDS)
    mixers = sequence_mixers(model)
    covered = {id(m) for mixer in mixers for m in mixer.modules()}
    unknown = sorted({f"{module_name} ({type(module).__name__})" for module_name, module in model.named_modules()
                      if id(module) not in covered and _MIXER_CLASS.search(type(module).__name__)
                      and not _uses_attention_interface(module)})
    unknown += uncovered_sequence_convolutions(model, mixers)
    if unknown or (other_kinds and not mixers):
        raise ValueError(
            f"{name} mixes the sequence outside attention"
            + (f" (layer kinds {other_kinds})" if other_kinds and not mixers else "")
            + (f" in {unknown[:4]}{' ...' if len(unknown) > 4 else ''}" if unknown else "")
            + " in a way the strategy does not recognise (a sequence mixer owns an `A_log` parameter, a depthwise"
            " `nn.Conv1d` over the sequence or lightning attention's decay buffers). Under sequence parallelism"
            " those layers would see only this rank's shard of the sequence (a recurrence restarting at every"
            " shard, a convolution missing the previous shard's tokens) and train a different model without an"
            " error: train this architecture with sp_size=1."
        )
    bypassing = [module for module in model.modules()
                 if id(module) not in covered and _bypasses_attention_interface(module)]
    if bypassing:
        classes = sorted({type(module).__name__ for module in bypassing})
        impl = attention_implementation(model)
        if impl != "sdpa" or not all(_calls_sdpa_directly(module) for module in bypassing):
            raise ValueError(
                f"{name}: {classes} compute attention themselves instead of through transformers' attention"
                " interface; the strategy can put the Ulysses exchange around them only when they call torch's"
                f" scaled_dot_product_attention, i.e. with attn_implementation='sdpa' (this model: {impl!r})."
                " Build it with attn_implementation='sdpa', or train with sp_size=1."
            )
        if getattr(model.config, "alibi", False):
            raise ValueError(
                f"{name} uses ALiBi position biases (config.alibi=True), which it adds to the attention scores of"
                " each rank's shard outside any exchange. This architecture cannot train under sequence parallelism"
                " with ALiBi; use sp_size=1."
            )
    known = _KNOWN_UNSHARDABLE.get(getattr(model.config, "model_type", None))
    if known:
        raise ValueError(f"{name} {known}: UlyssesDeepSpeedStrategy's attention cannot shard that, so it cannot"
                         " train under sequence parallelism; use sp_size=1.")
    for config in _configs(model):
        if has_load_balancing_loss(model) or "aux_loss" not in (_forward_source(model) or "aux_loss"):
            break  # computed over the whole global batch (lightning_ulysses.moe), or not computed at all
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 1.0):
            raise ValueError(
                f"{name} has output_router_logits=True: transformers computes the MoE load-balancing loss from the"
                " router statistics of this rank's tokens only, so under sequence parallelism its value and"
                " gradients differ from the whole batch's (and between ranks). Set `output_router_logits=False`"
                " (or `router_aux_loss_coef=0`) for training under SP."
            )


# Architectures whose attention takes inputs the exchange cannot shard, known before any compute (the attention
# function also refuses a mask that requires grad at the first forward, for models not listed here).
_KNOWN_UNSHARDABLE = {
    "doge": "passes a learned per-key bias (its dynamic mask) to attention through attention_mask",
    "qwen4_exp_text": "uses indexed attention (each query attends to the keys an indexer selects from the whole"
                      " sequence, through a full 4-D mask)",
}


def _forward_source(module: nn.Module) -> Optional[str]:
    return _class_forward_source(type(module))


@functools.lru_cache(maxsize=None)
def _class_forward_source(cls: type) -> Optional[str]:
    """The source of ``cls.forward``, read once per class (models hold one attention class per layer)."""
    import inspect

    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def _bypasses_attention_interface(module: nn.Module) -> bool:
    """An attention module (class name ending in ``Attention``/``Attention2``) whose forward never dispatches
    through transformers' attention interface."""
    import re

    if not re.search(r"Attention\d*$", type(module).__name__):
        return False
    source = _forward_source(module)
    if source is None:
        return False
    return not ("ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source)


def _calls_sdpa_directly(module: nn.Module) -> bool:
    source = _forward_source(module) or ""
    return _bypasses_attention_interface(module) and "scaled_dot_product_attention(" in source


@dataclass
class _SavedModelState:
    attn_implementation: Any
    use_cache: Any
    had_loss_function: bool
    loss_function: Any
    marked_modules: list[nn.Module] = field(default_factory=list)
    direct_sdpa_modules: list[nn.Module] = field(default_factory=list)
    mixers: list[nn.Module] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)


_SAVED = "_ulysses_saved_state"


def prepare_model(model: nn.Module, context: StepContext) -> None:
    """Point ``model`` at Ulysses attention over ``context.sp_group`` and at the SP loss. Idempotent; undone by
    :func:`restore_model`."""
    saved: Optional[_SavedModelState] = model.__dict__.get(_SAVED)
    if saved is None:
        config = model.config
        saved = _SavedModelState(
            attn_implementation=config._attn_implementation,
            use_cache=getattr(config, "use_cache", None),
            had_loss_function="_loss_function" in model.__dict__,
            loss_function=model.__dict__.get("_loss_function"),
        )
        impl = config._attn_implementation
        direct = [m for m in model.modules() if _calls_sdpa_directly(m)]
        if direct:
            # These call torch's SDPA themselves when the implementation is exactly "sdpa": keep the name and put
            # the exchange around the SDPA calls of their forward instead.
            for module in direct:
                module.__dict__["forward"] = _with_ulysses_sdpa(module, context)
            saved.direct_sdpa_modules = direct
        elif not impl.startswith(_PREFIX) and has_attention(model):
            config._attn_implementation = _PREFIX + impl  # also sets the sub-configs
        saved.mixers = sequence_mixers(model)
        for mixer in saved.mixers:
            wrap_sequence_mixer(mixer, context)
        if saved.use_cache is not None:
            config.use_cache = False  # a KV cache of one shard is useless and would size masks wrongly
        model.__dict__[_SAVED] = saved
    # Every module that dispatches attention holds a config; give each the step context (SP group, documents).
    saved.marked_modules = [m for m in model.modules() if hasattr(m, "config")]
    for module in saved.marked_modules:
        module.__dict__[_CONTEXT_ATTR] = context
    model.loss_function = SequenceParallelLossFunction(context)
    if not saved.hooks:
        saved.hooks.append(model.register_forward_pre_hook(_refuse_router_aux_loss, with_kwargs=True))
    install_call_completion(model, context, hf_model=True)


def _refuse_router_aux_loss(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """``model(..., output_router_logits=True)`` asks for the MoE load-balancing loss in this call, which
    transformers would compute from this rank's tokens only (the config-level switch is refused before compute)."""
    coefficient = getattr(model.config, "router_aux_loss_coef", 1.0)
    with_loss = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
    if kwargs.get("output_router_logits") and coefficient and with_loss and not has_load_balancing_loss(model):
        raise ValueError(
            f"{type(model).__name__} was called with output_router_logits=True: transformers computes the MoE"
            " load-balancing loss from the router statistics of this rank's tokens only, so under sequence"
            " parallelism the loss value and gradients differ from the whole batch's. Leave output_router_logits"
            " off when passing labels under SP."
        )


def restore_model(model: nn.Module) -> None:
    """Undo :func:`prepare_model`: the model's attention, cache setting and loss are what they were before."""
    saved: Optional[_SavedModelState] = model.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    model.config._attn_implementation = saved.attn_implementation
    if saved.use_cache is not None:
        model.config.use_cache = saved.use_cache
    for module in saved.marked_modules:
        module.__dict__.pop(_CONTEXT_ATTR, None)
    for module in saved.direct_sdpa_modules:
        module.__dict__.pop("forward", None)
    for mixer in saved.mixers:
        unwrap_sequence_mixer(mixer)
    for hook in saved.hooks:
        hook.remove()
    remove_call_completion(model)
    if saved.had_loss_function:
        model.__dict__["_loss_function"] = saved.loss_function
    else:
        model.__dict__.pop("_loss_function", None)


def is_prepared(model: nn.Module) -> bool:
    return _SAVED in model.__dict__


@contextmanager
def plain_mode(model: nn.Module, context: StepContext) -> Iterator[None]:
    """Inside the block the prepared ``model`` runs as the plain model it was before preparation (its own attention
    implementation and cache setting, no exchange, no call completion): for ``generate()`` during fit."""
    saved: Optional[_SavedModelState] = model.__dict__.get(_SAVED)
    if saved is None:
        yield
        return
    config = model.config
    prepared_impl, prepared_cache = config._attn_implementation, getattr(config, "use_cache", None)
    config._attn_implementation = saved.attn_implementation
    if saved.use_cache is not None:
        config.use_cache = saved.use_cache
    context.plain = True
    try:
        yield
    finally:
        context.plain = False
        config._attn_implementation = prepared_impl
        if prepared_cache is not None:
            config.use_cache = prepared_cache


class _LocalHeadsView:
    """The attention module as the inner attention function must see it after the exchange: same attributes, but
    ``num_key_value_groups`` counts the heads this rank holds (it differs when KV heads were replicated)."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _with_ulysses_sdpa(module: nn.Module, context: StepContext) -> Callable[..., Any]:
    """``module.forward`` with every ``torch.nn.functional.scaled_dot_product_attention`` call it makes (shards in,
    ``[B, H, s, D]``) turned into a Ulysses exchange around causal SDPA over the full sequence."""
    import torch.nn.functional as F

    original_forward = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if context.plain:
            return original_forward(module, *args, **kwargs)
        original_sdpa = F.scaled_dot_product_attention

        def ulysses_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
            name = type(module).__name__
            if attn_mask is not None and not _is_local_causal_mask(attn_mask, query.shape[2]):
                raise ValueError(f"{name} passes SDPA an attention mask that is more than causal; under sequence"
                                 " parallelism only causal attention (right padding, no mask) is supported for"
                                 " this architecture.")
            if context.shard is not None and context.shard.packed:
                raise ValueError(f"{name} computes attention itself: packed documents are not supported for this"
                                 " architecture under sequence parallelism (one document per row).")
            q, k, v = sequence_to_head_shards(query.contiguous(), key.contiguous(), value.contiguous(),
                                              context.sp_group)  # [B, hq, S, D], [B, hkv, S, D] x2
            causal = bool(getattr(module, "is_causal", True)) or is_causal
            out = original_sdpa(q, k, v, dropout_p=dropout_p, is_causal=causal and q.shape[2] > 1, scale=scale,
                                enable_gqa=q.shape[1] != k.shape[1])  # [B, hq, S, D]
            shards = head_to_sequence_shards(out.transpose(1, 2), context.sp_group, query.shape[1])  # [B, s, Hq, D]
            return shards.transpose(1, 2)  # [B, Hq, s, D], as SDPA returns

        F.scaled_dot_product_attention = ulysses_sdpa
        try:
            return original_forward(module, *args, **kwargs)
        finally:
            F.scaled_dot_product_attention = original_sdpa

    return forward


def _is_local_causal_mask(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` (bool: True = attend, or additive float) is plain causal over the ``length`` positions of
    the shard: what a model materialises when the batch has no padding mask (the strategy drops it)."""
    if mask.requires_grad or mask.shape[-2:] != (length, length):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


def attention_implementation(model: nn.Module) -> str:
    """The model's attention implementation without the Ulysses prefix (``sdpa``, ``flash_attention_2``, ...)."""
    impl = model.config._attn_implementation
    return impl[len(_PREFIX):] if impl.startswith(_PREFIX) else impl


def keeps_documents_apart(impl: str, sdpa_per_document: bool) -> bool:
    """Whether Ulysses attention with ``impl`` can keep packed documents from attending to each other."""
    return impl != "sdpa" or sdpa_per_document


_block_masks: dict[Any, Any] = {}


def _flex_block_mask(seq_len: int, device: torch.device, cu_seqlens: Optional[torch.Tensor],
                     window: Optional[int] = None) -> Any:
    """Causal mask over ``seq_len`` positions; with ``cu_seqlens``, also block attention across documents; with
    ``window``, only the last ``window`` positions (the query's own included), as transformers' masks do."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (seq_len, str(device), None if cu_seqlens is None else tuple(cu_seqlens.tolist()), window)
    if key not in _block_masks:
        if len(_block_masks) > 4:
            _block_masks.clear()  # shapes change between batches; window and full layers alternate
        if cu_seqlens is None:
            document = torch.zeros(seq_len, dtype=torch.long, device=device)
        else:
            positions = torch.arange(seq_len, device=device)
            document = torch.searchsorted(cu_seqlens.to(device)[1:], positions, right=True)  # [L]
        span = window if window is not None else seq_len + 1

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (kv_idx > q_idx - span) & (document[q_idx] == document[kv_idx])

        _block_masks[key] = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    return _block_masks[key]


def sliding_window_of(kwargs: dict[str, Any]) -> Optional[int]:
    """The layer's sliding window (``sliding_window`` keyword of transformers' attention call), ``None`` if none."""
    window = kwargs.get("sliding_window")
    return int(window) if window else None


def _sdpa_causal(inner: Callable, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: Optional[int], kwargs: dict[str, Any]) -> torch.Tensor:
    """Causal SDPA over one sequence, ``q/k/v [B, h, L, D] -> [B, L, hq, D]``; with a ``window`` shorter than ``L``
    an exact banded computation: query blocks of ``window`` positions, each against the ``2·window - 1`` keys it can
    see, with the window mask (key > query - window). Memory grows with ``L × window``, not ``L²``."""
    L = q.shape[2]
    if window is None or window >= L:
        return inner(module, q, k, v, None, **kwargs)[0]
    pieces = []
    for start in range(0, L, window):
        end = min(start + window, L)
        first_key = max(0, start - window + 1)
        mask = causal_window_mask(torch.arange(start, end, device=q.device),
                                  torch.arange(first_key, end, device=q.device), window)  # [lq, lk], True = attend
        pieces.append(inner(module, q[:, :, start:end], k[:, :, first_key:end], v[:, :, first_key:end],
                            mask[None, None], **kwargs)[0])  # [B, lq, hq, D]
    return torch.cat(pieces, dim=1)


def _flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, h, S, D] -> [1, h, B*S, D]``: the packed rows as one sequence, so documents are segments of it."""
    B, h, S, D = x.shape
    return x.transpose(0, 1).reshape(1, h, B * S, D)


def _attend_documents(inner_name: str, inner: Callable, module: Any, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, shard: ShardInfo, kwargs: dict[str, Any],
                      window: Optional[int] = None) -> torch.Tensor:
    """Causal attention inside each packed document only (and inside the layer's sliding ``window``).
    ``q/k/v [B, h, S, D]`` -> ``[B, S, hq, D]``."""
    B, hq, S, D = q.shape
    cu_seqlens = shard.cu_seqlens.to(device=q.device, dtype=torch.int32)  # offsets in the flattened [B*S]
    if inner_name.startswith("flash_attention"):
        # Hugging Face's varlen path flattens the batch itself and reads the offsets from these kwargs.
        kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                      max_length_q=shard.max_seqlen, max_length_k=shard.max_seqlen)
        out, _ = inner(module, q, k, v, None, **kwargs)  # [B, S, hq, D]
        return out.reshape(B, S, hq, -1)
    qf, kf, vf = _flatten_rows(q), _flatten_rows(k), _flatten_rows(v)  # [1, h, B*S, D]
    if inner_name == "flex_attention":
        mask = _flex_block_mask(B * S, q.device, cu_seqlens, window)
        out, _ = inner(module, qf, kf, vf, mask, **kwargs)  # [1, B*S, hq, D]
    else:  # sdpa: one exact causal call per document, no [S, S] mask
        bounds = cu_seqlens.tolist()
        pieces = [_sdpa_causal(inner, module, qf[:, :, a:b], kf[:, :, a:b], vf[:, :, a:b], window, kwargs)
                  for a, b in zip(bounds[:-1], bounds[1:])]  # each [1, L_doc, hq, D]
        out = torch.cat(pieces, dim=1)  # [1, B*S, hq, D]
    return out.reshape(B, S, hq, -1)


def _make_ulysses_attention(inner_name: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def ulysses_attention_forward(
        module: nn.Module,
        query: torch.Tensor,  # [B, Hq, s, D]
        key: torch.Tensor,  # [B, Hkv, s, D]
        value: torch.Tensor,  # [B, Hkv, s, D]
        attention_mask: Optional[torch.Tensor],
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        context: Optional[StepContext] = module.__dict__.get(_CONTEXT_ATTR)
        if context is None:
            raise RuntimeError(
                f"{type(module).__name__} runs Ulysses attention but was not prepared by UlyssesDeepSpeedStrategy"
                f" (config._attn_implementation={module.config._attn_implementation!r})."
            )
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for name in _LOCAL_POSITION_KWARGS:
            kwargs.pop(name, None)
        _refuse_unshardable_inputs(module, attention_mask, kwargs)
        group = context.exchange_group
        q, k, v = sequence_to_head_shards(query, key, value, group)  # [B, hq, S, D], [B, hkv, S, D] ×2
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]
        view = _LocalHeadsView(module, q.shape[1] // k.shape[1])
        # flash applies the window itself (its `sliding_window` keyword); sdpa and flex get it here.
        window = sliding_window_of(kwargs)
        if not inner_name.startswith("flash_attention"):
            kwargs.pop("sliding_window", None)
        shard = context.shard
        if context.ring_group is not None:  # hybrid: q holds this ring rank's S/R tokens, attend over all S
            if shard is not None and shard.packed:
                raise ValueError(ring_packed_documents_error())
            out = ring_attention(view, q, k, v, context.ring_group, window, kwargs)  # [B, S/R, hq, D]
        elif shard is not None and shard.packed:
            if not keeps_documents_apart(inner_name, context.sdpa_per_document):
                raise ValueError(packed_documents_error(inner_name))
            out = _attend_documents(inner_name, inner, view, q, k, v, shard, kwargs, window)  # [B, S, hq, D]
        elif inner_name == "flex_attention":  # the causal (and window) structure of the full sequence
            out, _ = inner(view, q, k, v, _flex_block_mask(q.shape[2], q.device, None, window), **kwargs)
        elif inner_name == "sdpa":
            out = _sdpa_causal(inner, view, q, k, v, window, kwargs)  # [B, S, hq, D]
        else:
            out, _ = inner(view, q, k, v, None, **kwargs)  # [B, S, hq, D]
        return head_to_sequence_shards(out, group, query.shape[1]), None  # [B, s, Hq, D]

    ulysses_attention_forward.__name__ = f"ulysses_{inner_name}_forward"
    return ulysses_attention_forward


# Tensors some models hand their attention besides q, k, v (additive position biases, attention sinks): the exchange
# does not shard them (the batch's own keys, e.g. shift_labels, also travel in these kwargs and are ignored).
_UNSHARDED_ATTENTION_TENSORS = ("position_bias", "s_aux", "sinks", "alibi", "attn_bias", "attention_bias")


def _refuse_unshardable_inputs(module: nn.Module, attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """The exchange shards q, k and v only: refuse anything else the model hands its attention that would need
    sharding too, instead of silently using it on the wrong positions or heads."""
    name = type(module).__name__
    if isinstance(attention_mask, torch.Tensor) and attention_mask.requires_grad:
        raise ValueError(
            f"{name} passes its attention a mask that carries learned values (attention_mask requires grad, e.g. a"
            " learned per-key bias): UlyssesDeepSpeedStrategy's attention runs causal attention over the full"
            " sequence and cannot shard such a mask, so those parameters would get no gradient. This architecture"
            " cannot train under sequence parallelism; use sp_size=1."
        )
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and key in _UNSHARDED_ATTENTION_TENSORS:
            raise ValueError(
                f"{name} passes its attention a tensor `{key}` {list(value.shape)} that UlyssesDeepSpeedStrategy's"
                " exchange does not shard (it shards query, key and value over the sequence and the heads). This"
                " architecture cannot train under sequence parallelism; use sp_size=1."
            )


def ring_packed_documents_error() -> str:
    return ("Packed documents (position_ids restarting inside a row) are not supported with ring_size > 1 yet: use"
            " one document per row (right padding), or ring_size=1.")


def packed_documents_error(impl: str) -> str:
    return (
        f"The batch packs several documents per row (position_ids restart at 0), but attn_implementation={impl!r}"
        " would let them attend to each other. Use attn_implementation='flash_attention_2'/'flash_attention_3'"
        " (varlen) or 'flex_attention' (document mask) on CUDA, or keep 'sdpa' and pass"
        " `UlyssesDeepSpeedStrategy(..., sdpa_per_document=True)` (exact: one SDPA call per document)."
    )


def register_attention_functions() -> None:
    """Add ``ulysses_<impl>`` for every supported ``<impl>`` to transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for inner_name in SUPPORTED_ATTENTION:
        if _PREFIX + inner_name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(_PREFIX + inner_name, _make_ulysses_attention(inner_name))
