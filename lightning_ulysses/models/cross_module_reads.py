"""Modules that call a submodule once per data-dependent loop iteration and read its parameters themselves, found
by reading their ``forward`` source; made ZeRO-3 leaf modules.

ZeRO-3 gathers a module's parameters around each of its calls and records the order of module calls to prefetch by
it. DBRX's experts read ``self.mlp.w1``/``v1``/``w2`` and call ``self.mlp`` once per expert that received tokens,
in a ``for`` loop. Under sequence parallelism every rank holds other tokens and hits another number of experts, so
the ranks gather and release those weights a different number of times, and record different module orders: the
first or second step hangs in an all-gather (the same happens without this package wherever ranks hold different
data). As a ZeRO-3 *leaf module* (``deepspeed.utils.set_z3_leaf_modules``, DeepSpeed's remedy for MoE blocks) the
experts module gathers all its parameters once around its call and nothing inside it is hooked: the collectives no
longer depend on the tokens. Memory: the leaf's parameters (all the experts of one layer) are whole during its
call.

The pattern recognised: ``forward`` both reads ``self.<child>.<parameter>`` and calls ``self.<child>(...)`` inside
a ``for`` loop. The scan is static and runs once, at ZeRO-3 only.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache

from torch import nn


def _self_attribute(node: ast.AST) -> str | None:
    """``"child"`` for the expression ``self.child``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


@lru_cache(maxsize=None)
def _loop_called_children_whose_attributes_are_read(cls: type) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(child, attributes read as self.child.<attribute>)`` for each child ``cls.forward`` calls as
    ``self.child(...)`` inside a ``for`` loop and whose attributes it also reads."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return ()
    called_in_loops: set[str] = set()
    for loop in (n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.AsyncFor))):
        for node in ast.walk(loop):
            if isinstance(node, ast.Call) and _self_attribute(node.func):
                called_in_loops.add(_self_attribute(node.func))
    read: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        child = _self_attribute(node.value) if isinstance(node, ast.Attribute) else None
        if child in called_in_loops:
            read.setdefault(child, set()).add(node.attr)
    return tuple((child, tuple(sorted(attributes))) for child, attributes in sorted(read.items()))


def loop_callers_reading_parameters(root: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, "child.parameter, ...")`` for every module of ``root`` whose forward calls a submodule in a loop and
    reads that submodule's parameters."""
    found = []
    for module in root.modules():
        for child_name, attributes in _loop_called_children_whose_attributes_are_read(type(module)):
            child = module._modules.get(child_name)
            if child is None:
                continue
            parameters = [a for a in attributes if isinstance(child._parameters.get(a), nn.Parameter)]
            if parameters:
                found.append((module, ", ".join(f"{child_name}.{a}" for a in parameters)))
    return found
