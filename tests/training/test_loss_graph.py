"""The shard-local-loss check counts a torch.distributed.nn collective as an SP reduction only over the SP group.
In-process, one gloo rank (the SP group's ranks are given to the walk)."""

from __future__ import annotations

import torch

from lightning_ulysses.parallel.exchange import all_to_all
from lightning_ulysses.training.loss_graph import shard_local_path


def _sharded_values(group) -> torch.Tensor:
    """``[2, 3]`` values that went through the model's sequence-parallel exchange (an all-to-all of one rank)."""
    x = torch.randn(2, 3, requires_grad=True)
    return all_to_all(x, [2], [2], group)


def test_a_collective_over_the_sp_group_is_a_reduction(one_process_group):
    from torch.distributed.nn import functional as dist_fn

    loss = dist_fn.all_reduce(_sharded_values(one_process_group).sum(1), group=one_process_group).mean()
    assert shard_local_path(loss, sp_ranks=[0]) is None


def test_a_collective_over_another_group_is_named(one_process_group):
    """The world at dp=2 x sp=2 (ranks 0-3) is not the SP group (0, 1): here the world is [0] and the SP group given
    as [0, 1]."""
    from torch.distributed.nn import functional as dist_fn

    loss = dist_fn.all_reduce(_sharded_values(one_process_group).sum(1), group=one_process_group).mean()
    found = shard_local_path(loss, sp_ranks=[0, 1])
    assert found is not None and "AllReduce over the ranks [0]" in found and "[0, 1]" in found


def test_without_a_reduction_the_sharded_computation_is_named(one_process_group):
    assert shard_local_path(_sharded_values(one_process_group).sum(), sp_ranks=[0]) == "_AllToAllBackward"


def test_a_reduction_of_reduced_values_is_named(one_process_group):
    """``all_reduce(strategy.sequence_sum(...))``: the second reduction counts the already reduced value once per
    rank (sp times)."""
    from torch.distributed.nn import functional as dist_fn

    once = dist_fn.all_reduce(_sharded_values(one_process_group).sum(1), group=one_process_group)  # [2]: reduced
    found = shard_local_path(dist_fn.all_reduce(once * 2.0, group=one_process_group).mean(), sp_ranks=[0])
    assert found is not None and found.startswith("two sequence-parallel reductions"), found
    assert shard_local_path(once.mean(), sp_ranks=[0]) is None  # reduced once: fine
