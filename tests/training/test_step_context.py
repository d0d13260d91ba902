"""The step's facts have one writer: the runner replaces a frozen object per step; what a forward produces goes into
the step record through its methods; nothing else assigns to either (checked in the sources). In-process."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import lightning_ulysses
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.training.step_context import StepContext, StepFacts

PACKAGE = Path(lightning_ulysses.__file__).parent
RUNNER = PACKAGE / "training" / "step_runner.py"
CONTAINER = PACKAGE / "training" / "step_context.py"
FACT_WRITERS = {"set_step_facts", "set_run_facts"}
CONTEXT_FIELDS = {"record", "_facts", "_run", "shard_info", "tile_shard_len", "in_step", "plain", "step_batch_tensors",
                  "token_stats", "incoming_gradients", "router_token_mask", "batch_padding", "inside_prepared_model",
                  "sp_group", "ulysses_group", "ring_group", "ring_size", "gradients", "sdpa_per_document",
                  "zero_stage_3"}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_only_the_runner_replaces_the_step_and_run_facts():
    callers = {(str(path.relative_to(PACKAGE)), node.lineno) for path, tree in _sources() if path != CONTAINER
               for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in FACT_WRITERS and path != RUNNER}
    assert not callers, f"step or run facts replaced outside training/step_runner.py: {sorted(callers)}"


def test_nothing_outside_the_context_assigns_to_its_fields_or_its_record():
    """``context.<field> = ...`` and ``context.record.<field> = ...`` (also augmented): the record is written through
    its methods, the facts replaced whole by the runner."""
    found = []
    for path, tree in _sources():
        if path == CONTAINER:
            continue
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in CONTEXT_FIELDS and (
                            "context" in ast.unparse(leaf.value) or ast.unparse(leaf.value).endswith("record")):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(target)}")
    assert not found, "assignments to the step context outside training/step_context.py:\n" + "\n".join(found)


def test_the_facts_are_frozen_and_the_context_fields_read_only():
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True, shard_info=ShardInfo(8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.facts.in_step = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        context.in_step = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        context.step_batch_tensors["position_ids"] = None  # type: ignore[index]


def test_facts_for_gives_the_previous_facts_back_also_after_an_error():
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, in_step=True, shard_info=ShardInfo(8))
    before = context.facts
    probe = StepFacts(shard_info=ShardInfo(4), in_step=True)
    with pytest.raises(RuntimeError), context.facts_for(probe):
        assert context.shard_info is probe.shard_info
        raise RuntimeError("a probe failed")
    assert context.facts is before
    with context.plain_calls():
        assert context.plain and context.shard_info is before.shard_info
    assert not context.plain


def test_the_record_is_written_through_its_methods():
    context = StepContext(sp_group=None, ulysses_group=None, ring_group=None, incoming_gradients=[])
    context.record.enter_prepared_model()
    context.record.incoming_gradients.append("gradient")
    context.record.begin_batch(train=True)
    assert context.inside_prepared_model == 0 and context.incoming_gradients == []
    context.incoming_gradients.append("g")
    assert context.record.new_gradient_list() == ["g"] and context.incoming_gradients == []
