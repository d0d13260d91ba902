"""One module per sequence-mixer family, each a head-parallel recipe: ``recipe(module, rank, size, group)`` returns
the :class:`~lightning_ulysses.families.mixers.head_slicing.HeadSlicing` that narrows ``module`` to the heads (or channels) of
``rank`` of an SP group of ``size``, or ``None`` if the module is not of its family (then the next one is asked; a
mixer no family claims runs whole on every rank, exact but with its activations not divided).

A new family is one new module here and one entry in :data:`FAMILIES`; nothing else changes.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from torch import nn

from lightning_ulysses.families.mixers.head_slicing import HeadSlicing
from lightning_ulysses.families.mixers.gated_delta_net import gated_delta_net_slicing
from lightning_ulysses.families.mixers.kimi_delta import kimi_delta_slicing
from lightning_ulysses.families.mixers.lightning_attention import lightning_attention_slicing
from lightning_ulysses.families.mixers.mamba1 import mamba1_slicing
from lightning_ulysses.families.mixers.mamba2 import mamba2_slicing
from lightning_ulysses.families.mixers.short_convolution import short_convolution_slicing

Recipe = Callable[[nn.Module, int, int, Any], Optional[HeadSlicing]]

FAMILIES: list[Recipe] = [gated_delta_net_slicing, kimi_delta_slicing, mamba2_slicing, mamba1_slicing,
                          lightning_attention_slicing, short_convolution_slicing]

# The ends of the class names of sequence mixers other than attention (matched case-insensitively): a module so named
# that no family above claims and the mixer exchange does not find by structure is refused
# (:func:`lightning_ulysses.models.refusals.refuse_unsupported_architecture`).
MIXER_CLASS_NAME = re.compile(r"(mixer|deltanet|deltaattention|shortconv|linearattention|lightningattention"
                              r"|recurrent(block|layer)?|rglru|rwkv\w*|ssm)$", re.IGNORECASE)

# Mixer families whose memory the planner (:mod:`lightning_ulysses.plan`) was measured against in launched runs (the
# gated delta nets of Qwen3.5 and Qwen3-Next: benchmarks/plan_accuracy.py, tests/profiling/test_tensor_memory.py):
# the pre-flight memory check runs for a hybrid whose every mixer one of them claims.
PLANNED: list[Recipe] = [gated_delta_net_slicing]


def planned_mixer(module: nn.Module) -> bool:
    """Whether the planner's count of ``module`` (a sequence mixer) was measured: a family of :data:`PLANNED`
    claims it (by its structure, as the exchange does)."""
    return any(recipe(module, 0, 1, None) is not None for recipe in PLANNED)
