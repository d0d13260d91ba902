"""The strategy's DataLoader layers (lightning_ulysses/loaders.py): one order, the object Lightning handed over
changed only in its collate function, which restore_loader (called in the strategy's teardown) gives back."""

from __future__ import annotations

from torch.utils.data import DataLoader, default_collate

from lightning_ulysses.data import SequenceShardingCollate, install_sharding_collate
from lightning_ulysses.loaders import (
    ResumableLoaderMixin,
    ShardInfoQueue,
    _AccumulationWindowMixin,
    _StepStateMixin,
    prepare_loader,
    restore_loader,
)


def _user_collate(rows):
    return default_collate(rows)


def test_layers_come_in_one_order_and_the_collate_goes_back_in_teardown():
    original = DataLoader([{"input_ids": [1, 2, 3, 4]}] * 4, batch_size=2, collate_fn=_user_collate)
    sharded = install_sharding_collate(original, 2, 0, pad_token_id=0)
    prepared = prepare_loader(sharded, ShardInfoQueue(), train=True, accumulation=2)
    layers = [c for c in type(prepared).__mro__ if c in (_StepStateMixin, ResumableLoaderMixin, _AccumulationWindowMixin)]
    assert layers == [_StepStateMixin, ResumableLoaderMixin, _AccumulationWindowMixin]  # outermost first
    assert type(original) is DataLoader and prepared is not original  # the handed-over object keeps its class
    assert isinstance(original.collate_fn, SequenceShardingCollate)
    restore_loader(original)
    assert original.collate_fn is _user_collate


def test_evaluation_loaders_get_only_the_step_state():
    prepared = prepare_loader(DataLoader(list(range(4)), batch_size=2), ShardInfoQueue(), train=False)
    assert [c.__name__ for c in type(prepared).__mro__[:2]] == ["StepStateDataLoader", "_StepStateMixin"]
