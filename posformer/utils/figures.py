"""Figures: one style per PE in every figure (a named variant's line: one of its own), the axes of length
and metric plots, and reproducible writing (PNG + a byte-stable SVG, atomically).

Used by the evaluation plots (:mod:`posformer.eval.plots`), the heat-map callback, the studies and the
leaderboard. A PE's colour is its index in the registry (:func:`pe_color`), the same everywhere.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from posformer.io import atomic_write_bytes
from posformer.metrics import REGISTRY, aggregate
from posformer.pe.registry import ENCODINGS

LENGTH_LABEL = "evaluation length (tokens, log scale)"
_STYLES = ("-", "--", "-.", ":")
#: one marker per PE (registry order, like the colours), so a PE keeps its marker in every figure
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*", "d", "H", "8", "1")


# ---------------------------------------------------------------------------------------------- style
#: tab10 with its olive (too close in hue to gold) moved out, then four more. In registry order: alibi
#: blue, cope orange, dpb green, fire red, forget_alibi purple, kerple brown, learned pink, nope grey,
#: rope black, xpos cyan, sandwich yellow-green, shaw navy, sinusoidal magenta, t5 gold, pope dark olive,
#: content_rel teal (registered last, so the others keep their colours). Every pair is at
#: least CIE76 ΔE 28 apart, and RoPE / sinusoidal (black / magenta) differ in hue and lightness
#: (before: olive #bcbd22 / gold #f0c000, ΔE 24 and nearly the same hue).
_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#000000",
    "#17becf",
    "#9acd32",
    "#0b1d78",
    "#d000d0",
    "#f0c000",
    "#556b2f",
    "#008080",
)


def palette() -> list[str]:
    """The figure colours, in order (:data:`_COLORS`)."""
    return list(_COLORS)


def _pe_index(pe: str) -> int:
    """A PE's index in the registry (built-ins in registration order, then registered plugins); other
    names (import paths) the indices after those, by a stable hash of the name."""
    names = list(ENCODINGS)
    if pe in names:
        return names.index(pe)
    return len(names) + int.from_bytes(pe.encode()[-4:].rjust(4, b"\0"), "big") % 7


def pe_color(pe: str) -> str:
    """The colour of a PE in every figure: its registry index (:func:`_pe_index`) in :func:`palette`."""
    colors = palette()
    return colors[_pe_index(pe) % len(colors)]


def pe_marker(pe: str) -> str:
    """The marker of a PE in every figure: its registry index in :data:`_MARKERS`."""
    return _MARKERS[_pe_index(pe) % len(_MARKERS)]


@dataclass
class Line:
    """One curve: ``y[i]`` at ``x[i]``; ``std`` (same length) draws a ± band when ``n_seeds > 1`` or
    ``band``."""

    label: str
    pe: str
    x: list[float]
    y: list[float]
    std: list[float] | None = None
    n_seeds: int = 1
    band: bool = False  # draw the ± std band with one seed too (a spread over positions, windows, ...)
    variant: str | None = None  # a named variant's line: a colour and marker of its own (variant_styles)


def mean_lines(agg: pd.DataFrame | Sequence[dict[str, Any]], metric: str, by: str = "group") -> list[Line]:
    """One line per ``by`` (first-seen order) through the rows of an aggregated table
    (:func:`posformer.metrics.aggregate`: ``<metric>_mean``, ``<metric>_std`` — its band, none for one
    seed —, ``<metric>_n``, ``pe``, ``length``) that hold a value, by length."""
    frame = agg if isinstance(agg, pd.DataFrame) else pd.DataFrame(list(agg))
    lines = []
    for name, sub in frame[frame[f"{metric}_n"] > 0].groupby(by, sort=False):
        sub = sub.sort_values("length", kind="stable")
        x, y = sub["length"].tolist(), sub[f"{metric}_mean"].tolist()
        std = sub[f"{metric}_std"].astype(float).fillna(0.0).tolist()
        pe, n = str(sub["pe"].iloc[0] or name), int(sub[f"{metric}_n"].max())
        variant = sub["variant"].iloc[0] if "variant" in sub else None
        lines.append(Line(str(name), pe, x, y, std, n, variant=str(variant) if _present(variant) else None))
    return lines


def _present(value: Any) -> bool:
    """A value that is there: not ``None``, NaN or empty."""
    return value is not None and value == value and value != ""


def variant_styles(lines: Sequence[Line]) -> dict[str, tuple[str, str]]:
    """``{variant: (colour, marker)}``, one of its own per variant of ``lines``: a variant named as a PE
    (``+variant=alibi``) that PE's style when no other line of the figure has it; the others, in first-seen
    order, the next palette colour and marker that no line has (p-RoPE, RoPE and iRoPE, all ``rope``,
    get three colours). Lines without a variant keep their PE's (:func:`pe_color`, :func:`pe_marker`)."""
    colors, marks = palette(), list(_MARKERS)
    used = {(pe_color(line.pe), pe_marker(line.pe)) for line in lines if line.variant is None}
    names = list(dict.fromkeys(line.variant for line in lines if line.variant is not None))
    out: dict[str, tuple[str, str]] = {}
    for name in names:  # a PE's name: its own style, if still free
        style = (pe_color(name), pe_marker(name))
        if name in ENCODINGS and style[0] not in {c for c, _ in used}:
            out[name] = style
            used.add(style)
    free = [c for c in colors if c not in {c for c, _ in used}] or colors
    free_marks = [m for m in marks if m not in {m for _, m in used}] or marks
    for i, name in enumerate(n for n in names if n not in out):
        out[name] = (free[i % len(free)], free_marks[i % len(free_marks)])
    return out


def binned_line(
    label: str,
    pe: str,
    curves: Sequence[Sequence[float]],
    edges: Sequence[int],
    x: list[float],
    band: bool = False,
) -> Line:
    """The loss-per-position curves of several seeds (seeds × positions) as one line: each seed's mean in
    the bins ``edges[i]:edges[i + 1]``, then their mean ± std over the seeds at ``x``
    (:func:`posformer.metrics.aggregate`); ``band``: with one seed, the band is the std over each bin's
    positions (else none)."""
    import numpy as np

    y = np.asarray(curves, dtype=np.float64)
    bins = np.arange(len(edges) - 1)
    binned = np.stack([y[:, a:b].mean(1) for a, b in zip(edges[:-1], edges[1:], strict=True)], 1)
    agg = aggregate(pd.DataFrame({"bin": np.tile(bins, len(y)), "y": binned.ravel()}), ["bin"], ["y"])
    if len(y) == 1:  # one seed: the band is the std over each bin's positions, or none
        positions = pd.DataFrame({"bin": np.repeat(bins, np.diff(edges)), "y": y[0, edges[0] : edges[-1]]})
        agg["y_std"] = aggregate(positions, ["bin"], ["y"])["y_std"] if band else 0.0
    return Line(label, pe, x, agg["y_mean"].tolist(), agg["y_std"].fillna(0.0).tolist(), len(y), band=band)


def draw_lines(ax: Any, lines: Sequence[Line], markers: bool = True) -> None:
    """Draw ``lines``: colour and marker by PE (:func:`pe_color`, :func:`pe_marker`), line style by the
    line's rank within its PE; every other line hollow and a little smaller, so that coinciding curves
    stay visible one on another. A line averaging several seeds gets its ± 1 std band. A variant's line
    has its own colour and marker (:func:`variant_styles`)."""
    rank: dict[str, int] = {}
    own = variant_styles(lines)
    for index, line in enumerate(lines):
        key = line.pe if line.variant is None else f"variant {line.variant}"
        i = rank[key] = rank.get(key, -1) + 1
        color, marker = own.get(line.variant or "", (pe_color(line.pe), pe_marker(line.pe)))
        label = line.label + (f" (n={line.n_seeds})" if line.n_seeds > 1 else "")
        style = {}
        if markers:
            face = "white" if index % 2 else color
            style = {"marker": marker, "ms": 7 - 1.5 * (index % 2), "mfc": face}
        ax.plot(
            line.x, line.y, color=color, ls=_STYLES[i % len(_STYLES)], lw=1.6, alpha=0.9, label=label, **style
        )
        if line.std is not None and (line.n_seeds > 1 or line.band):
            lo = [m - s for m, s in zip(line.y, line.std, strict=True)]
            hi = [m + s for m, s in zip(line.y, line.std, strict=True)]
            ax.fill_between(line.x, lo, hi, color=color, alpha=0.15, lw=0)


def zoom_panel(ax: Any, lines: Sequence[Line], metric: str, ratio: float = 4.0) -> Any:
    """Where curves bunch, a zoom panel under ``ax`` (same x axis) on the band ``[lowest value, 1.25 ×
    lowest]`` (perplexity, loss), drawn when at least two curves have points in it and the main axes
    span more than ``ratio`` × that band. Returns the panel (it takes the x label) or ``None``."""
    if (metric in REGISTRY and REGISTRY[metric].fraction) or len(lines) < 2:
        return None
    values = [v for line in lines for v in line.y if v is not None and math.isfinite(v)]
    if not values or min(values) <= 0:
        return None
    lo = min(values)
    hi = lo * 1.25
    inside = [line for line in lines if any(v is not None and v <= hi for v in line.y)]
    if len(inside) < 2 or max(values) < ratio * hi:
        return None
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    width, height = ax.figure.get_size_inches()
    ax.figure.set_size_inches(width, height * 1.5)  # the main axes keep their height
    zoom = make_axes_locatable(ax).append_axes("bottom", size="50%", pad=0.3, sharex=ax)
    draw_lines(zoom, lines)
    for line in ax.get_lines():  # the training-length marks
        if line.get_linestyle() == "--" and line.get_color() == "grey":
            zoom.axvline(line.get_xdata()[0], color="grey", ls="--", lw=1)
    pad = (hi - lo) * 0.08
    zoom.set_ylim(lo - pad, hi + pad)
    zoom.set_ylabel(f"zoom: {fmt_value(lo)}–{fmt_value(hi)}", fontsize=8)
    zoom.tick_params(labelsize=8)
    zoom.grid(alpha=0.3)
    zoom.set_xlabel(ax.get_xlabel())
    ax.set_xlabel("")
    ax.tick_params(labelbottom=False)
    return zoom


def length_figure(
    path: Path | str,
    title: str,
    lines: Sequence[Line],
    metric: str,
    lengths: Sequence[int],
    train: Sequence[Any] = (),
    *,
    unit: str = "tokens",
    baseline: tuple[float, str] | None = None,
    caption: str = "",
    writer: Any = None,
    tag: str = "",
) -> Path:
    """The project's metric-vs-length figure: ``lines`` (:func:`draw_lines`) on the length axis
    (:func:`length_axis`), a dotted ``(value, label)`` ``baseline``, the metric's axis, a zoom panel
    where curves bunch, then :func:`save_figure`; returns the PNG path."""
    fig, ax = new_figure(title)
    draw_lines(ax, lines)
    length_axis(ax, lengths, train, unit=unit)
    if baseline is not None:
        ax.axhline(baseline[0], color="0.4", ls=":", lw=1.2, label=baseline[1])
    metric_axis(ax, metric)
    zoom_panel(ax, lines, metric)
    return save_figure(fig, ax, Path(path), writer, tag, caption)


def fmt_value(v: float) -> str:
    """A tick or caption number: 3 significant digits, no exponent for the usual range."""
    return f"{v:.3g}"


def length_axis(ax: Any, lengths: Sequence[int], train: Sequence[Any] = (), unit: str = "tokens") -> None:
    """Log2 x axis with ticks at ``lengths`` (printed as numbers); ``train``: training lengths
    (dashed line) or ``(lo, hi)`` ranges (shaded span); ``unit``: what a length counts (``tokens``,
    or ``symbols`` for an algorithmic task whose length is its size)."""
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
    ax.set_xlabel(LENGTH_LABEL if unit == "tokens" else LENGTH_LABEL.replace("tokens", unit))


def metric_axis(ax: Any, metric: str) -> None:
    """Y label with its unit; fractions on [0, 1], perplexity on a log scale."""
    known = REGISTRY.get(metric)
    ax.set_ylabel(known.axis if known else metric.replace("_", " "))
    if known and known.fraction:
        ax.set_ylim(-0.02, 1.02)
    elif known and known.log_axis:
        ax.set_yscale("log")
        log_ticks(ax)


#: mantissas of log-axis ticks, coarse to fine; :func:`log_ticks` takes the finest that fits
_TICK_LEVELS = (
    (1.0, 2.0, 5.0),
    (1.0, 2.0, 3.0, 5.0),
    (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0),
    (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0),
    tuple(round(1.0 + 0.1 * i, 1) for i in range(90)),
)


def log_ticks(ax: Any, target: int = 8) -> None:
    """Readable labels on a log y axis: the finest round values (:data:`_TICK_LEVELS`) giving at most
    ``target`` labels over the data's range (8.5–15: 9, 10, 12, 15; 1.8–50: 2, 3, 5, 10, 20, 30, 50);
    minor ticks unlabelled. Call after the data is drawn."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    lo, hi = ax.get_ylim()
    if not (lo > 0 and hi > lo):
        return
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    ticks: list[float] = []
    for level in _TICK_LEVELS:
        values = [round(m * 10.0**e, 10) for e in decades for m in level]
        inside = sorted({v for v in values if lo <= v <= hi})
        if ticks and len(inside) > target:
            break
        ticks = inside
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


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


def save_figure(fig: Any, ax: Any, path: Path, writer: Any = None, tag: str = "", caption: str = "") -> Path:
    """Grid, the legend outside the axes, the ``caption`` (what a point averages) under the axes, then
    :func:`write_figure`; the figure also goes to the TensorBoard ``writer`` under ``tag``. Closes the
    figure; returns the PNG path."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False)
    if caption:
        fig.text(0.02, -0.02, caption, fontsize=8, color="0.3", va="top")
    path = write_figure(fig, path)
    if writer is not None:
        writer.add_figure(tag or path.stem, fig)
    plt.close(fig)
    return path


def new_figure(title: str, size: tuple[float, float] = (6.4, 4.0), fontsize: float = 10) -> tuple[Any, Any]:
    """A figure and axes of the project's ``size`` (inches), titled in ``fontsize``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    ax.set_title(title, fontsize=fontsize)
    return fig, ax
