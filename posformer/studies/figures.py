"""The studies' own figures: a metric against the evaluation length per series (:func:`plot_series`),
and Multi30k BLEU per seed with mean ± std (:func:`plot_bleu`).

Colours come from :func:`posformer.utils.figures.pe_color`, the same for a PE in every figure; a series
``"<pe> + <variant>"`` (``"rope + randomized"``) takes its PE's colour, dashed. The leaderboard's figures
use the shared helpers of :mod:`posformer.utils.figures` directly (:mod:`posformer.studies.leaderboard`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from posformer.metrics import mean_std
from posformer.studies.aggregate import Key
from posformer.utils.figures import pe_color, write_figure

__all__ = ["plot_bleu", "plot_series"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    """``path`` as PNG and SVG: mean ± std of each series of ``agg`` at each length of ``mode`` (log2 x;
    ``train_len`` a dashed line, or a shaded span for a range)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in series:
        pts = [(L, agg[(s, mode, L)]) for L in lengths if (s, mode, L) in agg and agg[(s, mode, L)]["n"]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1]["mean"] for p in pts]
        es = [p[1]["std"] or 0.0 for p in pts]  # one seed: no bar
        pe, _, variant = s.partition(" + ")  # "rope + randomized": rope's colour, dashed
        ax.errorbar(
            xs, ys, yerr=es, marker="o", capsize=3, label=s, color=pe_color(pe), ls="--" if variant else "-"
        )
    if isinstance(train_len, (list, tuple)):
        ax.axvspan(train_len[0], train_len[1], color="grey", alpha=0.15, label="training lengths")
    elif train_len:
        ax.axvline(train_len, color="grey", ls="--", label="training length")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("evaluation length")
    ax.set_ylabel(ylabel)
    ax.set_title(title or mode)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(path.with_suffix(f".{ext}"), dpi=110)
    plt.close(fig)


def plot_bleu(rows: list[dict[str, Any]], pes: list[str], path: Path, steps: int) -> None:
    """``path`` as PNG and byte-reproducible SVG: the test BLEU of every run (dots) and each PE's mean ±
    std over seeds (diamond), PEs in the order of ``pes``."""
    plt = _pyplot()
    colors = {pe: pe_color(pe) for pe in pes}
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, pe in enumerate(pes):
        ys = [r["bleu"] for r in rows if r["pe"] == pe]
        ax.scatter([i] * len(ys), ys, color=colors[pe], alpha=0.6, zorder=3)
        m, s = mean_std(ys)
        s = 0.0 if math.isnan(s) else s  # one seed: no bar
        ax.errorbar([i + 0.15], [m], yerr=[s], fmt="D", color=colors[pe], capsize=4, zorder=4)
    ax.set_xticks(range(len(pes)), pes)
    ax.set_ylabel("test BLEU (sacreBLEU)")
    ax.set_title(f"Multi30k de→en, {steps} updates: seeds (dots), mean ± std (diamond)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    write_figure(fig, path, dpi=120)  # PNG + a byte-reproducible SVG
    plt.close(fig)
