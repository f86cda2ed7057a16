"""The studies' own figures: a metric against the evaluation length per series (:func:`plot_series`, the
lines of :func:`cell_lines`), and Multi30k BLEU per seed with mean ± std (:func:`plot_bleu`).

The style is the project's (:mod:`posformer.utils.figures`: a PE's colour and marker the same in every
figure); a series ``"<pe> + <variant>"`` (``"rope + randomized"``) takes its PE's colour, the next line
style.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from posformer.metrics import mean_std
from posformer.studies.aggregate import Key
from posformer.utils.figures import (
    Line,
    draw_lines,
    length_axis,
    new_figure,
    pe_color,
    save_figure,
    write_figure,
)

__all__ = ["cell_lines", "plot_bleu", "plot_series"]


def cell_lines(
    agg: dict[Key, dict[str, Any]], series: list[str], mode: str, lengths: list[int]
) -> list[Line]:
    """One line per series of ``agg`` through its cells of ``mode`` that hold a value: the mean, a ± std
    band over several seeds (none for one), the series' number of seeds (a study part-way: fewer). A
    series ``"<pe> + <variant>"`` takes its PE's style."""
    lines = []
    for s in series:
        pts = [(n, agg[(s, mode, n)]) for n in lengths if agg.get((s, mode, n), {}).get("n")]
        x, y, std = [p[0] for p in pts], [p[1]["mean"] for p in pts], [p[1]["std"] or 0.0 for p in pts]
        lines.append(Line(s, s.partition(" + ")[0], x, y, std, max((p[1]["n"] for p in pts), default=0)))
    return lines


def plot_series(
    agg: dict[Key, dict[str, Any]],
    series: list[str],
    mode: str,
    lengths: list[int],
    train_len: int | tuple[int, int] | None,
    path: Path,
    ylabel: str,
    logy: bool = True,
    title: str = "",
) -> None:
    """``path`` as PNG and SVG: mean ± std of each series of ``agg`` at each length of ``mode``
    (:func:`cell_lines`; log2 x; ``train_len`` a dashed line, or a shaded span for a range)."""
    fig, ax = new_figure(title or mode)
    draw_lines(ax, [line for line in cell_lines(agg, series, mode, lengths) if line.x])
    length_axis(ax, lengths, [] if train_len is None else [train_len])
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    save_figure(fig, ax, path)


def plot_bleu(rows: list[dict[str, Any]], pes: list[str], path: Path, steps: int) -> None:
    """``path`` as PNG and byte-reproducible SVG: the test BLEU of every run (dots) and each PE's mean ±
    std over seeds (diamond), PEs in the order of ``pes``."""
    colors = {pe: pe_color(pe) for pe in pes}
    fig, ax = new_figure(f"Multi30k de→en, {steps} updates: seeds (dots), mean ± std (diamond)", (5, 3.5), 9)
    for i, pe in enumerate(pes):
        ys = [r["bleu"] for r in rows if r["pe"] == pe]
        ax.scatter([i] * len(ys), ys, color=colors[pe], alpha=0.6, zorder=3)
        m, s = mean_std(ys)
        s = 0.0 if math.isnan(s) else s  # one seed: no bar
        ax.errorbar([i + 0.15], [m], yerr=[s], fmt="D", color=colors[pe], capsize=4, zorder=4)
    ax.set_xticks(range(len(pes)), pes)
    ax.set_ylabel("test BLEU (sacreBLEU)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    write_figure(fig, path, dpi=120)  # PNG + a byte-reproducible SVG
    import matplotlib.pyplot as plt

    plt.close(fig)
