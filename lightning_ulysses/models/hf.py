"""Preparing a Hugging Face ``PreTrainedModel`` for SP and restoring it: Ulysses attention (its config points at the
``ulysses_<impl>`` functions of :mod:`lightning_ulysses.models.hf_attention`), the SP loss, sequence mixers run whole
(:mod:`lightning_ulysses.models.mixers`), the completion of model calls (:mod:`lightning_ulysses.models.calls`) and
the KV cache off. :func:`restore_model` undoes all of it, so a model is plain again after ``trainer.fit`` and two
Trainers can follow each other in one process. The checks a model must pass first are in
:mod:`lightning_ulysses.models.refusals`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.models import sequence_classification, vision_language
from lightning_ulysses.models.calls import (accepts_position_ids, install_backbone_call_completion,
                                          install_call_completion, remove_call_completion)
from lightning_ulysses.models.hf_attention import ATTENTION_PREFIX, CONTEXT_ATTRIBUTE
from lightning_ulysses.models.mixers import unwrap_sequence_mixer, wrap_sequence_mixer
from lightning_ulysses.models.moe import has_load_balancing_loss
from lightning_ulysses.models.refusals import (calls_sdpa_directly, has_attention, has_attention_sinks,
                                               sequence_mixers)
from lightning_ulysses.models.rope import unwrap_rotaries, wrap_length_dependent_rotaries
from lightning_ulysses.parallel.attention import ulysses_attention
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, replaced, take_from_instance
from lightning_ulysses.training.loss import SequenceParallelLossFunction
from lightning_ulysses.training.step_context import StepContext


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


@dataclass
class _SavedModelState:
    attn_implementation: Any
    use_cache: Any
    had_loss_function: bool
    loss_function: Any
    marked_modules: list[nn.Module] = field(default_factory=list)
    direct_sdpa_modules: list[nn.Module] = field(default_factory=list)
    mixers: list[nn.Module] = field(default_factory=list)
    rotaries: list[nn.Module] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    sub_config_caches: list[tuple[Any, Any]] = field(default_factory=list)  # (sub-config, its use_cache)

_SAVED_STATE = "_ulysses_saved_state"


def prepare_model(model: nn.Module, context: StepContext) -> None:
    """Point ``model`` at Ulysses attention over ``context.sp_group`` and at the SP loss. Idempotent; undone by
    :func:`restore_model`."""
    saved: Optional[_SavedModelState] = on_instance(model, _SAVED_STATE)
    if saved is None:
        config = model.config
        saved = _SavedModelState(
            attn_implementation=_compat.attention_implementation(config),
            use_cache=getattr(config, "use_cache", None),
            had_loss_function=held_on_instance(model, "_loss_function"),
            loss_function=on_instance(model, "_loss_function"),
        )
        impl = _compat.attention_implementation(config)
        direct = [m for m in model.modules() if calls_sdpa_directly(m)]
        if direct:
            # These call torch's SDPA themselves when the implementation is exactly "sdpa": keep the name and put
            # the exchange around the SDPA calls of their forward instead.
            for module in direct:
                put_on_instance(module, "forward", _with_ulysses_sdpa(module, context))
            saved.direct_sdpa_modules = direct
        elif not impl.startswith(ATTENTION_PREFIX) and has_attention(model):
            # (a model with attention sinks built eager runs the Ulysses function registered for sdpa, which
            # computes the sinks itself)
            inner = "sdpa" if impl == "eager" and has_attention_sinks(model) else impl
            _compat.set_attention_implementation(config, ATTENTION_PREFIX + inner)  # also sets the sub-configs
            vision_language.keep_vision_attention(model, impl)  # a vision tower attends over its own patches
        saved.mixers = sequence_mixers(model)
        for mixer in saved.mixers:
            wrap_sequence_mixer(mixer, context)
        saved.rotaries = wrap_length_dependent_rotaries(model, context)
        if saved.use_cache is not None:
            config.use_cache = False  # a KV cache of one shard is useless and would size masks wrongly
        # A vision-language model's decoder reads its own config's use_cache: a cache there would also carry a
        # mixer's state from one packed sample's run to the next.
        saved.sub_config_caches = [(sub, sub.use_cache) for sub in _sub_configs(config)
                                   if getattr(sub, "use_cache", None) is not None]
        for sub, _ in saved.sub_config_caches:
            sub.use_cache = False
        put_on_instance(model, _SAVED_STATE, saved)
    # Every module that dispatches attention holds a config; give each the step context (SP group, documents).
    saved.marked_modules = [m for m in model.modules() if hasattr(m, "config")]
    for module in saved.marked_modules:
        put_on_instance(module, CONTEXT_ATTRIBUTE, context)
    if sequence_classification.is_sequence_classifier(model):
        sequence_classification.install(model, context)  # pools at the last token of the whole sequence
    else:
        model.loss_function = SequenceParallelLossFunction(context)
    if not saved.hooks:
        saved.hooks.append(model.register_forward_pre_hook(_refuse_router_aux_loss, with_kwargs=True))
    install_call_completion(model, context, hf_model=True)
    _complete_backbone_calls(model, context)


def _complete_backbone_calls(model: nn.Module, context: StepContext) -> None:
    """A text model's backbone (``model.model``) called directly gets the shard's positions too."""
    backbone = getattr(model, "base_model", None)
    if (isinstance(backbone, nn.Module) and backbone is not model and accepts_position_ids(backbone)
            and not vision_language.is_vision_language_model(model)):
        install_backbone_call_completion(model, backbone, context)


def reinstall_hooks(model: nn.Module, context: StepContext) -> None:
    """Register a prepared model's forward pre-hooks again after something cleared every module's hooks (Lightning's
    DeepSpeed inference set-up calls ``remove_module_hooks`` on the whole LightningModule)."""
    saved: Optional[_SavedModelState] = on_instance(model, _SAVED_STATE)
    if saved is None:
        return
    for hook in saved.hooks:
        hook.remove()
    saved.hooks = [model.register_forward_pre_hook(_refuse_router_aux_loss, with_kwargs=True)]
    remove_call_completion(model)
    install_call_completion(model, context, hf_model=True)
    _complete_backbone_calls(model, context)


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


def _sub_configs(config: Any) -> list[Any]:
    """The configs nested in ``config`` (a vision-language model's ``text_config``, ...), one level deep."""
    from transformers import PretrainedConfig

    return [value for value in vars(config).values() if isinstance(value, PretrainedConfig)]


def restore_model(model: nn.Module) -> None:
    """Undo :func:`prepare_model`: the model's attention, cache setting and loss are what they were before."""
    saved: Optional[_SavedModelState] = take_from_instance(model, _SAVED_STATE, None)
    if saved is None:
        return
    _compat.set_attention_implementation(model.config, saved.attn_implementation)
    if saved.use_cache is not None:
        model.config.use_cache = saved.use_cache
    for sub, value in saved.sub_config_caches:
        sub.use_cache = value
    for module in saved.marked_modules:
        take_from_instance(module, CONTEXT_ATTRIBUTE, None)
    for module in saved.direct_sdpa_modules:
        take_from_instance(module, "forward", None)
    for mixer in saved.mixers:
        unwrap_sequence_mixer(mixer)
    unwrap_rotaries(saved.rotaries)
    for hook in saved.hooks:
        hook.remove()
    remove_call_completion(model)
    sequence_classification.remove(model)
    if saved.had_loss_function:
        put_on_instance(model, "_loss_function", saved.loss_function)
    else:
        take_from_instance(model, "_loss_function", None)


def is_prepared(model: nn.Module) -> bool:
    return held_on_instance(model, _SAVED_STATE)


def original_use_cache(model: nn.Module) -> Optional[bool]:
    """The ``use_cache`` setting a prepared model had before preparation (``None``: not prepared or unset)."""
    saved: Optional[_SavedModelState] = on_instance(model, _SAVED_STATE)
    return saved.use_cache if saved is not None else None


@contextmanager
def plain_mode(model: nn.Module, context: StepContext) -> Iterator[None]:
    """Inside the block the prepared ``model`` runs as the plain model it was before preparation (its own attention
    implementation and cache setting, no exchange, no call completion): for ``generate()`` during fit."""
    saved: Optional[_SavedModelState] = on_instance(model, _SAVED_STATE)
    if saved is None:
        yield
        return
    config = model.config
    prepared_impl, prepared_cache = _compat.attention_implementation(config), getattr(config, "use_cache", None)
    _compat.set_attention_implementation(config, saved.attn_implementation)
    if saved.use_cache is not None:
        config.use_cache = saved.use_cache
    try:
        with context.plain_calls():
            yield
    finally:
        _compat.set_attention_implementation(config, prepared_impl)
        vision_language.keep_vision_attention(model, saved.attn_implementation)
        if prepared_cache is not None:
            config.use_cache = prepared_cache


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
            if context.shard_info is not None and context.shard_info.packed:
                raise ValueError(f"{name} computes attention itself: packed documents are not supported for this"
                                 " architecture under sequence parallelism (one document per row).")
            causal = bool(getattr(module, "is_causal", True)) or is_causal

            def full_sequence_sdpa(q, k, v):  # [B, hq, S, D], [B, hkv, S, D] x2 -> [B, hq, S, D]
                return original_sdpa(q, k, v, dropout_p=dropout_p, is_causal=causal and q.shape[2] > 1, scale=scale,
                                     enable_gqa=q.shape[1] != k.shape[1])

            return ulysses_attention(query.contiguous(), key.contiguous(), value.contiguous(), context.sp_group,
                                     full_sequence_sdpa)  # [B, Hq, s, D], as SDPA returns

        with replaced(F, "scaled_dot_product_attention", ulysses_sdpa,
                      "torch.nn.functional.scaled_dot_product_attention"):
            return original_forward(module, *args, **kwargs)

    return forward


def _is_local_causal_mask(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` (bool: True = attend, or additive float) is plain causal over the ``length`` positions of
    the shard: what a model materialises when the batch has no padding mask (the strategy drops it)."""
    if mask.requires_grad or mask.shape[-2:] != (length, length):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())
