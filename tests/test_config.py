"""One frozen settings object (``lightning_ulysses/config.py``) both front ends build from their keyword arguments:
validated once, read-only afterwards, declared by both front ends with the same names and defaults; and the two front
ends repeat no code of each other (they are hooks over one shared core). In-process."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

import lightning_ulysses
from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.config import SequenceParallelConfig, front_end_arguments
from lightning_ulysses.fabric import UlyssesDeepSpeedStrategy as FabricStrategy

PACKAGE = Path(lightning_ulysses.__file__).parent


@pytest.mark.parametrize("front_end", [UlyssesDeepSpeedStrategy, FabricStrategy])
def test_both_front_ends_declare_the_config_fields_with_its_defaults(front_end):
    parameters = inspect.signature(front_end.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(SequenceParallelConfig)}
    expected = [name for name in front_end_arguments()
                if not (front_end is FabricStrategy and name == "gather_predictions")]
    declared = [name for name in parameters if name in defaults]
    assert sorted(declared) == sorted(expected)
    for name in declared:
        default = parameters[name].default
        assert (default if default is not None else None) == (defaults[name] if defaults[name] != () else None), name


@pytest.mark.parametrize("front_end", [UlyssesDeepSpeedStrategy, FabricStrategy])
@pytest.mark.parametrize("arguments, message", [
    ({"sp_size": 0}, "positive integer"), ({"sp_size": 4, "ring_size": 3}, "does not divide"),
    ({"tiled_mlp": -1}, "number of tiles"), ({"preflight": "maybe"}, "preflight must be one of"),
    ({"memory_budget": 0}, "positive number of bytes"), ({"offload_checkpoints": "yes"}, "True or False"),
])
def test_a_bad_setting_is_refused_when_the_strategy_is_made(front_end, arguments, message):
    with pytest.raises(ValueError, match=message):
        front_end(**arguments)


def test_the_settings_are_read_only_and_owned_by_the_config():
    strategy = UlyssesDeepSpeedStrategy(sp_size=2, ring_size=2, tiled_mlp="auto", preflight="warn")
    assert isinstance(strategy.settings, SequenceParallelConfig)
    assert (strategy.ring_size, strategy.preflight, strategy.memory_features.tiled_mlp) == (2, "warn", "auto")
    assert strategy.sp_size == 2 and strategy.gather_predictions
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.settings.ring_size = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        strategy.ring_size = 1  # type: ignore[misc]
    fabric = FabricStrategy(sp_size=2)
    assert not fabric.gather_predictions and fabric.settings.sp_size == 2


def _signature_lines(tree_source: str) -> set[int]:
    """Lines of the function signatures (the keyword API each front end declares for users, IDEs and the CLI)."""
    import ast

    lines: set[int] = set()
    for node in ast.walk(ast.parse(tree_source)):
        if isinstance(node, ast.FunctionDef):
            lines.update(range(node.lineno, node.body[0].lineno))
    return lines


def _code_blocks(path: Path, size: int = 6) -> dict[tuple[str, ...], int]:
    source = path.read_text()
    skip = _signature_lines(source)
    lines = [(number, line.strip()) for number, line in enumerate(source.splitlines(), 1)
             if number not in skip and line.strip() and not line.strip().startswith("#")]
    return {tuple(text for _, text in lines[i:i + size]): lines[i][0] for i in range(len(lines) - size + 1)}


def test_the_front_ends_repeat_no_block_of_six_lines():
    trainer, fabric = _code_blocks(PACKAGE / "strategy.py"), _code_blocks(PACKAGE / "fabric.py")
    repeated = sorted((trainer[block], fabric[block]) for block in set(trainer) & set(fabric))
    assert not repeated, f"blocks repeated between strategy.py and fabric.py (lines): {repeated}"


def test_the_repetition_check_finds_a_repeated_block(tmp_path):
    body = "".join(f"    x{i} = f({i})\n" for i in range(6))
    (tmp_path / "a.py").write_text(f"def a(one,\n      two):\n{body}")
    (tmp_path / "b.py").write_text(f"def b(one,\n      two):\n    y = 0\n{body}")
    assert set(_code_blocks(tmp_path / "a.py")) & set(_code_blocks(tmp_path / "b.py"))
