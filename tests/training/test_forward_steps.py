"""Fabric's steps begin at forward passes (:mod:`lightning_ulysses.training.forward_steps`): the batch a call runs on
is recognised by its memory on the host; a copy (Fabric's device copy on a GPU) is compared by value once per batch
and then known by its memory, so device reads do not grow with the forward calls of a step. In-process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.training import forward_steps
from lightning_ulysses.training.forward_steps import ForwardSteps


class _Runner:
    def __init__(self) -> None:
        self.context = SimpleNamespace(in_step=False, plain=False)
        self.begun: list[dict] = []

    def begin_batch(self, mode: str, shard: ShardInfo, batch: dict) -> None:
        self.begun.append(batch)

    def set_in_step(self, value: bool) -> None:
        self.context.in_step = value


@pytest.fixture
def comparisons(monkeypatch):
    counted = []
    real = torch.equal
    monkeypatch.setattr(forward_steps.torch, "equal", lambda a, b: counted.append(1) or real(a, b))
    return counted


def _batch(seed: int) -> dict:
    ids = torch.arange(seed, seed + 16).view(2, 8)
    return {"input_ids": ids, "position_ids": torch.arange(8).expand(2, 8).clone()}


def _model(input_ids=None, position_ids=None):  # the engine's module: a forward without input_pos
    return None


_ENGINE = SimpleNamespace(module=SimpleNamespace(forward=_model))


def _call(steps: ForwardSteps, **kwargs) -> None:
    steps.before_forward(_ENGINE, (), kwargs)
    steps.after_forward(_ENGINE, (), None)


def test_the_batchs_own_tensors_and_first_rows_are_recognised_without_a_comparison(comparisons):
    runner = _Runner()
    steps = ForwardSteps(runner)
    first, second = _batch(0), _batch(100)
    steps.record(ShardInfo.__new__(ShardInfo), first)
    steps.record(ShardInfo.__new__(ShardInfo), second)
    _call(steps, **first)
    _call(steps, input_ids=first["input_ids"][:1])  # first rows of the current batch: a reference pass
    _call(steps, **second)
    assert not comparisons and runner.begun[0]["input_ids"] is first["input_ids"] and len(runner.begun) == 2


def test_a_copy_is_compared_once_per_batch_then_known_by_its_memory(comparisons):
    runner = _Runner()
    steps = ForwardSteps(runner)
    batch = _batch(0)
    steps.record(ShardInfo.__new__(ShardInfo), batch)
    copy = {key: value.clone() for key, value in batch.items()}  # as Fabric's loader moves a batch to the GPU
    _call(steps, **copy)
    after_first = len(comparisons)
    assert after_first == 2  # the tokens and the positions, once
    for _ in range(3):  # policy and reference passes of the same step
        _call(steps, **copy)
    assert len(comparisons) == after_first and len(runner.begun) == 1
    assert runner.begun[0]["input_ids"] is copy["input_ids"] and runner.begun[0]["position_ids"] is copy["position_ids"]


def test_tokens_of_no_batch_are_refused(comparisons):
    steps = ForwardSteps(_Runner())
    steps.record(ShardInfo.__new__(ShardInfo), _batch(0))
    with pytest.raises(ValueError, match="not a batch a loader set up"):
        _call(steps, input_ids=torch.arange(500, 516).view(2, 8))
