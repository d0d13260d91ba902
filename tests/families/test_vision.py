"""Each vision-language family module (``lightning_ulysses/families/vision``) defines a family that the registry
serves for its model types and no other's, and every family is defined in one of those modules. The families' cuts,
encodings and positions are proven against one device in ``tests/test_vision_language.py`` and ``test_vlm_*.py``.
In-process."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from lightning_ulysses.families import vision
from lightning_ulysses.families.vision.base import IMAGE, VIDEO, VisionFamily


def _family_classes() -> dict[str, list[type]]:
    """The VisionFamily classes each module of the folder defines, by module."""
    found = {}
    for info in pkgutil.iter_modules(vision.__path__):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{vision.__name__}.{info.name}")
        found[info.name] = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                            if issubclass(cls, VisionFamily) and cls.__module__ == module.__name__]
    return found


def test_every_module_defines_a_family_the_registry_serves():
    classes = _family_classes()
    assert set(classes) == {"gemma3", "internvl", "llama4", "llava", "llava_next", "mistral3", "qwen", "qwen3"}
    registered = {type(family) for family in vision.FAMILIES}
    for module, defined in classes.items():
        assert defined, f"families/vision/{module}.py defines no VisionFamily"
        assert set(defined) <= registered, (module, defined)


def test_each_model_type_has_one_family_of_its_own():
    for family in vision.FAMILIES:
        assert family.model_types, type(family).__name__
        assert set(family.modalities) <= {IMAGE, VIDEO}
        for model_type in family.model_types:
            assert vision.family_of(model_type) is family
    types = [t for family in vision.FAMILIES for t in family.model_types]
    assert len(types) == len(set(types))  # no model type claimed twice
    assert vision.family_of("llama") is None and vision.family_of(None) is None
