"""The shard-local-loss check: does the loss a step back-propagates depend on the model's sequence-sharded
computation only through SP reductions?

A loss that reaches the model's activations through local operations alone (a mean over this rank's tokens, a
per-row sum over the shard) is a different function on every rank, even when its value happens to agree (DPO's first
step, where policy and reference are equal and every rank's shard loss is exactly log 2). Its value cannot tell; its
autograd graph can. Before backward, :func:`shard_local_path` walks the graph from the loss towards the leaves:

* it stops at every **SP reduction**: the strategy's token losses (:class:`~lightning_ulysses.training.loss.
  ValueWithGradientOf`), its per-sequence reductions and differentiable gather
  (:mod:`~lightning_ulysses.training.sequence_reductions`), and ``torch.distributed.nn``'s differentiable collectives;
* it reports the first **sharded computation** it reaches otherwise: the model's own sequence-parallel exchanges
  (the all-to-alls around attention, the ring attention, the mixers' gathers) and the modules registered by
  :func:`register_sharded_computation` (tiled MLPs, checkpointed segments). Every activation of a sharded model
  passes through one of them, so a path from the loss to one without a reduction is a shard-local loss.

Paths to parameters that avoid the model's activations (a weight regulariser) end at the leaves and are fine.
The walk visits the nodes between the loss and the reductions: a few dozen for the usual losses (measured in
``tests/test_post_training.py``); for a shard-local loss it stops at the first sharded computation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_ulysses.parallel import exchange, ring
from lightning_ulysses.parallel.layout import group_members
from lightning_ulysses.training import sequence_reductions
from lightning_ulysses.training.loss import ValueWithGradientOf


def _backward_classes(functions) -> tuple[type, ...]:
    return tuple(f._backward_cls for f in functions if hasattr(f, "_backward_cls"))


def _torch_distributed_nn_functions() -> list:
    try:
        from torch.distributed.nn import functional as dist_fn
    except ImportError:  # torch built without distributed
        return []
    names = ("_AllReduce", "_AllGather", "_AllGatherBase", "_Reduce_Scatter", "_Reduce", "_Broadcast", "_Gather",
             "_Scatter", "_AlltoAll", "_AlltoAllSingle")
    return [getattr(dist_fn, name) for name in names if hasattr(dist_fn, name)]


_COLLECTIVES: tuple[type, ...] = _backward_classes(_torch_distributed_nn_functions())
SP_REDUCTIONS: tuple[type, ...] = _backward_classes(
    [ValueWithGradientOf, sequence_reductions.SequenceSum, sequence_reductions.GatherSequence]) + _COLLECTIVES

_SHARDED: list[type] = list(_backward_classes(
    [exchange._AllToAll, exchange._GatherSequence, exchange._ReduceScatterSequence, exchange._AllReduceSum,
     ring._RingAttention]))
_SHARDED_NAMES = {"CheckpointFunctionBackward"}  # torch.utils.checkpoint's reentrant segment (a checkpointed layer)


def register_sharded_computation(function: type) -> None:
    """Count ``function``'s (an ``autograd.Function`` the model runs on sequence shards) backward nodes as the model's
    sharded computation."""
    cls = function._backward_cls
    if cls not in _SHARDED:
        _SHARDED.append(cls)


def _group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    return group_members(group)


def shard_local_path(loss: torch.Tensor, sp_ranks: Optional[list[int]] = None) -> Optional[str]:
    """The name of the first sharded computation of the model that ``loss``'s graph reaches without passing an SP
    reduction, or ``None`` (every path from the loss to the model's activations passes one).

    A ``torch.distributed.nn`` collective is an SP reduction only over the SP group (``sp_ranks``, its global ranks):
    over any other group (the world at dp > 1 sums rows of other data-parallel replicas; a group of this rank alone
    reduces nothing) it is named instead, as what the loss reached. Below each SP reduction the walk goes on to the
    model's sharded computation: another SP reduction there (values reduced twice, each counted sp times) is named
    too (:data:`DOUBLE_REDUCTION`)."""
    return _walk(loss, sp_ranks)[0]


def count_nodes_to_reductions(loss: torch.Tensor) -> int:
    """How many graph nodes :func:`shard_local_path` visits for ``loss`` (its cost, for the measurements)."""
    return _walk(loss, None)[1]


def _walk(loss: torch.Tensor, sp_ranks: Optional[list[int]], max_nodes: int = 200_000) -> tuple[Optional[str], int]:
    """``(finding, nodes visited)``. The walks below the reductions share one visited set: a node one of them passed
    without meeting a reduction leads to none from another either, so the whole check visits each node once."""
    root = loss.grad_fn
    if root is None:
        return None, 0
    sharded = tuple(_SHARDED)
    seen = {id(root)}
    below_seen: set[int] = set()
    stack = [root]
    while stack and len(seen) + len(below_seen) <= max_nodes:
        node = stack.pop()
        if isinstance(node, _COLLECTIVES) and sp_ranks is not None:
            ranks = _group_ranks(getattr(node, "group", None))
            if ranks != list(sp_ranks):
                return (f"torch.distributed.nn's {_name(node)} over the ranks {ranks}, which are not this"
                        f" sequence-parallel group's {list(sp_ranks)}"), len(seen) + len(below_seen)
        if isinstance(node, SP_REDUCTIONS):
            below = _reduction_below(node, sharded, below_seen, max_nodes)
            if below is not None:
                return (f"{DOUBLE_REDUCTION}: {_name(node)} of values {_name(below)} had reduced already",
                        len(seen) + len(below_seen))
            continue
        if isinstance(node, sharded) or type(node).__name__ in _SHARDED_NAMES:
            return type(node).__name__, len(seen) + len(below_seen)
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return None, len(seen) + len(below_seen)


DOUBLE_REDUCTION = "two sequence-parallel reductions on one path"


def _name(node: object) -> str:
    return type(node).__name__.removesuffix("Backward").lstrip("_")


def _reduction_below(reduction: object, sharded: tuple[type, ...], seen: set[int], max_nodes: int
                     ) -> Optional[object]:
    """An SP reduction the inputs of ``reduction`` pass before they reach the model's sharded computation (values
    already the same on every SP rank, reduced again: each counted sp times), or ``None``. The walk stops at the
    sharded computations and the leaves; the residual stream passes around the exchanges, so below a loss on the
    model's outputs it visits the layers' other nodes (norms, MLPs, residual adds) down to the embedding, once per
    check (``seen`` is shared by the reductions)."""
    stack = [child for child, _ in reduction.next_functions if child is not None]  # type: ignore[attr-defined]
    while stack and len(seen) <= max_nodes:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, SP_REDUCTIONS):
            return node
        if isinstance(node, sharded) or type(node).__name__ in _SHARDED_NAMES:
            continue
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return None




def parameters_reached(loss: torch.Tensor, max_nodes: int = 2_000_000) -> set[int]:
    """The ``id``s of the leaf tensors (the parameters) whose gradient ``loss``'s backward pass will accumulate: every
    ``AccumulateGrad`` node of its graph (one walk over the whole graph, each node once). Parameters used inside a
    reentrant checkpointed segment or another custom autograd function whose backward recomputes its forward are not
    in the graph before backward runs, on any rank."""
    root = loss.grad_fn
    if root is None:
        return set()
    reached: set[int] = set()
    seen = {id(root)}
    stack = [root]
    while stack and len(seen) <= max_nodes:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return reached
