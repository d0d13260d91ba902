"""The package's folders are layers: a module imports only from its own layer and the layers below it, and no
module imports itself back through others. Read from the sources (imports under ``TYPE_CHECKING`` name types only
and are left out). In-process."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_ulysses

ROOT = Path(lightning_ulysses.__file__).parent
# Bottom to top; a module may import from its own layer and the layers before it.
LAYERS = [
    {"_compat", "patches", "context"},
    {"parallel"},
    {"data"},
    {"training"},
    {"families"},
    {"models", "offload"},  # the layer checkpoint (offload) and the memory switches (models) use each other
    {"checkpoint", "evaluation", "profiling", "plan"},
    {"drift"},
    {"front_end", "config"},
    {"strategy", "fabric", "__init__"},
]


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    type_only = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                 and getattr(guard.test, "id", getattr(guard.test, "attr", None)) == "TYPE_CHECKING"
                 for node in ast.walk(guard)}
    targets = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_ulysses"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                targets.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name.startswith("lightning_ulysses")}
    return {t for t in targets if t in modules}


def test_every_module_imports_only_its_own_layer_and_those_below():
    modules = _modules()
    upward = [(name, target) for name, path in modules.items() for target in _runtime_imports(path, modules)
              if name != "lightning_ulysses" and _layer(target) > _layer(name)]
    assert not upward, f"imports from a higher layer: {upward}"


def test_no_module_imports_itself_back():
    modules = _modules()
    edges = {name: _runtime_imports(path, modules) - {"lightning_ulysses"} for name, path in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for target in edges[name]:
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif not state.get(target):
                visit(target, stack + [target])
        state[name] = 2

    for name in edges:
        if not state.get(name):
            visit(name, [name])
    assert not cycles, cycles


def test_no_sub_package_holds_more_than_thirty_percent_of_the_lines():
    """Each folder is one concern of a size a reader can hold: none has more than 30% of the package's lines."""
    lines = {path: len(path.read_text().splitlines()) for path in ROOT.rglob("*.py")}
    total = sum(lines.values())
    shares = {}
    for path, count in lines.items():
        parts = path.relative_to(ROOT).parts
        if len(parts) > 1:
            shares[parts[0]] = shares.get(parts[0], 0) + count
    too_big = {name: f"{count / total:.0%}" for name, count in shares.items() if count > 0.30 * total}
    assert not too_big, f"sub-packages over 30% of the package's {total} lines: {too_big}"
