"""The layout owns the sizes: no module but ``parallel/layout.py`` asks torch.distributed for a group's size or a
rank's place in it (the collectives that take a group ask :func:`group_size` / :func:`group_rank`). In-process."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_ulysses
from lightning_ulysses.parallel.layout import group_rank, group_size

PACKAGE = Path(lightning_ulysses.__file__).parent
ASKING = {"get_world_size", "get_rank", "get_group_rank", "get_process_group_ranks"}


def _asks_process_groups(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"line {node.lineno}: {node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ASKING
            and isinstance(node.value, ast.Name) and node.value.id == "dist"]


def test_only_the_layout_asks_process_groups_for_sizes_and_ranks():
    layout = PACKAGE / "parallel" / "layout.py"
    asking = {str(p.relative_to(PACKAGE)): found for p in sorted(PACKAGE.rglob("*.py"))
              if p != layout and (found := _asks_process_groups(p))}
    assert not asking, f"ask the layout (group_size / group_rank) instead: {asking}"
    assert _asks_process_groups(layout)  # the check can fail: the layout itself asks


def test_without_a_process_group_one_rank_of_one():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert group_size() == 1 and group_rank() == 0 and group_size(None) == 1
