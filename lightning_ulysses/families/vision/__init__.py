"""One module per vision-language family, each a :class:`~lightning_ulysses.families.vision.base.VisionFamily`:
how its vision items cut into units of the vision tower, how a run of units is encoded, where its positions come
from. A new family is one new module here and one entry in :data:`FAMILIES`; the placement of feature rows on the
shards and their exchange are shared (:mod:`lightning_ulysses.models.vision_language`).
"""

from __future__ import annotations

from typing import Optional

from lightning_ulysses.families.vision.base import IMAGE, VIDEO, Encoded, Modality, Units, VisionFamily
from lightning_ulysses.families.vision.gemma3 import Gemma3Family
from lightning_ulysses.families.vision.internvl import InternVLFamily
from lightning_ulysses.families.vision.llama4 import Llama4Family
from lightning_ulysses.families.vision.llava import LlavaFamily
from lightning_ulysses.families.vision.llava_next import LlavaNextFamily, LlavaOnevisionFamily
from lightning_ulysses.families.vision.mistral3 import Mistral3Family
from lightning_ulysses.families.vision.qwen import Qwen25VLFamily, QwenGridFamily
from lightning_ulysses.families.vision.qwen3 import Qwen3VLFamily, Qwen35Family

FAMILIES: list[VisionFamily] = [
    QwenGridFamily(), Qwen25VLFamily(), Qwen3VLFamily(), Qwen35Family(), Gemma3Family(), LlavaFamily(),
    LlavaNextFamily(), LlavaOnevisionFamily(), InternVLFamily(), Mistral3Family(),
    Llama4Family(),
]
SUPPORTED_FAMILIES: dict[str, VisionFamily] = {name: family for family in FAMILIES for name in family.model_types}


def family_of(model_type: Optional[str]) -> Optional[VisionFamily]:
    return SUPPORTED_FAMILIES.get(model_type)


__all__ = ["Encoded", "FAMILIES", "IMAGE", "Modality", "SUPPORTED_FAMILIES", "Units", "VIDEO", "VisionFamily",
           "family_of"]
