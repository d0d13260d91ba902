"""``patches.py`` is the one way the package changes objects it does not own: no other module writes into an
object's instance dictionary (``__dict__`` / ``vars()``), and the helpers it gives do what they say. In-process."""

from __future__ import annotations

import ast
from pathlib import Path

from torch import nn

import lightning_ulysses
from lightning_ulysses.patches import held_on_instance, on_instance, put_on_instance, take_from_instance

PACKAGE = Path(lightning_ulysses.__file__).parent
_WRITING_METHODS = {"pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__"}


def _is_instance_dictionary(node: ast.AST) -> bool:
    """``x.__dict__`` or ``vars(x)``; a class's dictionary (``type(x).__dict__``, ``cls.__dict__``) is read only."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return not (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "type")
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vars"


def _instance_dictionary_writes(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        if any(isinstance(t, ast.Subscript) and _is_instance_dictionary(t.value) for t in targets):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _WRITING_METHODS and _is_instance_dictionary(node.func.value):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_but_patches_writes_an_instance_dictionary(tmp_path):
    writes = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
              if p.name != "patches.py" and (lines := _instance_dictionary_writes(p))}
    assert not writes, f"write through lightning_ulysses.patches (put_on_instance, take_from_instance): {writes}"
    sample = tmp_path / "writes.py"  # the scan can fail
    sample.write_text("m.__dict__['forward'] = f\nvars(m).pop('x')\ndel m.__dict__['y']\n"
                      "type(m).__dict__.get('forward')\nm.__dict__.get('z')\n")
    assert _instance_dictionary_writes(sample) == [1, 2, 3]
    assert _instance_dictionary_writes(PACKAGE / "patches.py")


def test_instance_attributes_shadow_the_class_and_bypass_module_registration():
    layer = nn.Linear(2, 2)
    replacement = nn.Identity()
    put_on_instance(layer, "forward", replacement)
    assert layer.forward is replacement and held_on_instance(layer, "forward")
    assert "forward" not in layer._modules  # not registered as a submodule (nn.Module.__setattr__ would)
    assert on_instance(layer, "forward") is replacement and on_instance(layer, "missing", 3) == 3
    assert take_from_instance(layer, "forward") is replacement and not held_on_instance(layer, "forward")
    assert layer.forward.__func__ is nn.Linear.forward and take_from_instance(layer, "forward", "none") == "none"
