"""One module per sequence-mixer family, each a head-parallel recipe: ``recipe(module, rank, size, group)`` returns
the :class:`~lightning_ulysses.models.head_slicing.HeadSlicing` that narrows ``module`` to the heads (or channels) of
``rank`` of an SP group of ``size``, or ``None`` if the module is not of its family (then the next one is asked; a
mixer no family claims runs whole on every rank, exact but with its activations not divided).

A new family is one new module here and one entry in :data:`FAMILIES`; nothing else changes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_ulysses.models.head_slicing import HeadSlicing
from lightning_ulysses.models.mixer_families.gated_delta_net import gated_delta_net_slicing
from lightning_ulysses.models.mixer_families.kimi_delta import kimi_delta_slicing
from lightning_ulysses.models.mixer_families.lightning_attention import lightning_attention_slicing
from lightning_ulysses.models.mixer_families.mamba1 import mamba1_slicing
from lightning_ulysses.models.mixer_families.mamba2 import mamba2_slicing
from lightning_ulysses.models.mixer_families.short_convolution import short_convolution_slicing

Recipe = Callable[[nn.Module, int, int, Any], Optional[HeadSlicing]]

FAMILIES: list[Recipe] = [gated_delta_net_slicing, kimi_delta_slicing, mamba2_slicing, mamba1_slicing,
                          lightning_attention_slicing, short_convolution_slicing]
