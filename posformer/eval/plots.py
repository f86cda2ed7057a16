"""Extrapolation plots and TensorBoard scalars from :class:`~posformer.eval.results.Results`.

PNG files (written atomically) in the output directory: ``extrapolation_ppl_<mode>.png`` (LM),
``extrapolation_exact_match.png`` / ``extrapolation_token_acc.png`` (tasks) — metric vs length, one
line per series, the training length marked — and ``extrapolation_position_loss.png`` (loss per
token position of the longest nonoverlap window of each series). The same figures and one scalar per
(metric, mode, series) and length go to TensorBoard when a writer is given.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posformer.eval.results import Results, series_labels
from posformer.eval.settings import MODES
from posformer.io import atomic_write_bytes

#: the row metrics logged as TensorBoard scalars
SCALAR_METRICS = ("loss", "ppl", "exact_match", "token_acc", "peak_mem_mb")


def write_plots(results: Results, out_dir: Path | str, writer: Any = None) -> list[Path]:
    """Metric-vs-length plots (one line per series, training length marked) and per-position loss curves.

    ``writer``: a TensorBoard ``SummaryWriter`` that also receives every figure. Returns the PNG paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths: list[Path] = []
    ok = [r for r in results.rows if r["status"] == "ok"]
    panels: list[tuple[str, str, list[dict[str, Any]]]] = []
    for mode in MODES:
        sub = [r for r in ok if r["task_type"] == "lm" and r["mode"] == mode]
        if sub:
            panels.append((f"ppl_{mode}", "ppl", sub))
    tasks = [r for r in ok if r["task_type"] != "lm"]
    if tasks:
        panels += [("exact_match", "exact_match", tasks), ("token_acc", "token_acc", tasks)]
    for name, metric, sub in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s in series_labels(sub):
            pts = sorted(
                (r["length"], r[metric]) for r in sub if r["series"] == s and r.get(metric) is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        _mark_train(ax, sub)
        ax.set_xscale("log", base=2)
        if metric == "ppl":
            ax.set_yscale("log")
        ax.set_xlabel("evaluation length")
        ax.set_ylabel(metric)
        ax.set_title(name.replace("_", " "))
        paths.append(_finish(fig, ax, out_dir, name, writer))
    curves = [r for r in ok if r.get("position_loss")]
    if curves:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s in series_labels(curves):
            r = max((r for r in curves if r["series"] == s), key=lambda r: r["length"])
            y = torch.tensor(r["position_loss"], dtype=torch.float64)  # (L,)
            k = max(1, len(y) // 64)
            if k > 1:  # moving average over k positions
                y = F.avg_pool1d(y.view(1, 1, -1), k, stride=k).view(-1)
            x = (torch.arange(len(y)) * k + (k - 1) / 2).tolist()
            ax.plot(x, y.tolist(), label=f"{s} (L={r['length']})")
        _mark_train(ax, curves)
        ax.set_xlabel("token position in window")
        ax.set_ylabel("loss (nats)")
        ax.set_title("loss per position (nonoverlap)")
        paths.append(_finish(fig, ax, out_dir, "position_loss", writer))
    return paths


def _finish(fig: Any, ax: Any, out_dir: Path, name: str, writer: Any) -> Path:
    """Legend, grid and layout; save ``extrapolation_<name>.png`` (and to TensorBoard); close."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / f"extrapolation_{name}.png"
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
    if writer is not None:
        writer.add_figure(f"extrapolation/{name}", fig)
    plt.close(fig)
    return path


def _mark_train(ax: Any, rows: list[dict[str, Any]]) -> None:
    """A dashed line at each training length, a shaded span for each training range."""
    spans = {tuple(r["train_len"]) if isinstance(r["train_len"], list) else r["train_len"] for r in rows}
    spans.discard(None)
    for span in spans:
        if isinstance(span, tuple):
            ax.axvspan(span[0], span[-1], color="grey", alpha=0.15, label=f"train {span[0]}–{span[-1]}")
        else:
            ax.axvline(span, color="grey", ls="--", lw=1, label=f"train len {span}")


def tensorboard_writer(out_dir: Path | str) -> Any:
    """A ``SummaryWriter`` logging to ``out_dir/tensorboard``."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(Path(out_dir) / "tensorboard"))


def log_scalars(results: Results, writer: Any) -> None:
    """One scalar per ok row and metric: tag ``<metric>/<mode>/<series>``, step = the length."""
    for r in results.rows:
        if r["status"] != "ok":
            continue
        for metric in SCALAR_METRICS:
            if r.get(metric) is not None:
                tag = f"{metric}/{r['mode']}/{r['series']}".replace(" ", "_")
                writer.add_scalar(tag, r[metric], global_step=r["length"])
