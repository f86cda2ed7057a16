"""Figures for papers, and TensorBoard scalars, from extrapolation results and sweep summaries.

Every metric-vs-length figure the project writes follows the same conventions (the helpers below):
one colour per PE across all figures (:func:`pe_color`: registry order, plugins the next colours);
lines of the same PE differ in line style and marker, so identical curves stay visible; the x axis is
the evaluation length in tokens on a log2 scale with ticks at the evaluated lengths; the training
length is a dashed line (a training range a shaded span); accuracies are on [0, 1] and every axis
label has its unit; a line that averages several seeds is its mean with a ± 1 std band (one seed:
no band); the legend sits outside the data, right of the axes; each figure is a PNG and an SVG.

Files of :func:`write_plots` (the output directory of ``posformer-eval``):
``extrapolation_ppl_<mode>.{png,svg}`` (LM), ``extrapolation_exact_match`` / ``extrapolation_token_acc``
(tasks) and ``extrapolation_position_loss`` (loss per token position of the longest nonoverlap window).
TensorBoard: the figures in ``tensorboard/`` and one run per model (``tensorboard/<series>/``) with
the same tags ``eval/<metric>/<mode>`` (step = length), so the curves of different models overlay.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posformer.eval.results import Results, series_labels
from posformer.eval.settings import MODES
from posformer.io import atomic_write_bytes

#: the row metrics logged as TensorBoard scalars
SCALAR_METRICS = ("loss", "ppl", "exact_match", "token_acc", "peak_mem_mb")
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

    from posformer.pe.registry import ENCODINGS

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


# ---------------------------------------------------------------------------------------------- eval plots
def _train_marks(rows: list[dict[str, Any]]) -> list[Any]:
    marks = {tuple(r["train_len"]) if isinstance(r["train_len"], list) else r["train_len"] for r in rows}
    marks.discard(None)
    return list(marks)


def _group_lines(rows: list[dict[str, Any]], metric: str) -> list[Line]:
    """One line per series with the seed taken out of its label (``rope · seed 0`` -> ``rope``):
    the mean (± std) over the seeds at each length."""
    from posformer.eval.sweep import split_seed

    groups: dict[str, list[dict[str, Any]]] = {}
    for s in series_labels(rows):
        groups.setdefault(split_seed(s)[0], []).extend(r for r in rows if r["series"] == s)
    lines = []
    for name, sub in groups.items():
        by_len: dict[int, list[float]] = {}
        for r in sub:
            if r.get(metric) is not None:
                by_len.setdefault(int(r["length"]), []).append(float(r[metric]))
        if not by_len:
            continue
        xs = sorted(by_len)
        stats = [mean_std(by_len[x]) for x in xs]
        n = max(len(by_len[x]) for x in xs)
        lines.append(
            Line(name, str(sub[0].get("pe") or name), xs, [m for m, _ in stats], [s for _, s in stats], n)
        )
    return lines


def write_plots(results: Results, out_dir: Path | str, writer: Any = None) -> list[Path]:
    """The extrapolation figures (see the module docstring); returns the PNG paths (SVGs beside them).

    ``writer``: a TensorBoard ``SummaryWriter`` that also receives every figure.
    """
    out_dir = Path(out_dir)
    paths: list[Path] = []
    ok = [r for r in results.rows if r["status"] == "ok"]
    panels: list[tuple[str, str, str, list[dict[str, Any]]]] = []
    for mode in MODES:
        sub = [r for r in ok if r["task_type"] == "lm" and r["mode"] == mode]
        if sub:
            panels.append((f"ppl_{mode}", "ppl", f"Perplexity vs evaluation length ({mode} windows)", sub))
    tasks = [r for r in ok if r["task_type"] != "lm"]
    if tasks:
        panels += [
            ("exact_match", "exact_match", "Exact match vs evaluation length", tasks),
            ("token_acc", "token_acc", "Token accuracy vs evaluation length", tasks),
        ]
    for name, metric, title, sub in panels:
        fig, ax = new_figure(title)
        draw_lines(ax, _group_lines(sub, metric))
        length_axis(ax, [r["length"] for r in sub], _train_marks(sub))
        metric_axis(ax, metric)
        paths.append(
            save_figure(fig, ax, out_dir / f"extrapolation_{name}.png", writer, f"extrapolation/{name}")
        )
    curves = [r for r in ok if r.get("position_loss")]
    if curves:
        fig, ax = new_figure("Loss per token position (longest nonoverlap window)")
        draw_lines(ax, _position_lines(curves), markers=False)
        for span in _train_marks(curves):
            ax.axvline(
                span[-1] if isinstance(span, tuple) else span,
                color="grey",
                ls="--",
                lw=1,
                label="training length",
            )
        ax.set_xlabel("token position in the window")
        ax.set_ylabel("loss (nats / token)")
        paths.append(
            save_figure(
                fig, ax, out_dir / "extrapolation_position_loss.png", writer, "extrapolation/position_loss"
            )
        )
    return paths


def _position_lines(curves: list[dict[str, Any]]) -> list[Line]:
    """Per group (seed out of the label): the loss-per-position curve of the longest window, averaged
    over seeds, smoothed to at most ~64 points (moving average)."""
    from posformer.eval.sweep import split_seed

    groups: dict[str, list[dict[str, Any]]] = {}
    for s in series_labels(curves):
        longest = max((r for r in curves if r["series"] == s), key=lambda r: r["length"])
        groups.setdefault(split_seed(s)[0], []).append(longest)
    lines = []
    for name, rs in groups.items():
        size = min(len(r["position_loss"]) for r in rs)
        y = torch.tensor([r["position_loss"][:size] for r in rs], dtype=torch.float64)  # (seeds, L)
        k = max(1, size // 64)
        if k > 1:  # moving average over k positions
            y = F.avg_pool1d(y.unsqueeze(1), k, stride=k).squeeze(1)
        x = (torch.arange(y.shape[1]) * k + (k - 1) / 2).tolist()
        std = y.std(0, correction=1) if y.shape[0] > 1 else torch.zeros(y.shape[1])
        lines.append(
            Line(
                f"{name} (L={rs[0]['length']})",
                str(rs[0].get("pe") or name),
                x,
                y.mean(0).tolist(),
                std.tolist(),
                y.shape[0],
            )
        )
    return lines


# ---------------------------------------------------------------------------------------------- tensorboard
def tensorboard_writer(out_dir: Path | str) -> Any:
    """A ``SummaryWriter`` logging to ``out_dir/tensorboard`` (the figures; the per-model runs of
    :func:`log_scalars` are its subdirectories)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(Path(out_dir) / "tensorboard"))


def log_scalars(results: Results, writer: Any) -> None:
    """One TensorBoard run per series, ``<writer's log dir>/<series>``, with the shared tags
    ``eval/<metric>/<mode>`` (step = the length): the curves of all models overlay in one chart."""
    from torch.utils.tensorboard import SummaryWriter

    from posformer.configs import safe_name

    ok = [r for r in results.rows if r["status"] == "ok"]
    for series in series_labels(ok):
        run = SummaryWriter(str(Path(writer.log_dir) / safe_name(series)))
        for r in (r for r in ok if r["series"] == series):
            for metric in SCALAR_METRICS:
                if r.get(metric) is not None:
                    run.add_scalar(f"eval/{metric}/{r['mode']}", r[metric], global_step=r["length"])
        run.close()
