"""How long can I train, and with what: per-rank peak memory of a training step under the strategy, counted before
any process starts (:func:`plan_memory`), and the longest sequence that fits (:func:`longest_sequence`). Command:
``python -m lightning_ulysses.plan --help``. How it counts and how close it is: docs/planning.md."""

from lightning_ulysses.plan.cost import Recommendation, StepCost, recommend, step_cost, step_seconds
from lightning_ulysses.plan.planner import DEVICES, Device, MemoryPlan, longest_sequence, plan_memory
from lightning_ulysses.plan.states import ModelStates

__all__ = ["DEVICES", "Device", "MemoryPlan", "ModelStates", "Recommendation", "StepCost", "longest_sequence",
           "plan_memory", "recommend", "step_cost", "step_seconds"]
