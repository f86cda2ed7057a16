"""Figures: one style per PE in every figure, the axes of length and metric plots, and reproducible
writing (PNG + a byte-stable SVG, atomically).

Used by the evaluation plots (:mod:`posformer.eval.plots`), the heat-map callback, the studies and the
leaderboard. A PE's colour is its index in the registry (:func:`pe_color`), the same everywhere.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posformer.io import atomic_write_bytes
from posformer.pe.registry import ENCODINGS

#: axis labels (with units) of the metrics
METRIC_LABELS = {
    "exact_match": "exact match (fraction of sequences)",
    "token_acc": "token accuracy (fraction of tokens)",
    "loss": "loss (nats / token)",
    "ppl": "perplexity (log scale)",
    "peak_mem_mb": "peak memory (MiB)",
}
#: metrics that are fractions: drawn on [0, 1]
FRACTIONS = ("exact_match", "token_acc")
LENGTH_LABEL = "evaluation length (tokens, log scale)"
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


# ---------------------------------------------------------------------------------------------- style
#: after tab10: black, navy, gold, magenta (each at least ΔE 24 from every other colour of the palette;
#: tab10 + Dark2 had pairs at ΔE 14: two oranges, two purples, two pinks)
_EXTRA_COLORS = ("#000000", "#0b1d78", "#f0c000", "#d000d0")


def palette() -> list[str]:
    """The figure colours, in order: matplotlib's ``tab10``, then :data:`_EXTRA_COLORS`."""
    import matplotlib

    return [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab10"].colors] + list(_EXTRA_COLORS)


def pe_color(pe: str) -> str:
    """The colour of a PE in every figure: its index in the registry (built-ins in registration
    order, then registered plugins) in :func:`palette`; other names (import paths) take the colours
    after those, by a stable hash of the name."""
    import matplotlib

    names = list(ENCODINGS)
    colors = palette()
    if pe in names:
        index = names.index(pe)
    else:
        index = len(names) + int.from_bytes(pe.encode()[-4:].rjust(4, b"\0"), "big") % 7
    return matplotlib.colors.to_hex(colors[index % len(colors)])


@dataclass
class Line:
    """One curve: ``y[i]`` at ``x[i]``; ``std`` (same length) draws a ± band when ``n_seeds > 1``."""

    label: str
    pe: str
    x: list[float]
    y: list[float]
    std: list[float] | None = None
    n_seeds: int = 1


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def draw_lines(ax: Any, lines: Sequence[Line], markers: bool = True) -> None:
    """Draw ``lines``: colour by PE, line style by the line's rank within its PE, marker shape (and a
    shrinking size) by its index, so that coinciding curves stay visible one on another."""
    rank: dict[str, int] = {}
    for index, line in enumerate(lines):
        i = rank[line.pe] = rank.get(line.pe, -1) + 1
        color = pe_color(line.pe)
        label = line.label + (f" (n={line.n_seeds})" if line.n_seeds > 1 else "")
        style = {}
        if markers:  # every other line with hollow markers: a smaller one stays visible on a bigger one
            face = "white" if index % 2 else color
            style = {"marker": _MARKERS[index % len(_MARKERS)], "ms": 7 - 1.2 * (index % 4), "mfc": face}
        ax.plot(
            line.x, line.y, color=color, ls=_STYLES[i % len(_STYLES)], lw=1.6, alpha=0.9, label=label, **style
        )
        if line.std is not None and line.n_seeds > 1:
            lo = [m - s for m, s in zip(line.y, line.std, strict=True)]
            hi = [m + s for m, s in zip(line.y, line.std, strict=True)]
            ax.fill_between(line.x, lo, hi, color=color, alpha=0.15, lw=0)


def length_axis(ax: Any, lengths: Sequence[int], train: Sequence[Any] = ()) -> None:
    """Log2 x axis with ticks at ``lengths`` (printed as numbers); ``train``: training lengths
    (dashed line) or ``(lo, hi)`` ranges (shaded span)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ticks = sorted({int(n) for n in lengths})
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    if len(ticks) > 1:
        ax.set_xlim(ticks[0] / 1.15, ticks[-1] * 1.15)
    for span in sorted(set(train), key=str):
        if isinstance(span, tuple | list):
            ax.axvspan(
                span[0], span[-1], color="grey", alpha=0.12, label=f"training range {span[0]}–{span[-1]}"
            )
        elif span:
            ax.axvline(span, color="grey", ls="--", lw=1, label=f"training length {span}")
    ax.set_xlabel(LENGTH_LABEL)


def metric_axis(ax: Any, metric: str) -> None:
    """Y label with its unit; fractions on [0, 1], perplexity on a log scale."""
    ax.set_ylabel(METRIC_LABELS.get(metric, metric.replace("_", " ")))
    if metric in FRACTIONS:
        ax.set_ylim(-0.02, 1.02)
    elif metric == "ppl":
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))  # 20, 30 rather than 2×10^1


def write_figure(fig: Any, path: Path | str, dpi: int = 150) -> Path:
    """``fig`` as ``path`` (``.png``) and its ``.svg`` twin, each written atomically; returns the PNG path."""
    import matplotlib

    path = Path(path).with_suffix(".png")
    # the SVG is byte-for-byte reproducible (no date, fixed element ids), so a committed figure
    # changes only when its content does
    svg = {"metadata": {"Date": None}}
    for suffix, options in ((".png", {"dpi": dpi}), (".svg", svg)):
        buf = io.BytesIO()
        with matplotlib.rc_context({"svg.hashsalt": "posformer"}):
            fig.savefig(buf, format=suffix[1:], bbox_inches="tight", **options)
        atomic_write_bytes(path.with_suffix(suffix), buf.getvalue())
    return path


def save_figure(fig: Any, ax: Any, path: Path, writer: Any = None, tag: str = "") -> Path:
    """Grid, the legend outside the axes, then :func:`write_figure`; the figure also goes to the
    TensorBoard ``writer`` under ``tag``. Closes the figure; returns the PNG path."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False)
    path = write_figure(fig, path)
    if writer is not None:
        writer.add_figure(tag or path.stem, fig)
    plt.close(fig)
    return path


def new_figure(title: str) -> tuple[Any, Any]:
    """A figure and axes of the project's size, titled."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.set_title(title, fontsize=10)
    return fig, ax
