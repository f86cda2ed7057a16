"""Figures for papers, and TensorBoard scalars, from extrapolation results and sweep summaries.

Every metric-vs-length figure the project writes follows the same conventions (posformer.utils.figures):
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

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from posformer import metrics
from posformer.configs import safe_name
from posformer.errors import PosformerError, ResourceError
from posformer.eval.results import RESULTS_JSON, series_labels
from posformer.eval.settings import MODES
from posformer.eval.store import Results
from posformer.eval.sweep import scored_caption
from posformer.eval.sweep_jobs import split_seed
from posformer.utils.figures import (
    Line,
    binned_line,
    draw_lines,
    length_figure,
    mean_lines,
    new_figure,
    save_figure,
)

#: the row metrics logged as TensorBoard scalars
SCALAR_METRICS = metrics.names(lead="lm", kinds=("task", "lm", "cost"))


# ---------------------------------------------------------------------------------------------- eval plots
def _train_marks(rows: list[dict[str, Any]]) -> list[Any]:
    marks = {tuple(r["train_len"]) if isinstance(r["train_len"], list) else r["train_len"] for r in rows}
    marks.discard(None)
    return list(marks)


def _group_lines(rows: list[dict[str, Any]], metric: str) -> list[Line]:
    """One line per series with the seed taken out of its label (``rope · seed 0`` -> ``rope``):
    the mean (± std) over the seeds at each length (:func:`posformer.metrics.aggregate`)."""
    frame = pd.DataFrame(rows).assign(group=[split_seed(r["series"])[0] for r in rows])
    named = {"variant": ("variant", metrics.first)} if "variant" in frame else {}  # a variant's own colour
    agg = metrics.aggregate(frame, ["group", "length"], [metric], pe=("pe", metrics.first), **named)
    return mean_lines(agg, metric)


def write_plots(results: Results, out_dir: Path | str, writer: Any = None) -> list[Path]:
    """The extrapolation figures (see the module docstring); returns the PNG paths (SVGs beside them).

    ``writer``: a TensorBoard ``SummaryWriter`` that also receives every figure.
    """
    out_dir = Path(out_dir)
    paths: list[Path] = []
    ok = [r for r in results.rows if r["status"] == "ok"]
    panels: list[tuple[str, str, str, list[dict[str, Any]]]] = []  # file name, metric, title, rows
    ppl = metrics.headline("lm").name
    for mode in MODES:
        sub = [r for r in ok if r["task_type"] == "lm" and r["mode"] == mode]
        if sub:
            panels.append((f"{ppl}_{mode}", ppl, f" ({mode} windows)", sub))
    tasks = [r for r in ok if r["task_type"] != "lm"]
    if tasks:
        panels += [(m, m, "", tasks) for m in metrics.names(kinds=("task",))]
    for name, metric, where, sub in panels:
        title = metrics.REGISTRY[metric].title
        unit = "tokens" if sub[0]["task_type"] == "lm" else "symbols"  # a task's length is its size
        figure = length_figure(
            out_dir / f"extrapolation_{name}.png",
            f"{title[0].upper()}{title[1:]} vs evaluation length{where}",
            _group_lines(sub, metric),
            metric,
            [r["length"] for r in sub],
            _train_marks(sub),
            unit=unit,
            caption=scored_caption(sub, unit == "tokens"),
            writer=writer,
            tag=f"extrapolation/{name}",
        )
        paths.append(figure)
    curves = [r for r in ok if r.get("position_loss")]
    if curves:
        fig, ax = new_figure("Loss per token position (longest nonoverlap window)")
        lines, caption = _position_lines(curves)
        draw_lines(ax, lines, markers=False)
        for span in _train_marks(curves):
            end = span[-1] if isinstance(span, tuple) else span
            ax.axvline(end, color="grey", ls="--", lw=1, label="training length")
        ax.set_xlabel("token position in the window")
        ax.set_ylabel("loss (nats / token)")
        path = out_dir / "extrapolation_position_loss.png"
        paths.append(save_figure(fig, ax, path, writer, "extrapolation/position_loss", caption))
    return paths


def _position_lines(curves: list[dict[str, Any]], points: int = 32) -> tuple[list[Line], str]:
    """Per group (seed out of the label): the loss-per-position curve of the longest window, averaged
    over seeds, smoothed by a moving average to at most ``points`` points, with a band: ± 1 std over
    the seeds, or over the positions each point averages (one seed). Returns the lines and a caption
    saying how many windows each curve averages and over how many positions it is smoothed."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in series_labels(curves):
        longest = max((r for r in curves if r["series"] == s), key=lambda r: r["length"])
        groups.setdefault(split_seed(s)[0], []).append(longest)
    lines, windows, widths = [], set(), set()
    for name, rs in groups.items():
        size = min(len(r["position_loss"]) for r in rs)
        k = max(1, size // points)
        widths.add(k)
        windows.update(int(r["n_sequences"]) for r in rs if r.get("n_sequences"))
        edges = range(0, size // k * k + 1, k)
        x = [i * k + (k - 1) / 2 for i in range(size // k)]
        label, pe = f"{name} (L={rs[0]['length']})", str(rs[0].get("pe") or name)
        curves = [r["position_loss"][:size] for r in rs]
        line = binned_line(label, pe, curves, list(edges), x, band=k > 1)
        line.variant = rs[0].get("variant")  # a named variant: its own colour
        lines.append(line)
    count = "/".join(str(w) for w in sorted(windows)) or "?"
    smooth = "/".join(str(w) for w in sorted(widths))
    caption = (
        f"each curve: mean over {count} windows, moving average over {smooth} positions; "
        "band: ± 1 std (over the seeds, else over the averaged positions)"
    )
    return lines, caption


# ---------------------------------------------------------------------------------------------- tensorboard
@contextlib.contextmanager
def logging_failures(out_dir: Path | str) -> Iterator[None]:
    """An operating-system error while the figures and TensorBoard events are written (a full disk:
    TensorBoard's writer thread hands its ``ENOSPC`` to the next write or ``close``, with no path) as one
    :class:`~posformer.errors.ResourceError` naming the folder and the fix; the results were saved
    before, so a re-run only writes these again."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, PosformerError):  # posformer's own line already (a DiskFullError)
            raise
        where = exc.filename or Path(out_dir) / "tensorboard"
        raise ResourceError(
            f"writing the figures and TensorBoard events under {str(where)!r} failed: "
            f"{exc.strerror or exc} (errno {exc.errno}); the results are saved in "
            f"{Path(out_dir) / RESULTS_JSON}. Free space there, or pass eval.tensorboard=false (no event "
            "files); the same command again finds every row done and writes only the figures."
        ) from None


def tensorboard_writer(out_dir: Path | str) -> Any:
    """A ``SummaryWriter`` logging to ``out_dir/tensorboard`` (the figures; the per-model runs of
    :func:`log_scalars` are its subdirectories)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(Path(out_dir) / "tensorboard"))


def log_scalars(results: Results, writer: Any) -> None:
    """One TensorBoard run per series, ``<writer's log dir>/<series>``, with the shared tags
    ``eval/<metric>/<mode>`` (step = the length): the curves of all models overlay in one chart."""
    from torch.utils.tensorboard import SummaryWriter

    ok = [r for r in results.rows if r["status"] == "ok"]
    for series in series_labels(ok):
        run = SummaryWriter(str(Path(writer.log_dir) / safe_name(series)))
        for r in (r for r in ok if r["series"] == series):
            for metric in SCALAR_METRICS:
                if r.get(metric) is not None:
                    run.add_scalar(f"eval/{metric}/{r['mode']}", r[metric], global_step=r["length"])
        run.close()
