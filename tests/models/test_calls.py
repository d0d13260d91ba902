"""Completing a model call inside a step recognises the batch's own tensors by their memory, not by object identity:
ZeRO-3 hands modules ``detach()``ed copies of their inputs. In-process (one rank, sp=1: no exchange)."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.data.sharding import shard_batch
from lightning_ulysses.models.calls import _complete_hf_call, same_data
from lightning_ulysses.training.step_context import StepContext


def test_same_data_is_the_same_memory_and_layout():
    t = torch.arange(12).view(3, 4)
    assert same_data(t, t) and same_data(t.detach(), t) and same_data(t.view(3, 4), t)
    assert not same_data(t.clone(), t)  # a copy: its own memory
    assert not same_data(t[:2], t) and not same_data(t.t(), t) and not same_data(t.view(4, 3), t)
    assert not same_data(t.float(), t) and not same_data(None, t) and not same_data(t, None)


def _roberta_step():
    from transformers import RobertaConfig, RobertaForCausalLM

    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, is_decoder=True, pad_token_id=1)
    model = RobertaForCausalLM(config)
    ids = torch.randint(3, 64, (2, 12))
    shard = shard_batch({"input_ids": ids, "labels": ids.clone()}, 1, 0, pad_token_id=1)
    info = shard.pop("_ulysses")
    assert info.positions_filled  # the batch had none: the collate step filled 0..S-1
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True, shard_info=info,
                          step_batch_tensors={k: shard.get(k) for k in ("position_ids", "attention_mask",
                                                                        "shift_labels", "labels")})
    return model, shard, context


def test_the_batchs_filled_positions_are_numbered_as_the_model_does_also_when_a_hook_detached_them():
    """RoBERTa numbers from padding_idx + 1 = 2 when given no positions; so must it when given the batch's filled
    positions, whether as the batch's object or as the detached copy ZeRO-3's hooks pass on."""
    model, shard, context = _roberta_step()
    for positions in (shard["position_ids"], shard["position_ids"].detach()):
        _, named = _complete_hf_call(model, (), {**shard, "position_ids": positions}, context)
        assert torch.equal(named["position_ids"], torch.arange(12).expand(2, 12) + 2)
    _, named = _complete_hf_call(model, (), {k: v for k, v in shard.items() if k != "position_ids"}, context)
    assert torch.equal(named["position_ids"], torch.arange(12).expand(2, 12) + 2)


def test_a_copy_of_the_filled_positions_for_a_self_numbering_model_is_refused():
    """A copy cannot be told from positions the step computed: one device would have numbered its own (its batch has
    none) or used the given ones. Refused, naming what to pass, rather than guessed."""
    model, shard, context = _roberta_step()
    with pytest.raises(ValueError, match="numbers its positions itself"):
        _complete_hf_call(model, (), {**shard, "position_ids": shard["position_ids"].clone()}, context)
