"""``AutoModelForSequenceClassification`` (reward models) under SP: the pooling at each row's last token over the
whole sequence.

transformers' sequence classifiers (``GenericForSequenceClassification``: Llama, Qwen, Mistral, Gemma, ... in 5.x)
score every position (``score(hidden) -> [B, S, labels]``) and pool at the row's rightmost non-pad token, found from
``input_ids``. On a shard that is this rank's rightmost token: every rank would pool another position. The prepared
classifier's forward does the same computation with the pooling over the whole sequence
(:func:`~lightning_ulysses.training.sequence_reductions.last_token`: the rank that holds each row's last non-pad
token contributes its scores, the same ``[B, labels]`` on every rank, exact gradients) and keeps transformers' own
loss (``ForSequenceClassification``: regression, single- or multi-label, from the pooled logits), which then is the
one-device loss. The model-form check runs the backbone (per-token hidden states), the part that is sharded.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses.patches import held_on_instance, put_on_instance, take_from_instance
from lightning_ulysses.training import sequence_reductions
from lightning_ulysses.training.step_context import StepContext

_ORIGINAL_FORWARD = "_ulysses_sequence_classifier"


def is_sequence_classifier(model: nn.Module) -> bool:
    """A transformers classifier whose forward is ``GenericForSequenceClassification``'s (the one this module
    reproduces with the pooling over the whole sequence)."""
    try:
        from transformers.modeling_layers import GenericForSequenceClassification
    except ImportError:
        return False
    return isinstance(model, GenericForSequenceClassification) and type(model).forward is \
        GenericForSequenceClassification.forward


def backbone_of(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def install(model: nn.Module, context: StepContext) -> None:
    """Replace ``model``'s forward by the sequence-parallel pooling (undone by :func:`remove`)."""
    if held_on_instance(model, _ORIGINAL_FORWARD):
        return
    put_on_instance(model, _ORIGINAL_FORWARD, True)

    def forward(input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, **kwargs: Any):
        shard = context.shard_info
        if context.plain or not context.in_step or shard is None:  # plain runs (the model-form check's whole run)
            return type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
                                       **kwargs)
        return _sequence_parallel_forward(model, context, input_ids, attention_mask, position_ids, inputs_embeds,
                                          labels, kwargs)

    put_on_instance(model, "forward", forward)


def remove(model: nn.Module) -> None:
    if take_from_instance(model, _ORIGINAL_FORWARD, None):
        take_from_instance(model, "forward", None)


def _sequence_parallel_forward(model: nn.Module, context: StepContext, input_ids, attention_mask, position_ids,
                               inputs_embeds, labels, kwargs):
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    kwargs.pop("use_cache", None)
    outputs = backbone_of(model)(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=False, **kwargs)
    logits = model.score(outputs.last_hidden_state)  # [B, s, labels]: every position of this rank's shard
    shard = context.shard_info
    rows = logits.shape[0]
    real = sequence_reductions.real_positions(shard, logits.device)[:rows]  # [B, s]
    pad = model.config.get_text_config().pad_token_id
    if pad is None and rows != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")  # transformers' own error
    mask = real if pad is None or input_ids is None else real & (input_ids.to(logits.device) != pad)
    pooled = sequence_reductions.last_token(logits, mask, shard, context.sp_group,
                                            context.gradients.sequence_share, context.incoming_gradients)  # [B, L]
    loss = None
    if labels is not None:
        loss = model.loss_function(logits=logits, labels=labels, pooled_logits=pooled, config=model.config)
    return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, hidden_states=outputs.hidden_states,
                                            attentions=outputs.attentions)
