"""Everything the strategy knows about named model families, and nothing else: the one place where a model type or a
transformers class is named (``tests/families/test_registry.py`` checks the package's source for names outside it).
The rest of the package decides by what a model does (its structure, its attention interface, its modeling module's
names) and asks this registry only where a name is the only evidence.

* :mod:`~lightning_ulysses.families.unshardable`: model types refused with a reason their structure does not show;
* :mod:`~lightning_ulysses.families.attention_classes`: attention classes decided by name (direct SDPA calls, classes
  next to the attention interface that do not dispatch through it);
* :mod:`~lightning_ulysses.families.multimodal_positions`: decoders that read packed samples from ``[4, B, S]``
  positions only;
* :mod:`~lightning_ulysses.families.vision`: one module per vision-language family (units of the vision tower, the
  encoder call, the positions);
* :mod:`~lightning_ulysses.families.mixers`: one head-parallel recipe per sequence-mixer family (found by structure,
  not by name), and the class-name ends of sequence mixers;
* :mod:`~lightning_ulysses.families.reference`: the reference models of the run-time drift checks.

:func:`facts_of` gathers what the registry says about one model type.

The layer sits below :mod:`lightning_ulysses.models` (which asks it) and above ``parallel``, ``data`` and ``training``
(whose pieces the family modules use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_ulysses.families import vision
from lightning_ulysses.families.multimodal_positions import PACKING_FROM_FOUR_ROWS
from lightning_ulysses.families.unshardable import KNOWN_UNSHARDABLE


@dataclass(frozen=True)
class FamilyFacts:
    """What the registry knows about one ``model_type`` (``None``/``False`` where it knows nothing).

    Attributes:
        model_type: the config's ``model_type``.
        unshardable: why the type cannot train under SP (it is refused before compute with this reason).
        vision_family: the vision-language family that cuts its images and videos over the SP ranks.
        packs_from_four_rows: its decoder reads packed samples from ``[4, B, S]`` positions only.
    """

    model_type: str
    unshardable: Optional[str] = None
    vision_family: Optional[vision.VisionFamily] = None
    packs_from_four_rows: bool = False

    @property
    def named(self) -> bool:
        """Whether the registry names this model type at all."""
        return bool(self.unshardable or self.vision_family or self.packs_from_four_rows)


def facts_of(model_type: Optional[str]) -> FamilyFacts:
    """Everything the registry says about ``model_type``."""
    model_type = model_type or ""
    return FamilyFacts(model_type=model_type, unshardable=KNOWN_UNSHARDABLE.get(model_type),
                       vision_family=vision.family_of(model_type),
                       packs_from_four_rows=model_type in PACKING_FROM_FOUR_ROWS)


def named_model_types() -> list[str]:
    """Every model type the registry names, sorted."""
    return sorted(set(KNOWN_UNSHARDABLE) | set(vision.SUPPORTED_FAMILIES) | PACKING_FROM_FOUR_ROWS)


__all__ = ["FamilyFacts", "facts_of", "named_model_types"]
