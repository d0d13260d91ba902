"""``python -m lightning_ulysses.plan ... --plot FILE``: the planned peak per rank against the sequence length, one
line per ``sp_size``, with the budget as a horizontal line (matplotlib: the ``bench`` extra)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from lightning_ulysses.plan.planner import GIB, MemoryPlan


def plot_lengths(seq_len: int, sp_values: Sequence[int], points: int = 9) -> list[int]:
    """``points`` lengths from ``seq_len / 8`` to ``seq_len × 4``, evenly spaced on a log scale, each a multiple of
    every sp (and of 8)."""
    step = 8
    for sp in sp_values:
        while step % sp:
            step += 8
    lengths = []
    for i in range(points):
        length = seq_len / 8 * 32 ** (i / max(points - 1, 1))
        lengths.append(max(step, int(round(length / step)) * step))
    return sorted(set(lengths))


def plot_peaks(plan_of: Callable[[int, int], MemoryPlan], lengths: Sequence[int], sp_values: Sequence[int],
               budget: Optional[int], path: str, title: str = "") -> dict[int, list[tuple[int, float]]]:
    """Plan every (sp, length), draw the peaks in GiB and the budget, write ``path``; returns the points drawn
    (a length the settings refuse, e.g. fewer heads than ranks, is left out)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - the bench extra
        raise SystemExit("--plot needs matplotlib: pip install 'lightning-ulysses[bench]'") from err
    points: dict[int, list[tuple[int, float]]] = {}
    for sp in sp_values:
        for length in lengths:
            try:
                points.setdefault(sp, []).append((length, plan_of(sp, length).peak / GIB))
            except ValueError:
                continue
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for sp, line in points.items():
        if line:
            axes.plot([x for x, _ in line], [y for _, y in line], marker="o", label=f"sp={sp}")
    if budget is not None:
        axes.axhline(budget / GIB, color="black", linestyle="--", label=f"budget {budget / GIB:.1f} GiB")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("sequence length (tokens per row)")
    axes.set_ylabel("planned peak per rank (GiB)")
    axes.set_title(title or "lightning_ulysses.plan: peak memory per rank")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return points
