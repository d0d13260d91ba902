"""The strategy's DataLoader layers (lightning_ulysses/data/loaders.py): wrappers in one order, the object Lightning handed
over changed only in its collate function, which restore_loader (called in the strategy's teardown) gives back."""

from __future__ import annotations

from torch.utils.data import DataLoader, default_collate

from lightning_ulysses.data.sharding import SequenceShardingCollate, install_sharding_collate
from lightning_ulysses.data.loaders import (
    AccumulationWindow,
    ResumePosition,
    ShardInfoQueue,
    StepState,
    prepare_loader,
    restore_loader,
)


def _user_collate(rows):
    return default_collate(rows)


def test_layers_come_in_one_order_and_the_collate_goes_back_in_teardown():
    original = DataLoader([{"input_ids": [1, 2, 3, 4]}] * 4, batch_size=2, collate_fn=_user_collate)
    sharded = install_sharding_collate(original, 2, 0, pad_token_id=0)
    prepared = prepare_loader(sharded, ShardInfoQueue(), train=True, accumulation=2)
    layers, layer = [], prepared
    while not isinstance(layer, DataLoader):
        layers.append(type(layer))
        layer = layer.inner
    assert layers == [StepState, AccumulationWindow, ResumePosition]  # outermost first
    assert layer is original and type(original) is DataLoader  # the handed-over object keeps its class
    assert prepared.dataloader is original and len(prepared) == 2 and prepared.batch_size == 2  # read through
    assert isinstance(original.collate_fn, SequenceShardingCollate)
    restore_loader(original)
    assert original.collate_fn is _user_collate


def test_layers_pass_attribute_writes_to_the_loader():
    """Lightning sets attributes on the loader it got back (e.g. ``worker_init_fn``): they reach the DataLoader."""
    original = DataLoader(list(range(4)), batch_size=2)
    prepared = prepare_loader(original, ShardInfoQueue(), train=True, accumulation=2)
    prepared.worker_init_fn = print
    assert original.worker_init_fn is print and "worker_init_fn" not in vars(prepared)


def test_evaluation_loaders_get_only_the_step_state():
    original = DataLoader(list(range(4)), batch_size=2)
    prepared = prepare_loader(original, ShardInfoQueue(), train=False)
    assert type(prepared) is StepState and prepared.inner is original
    assert not hasattr(prepared, "state_dict")  # not a stateful loader to Lightning
