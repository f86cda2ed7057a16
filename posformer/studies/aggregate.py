"""Aggregation of a study's evaluation rows into cells of mean ± std over seeds, and their Markdown.

A *row* is one evaluation result of ``posformer-eval`` (one run × mode × length: ``pe``, ``mode``,
``length``, ``status``, the metrics, ``checkpoint``). :func:`aggregate` groups rows by
``(series, mode, length)`` into *cells* ``{"mean", "std", "n", "na", ...}`` (``n``: seeds with a
value; ``na``: rows whose status is not ``ok``, e.g. a learned table shorter than the length);
:func:`fmt_cell` and :func:`table` write them.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from posformer.studies.ledger import run_index

__all__ = ["aggregate", "cell", "fmt_cell", "mean_std", "record_cells", "run_seed", "table"]

#: a cell's key: (series, mode, length)
Key = tuple[Any, ...]


def mean_std(xs: Iterable[float | None]) -> tuple[float, float]:
    """Mean and sample std of the finite values of ``xs`` (std 0 for one value; NaN, NaN for none)."""
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def run_seed(checkpoint: str) -> int:
    """The ``seed`` of the run a checkpoint belongs to (its run dir's ``config.yaml``; -1 if absent)."""
    cfg = Path(checkpoint).resolve().parent.parent / "config.yaml"
    for line in cfg.read_text().splitlines():
        if line.startswith("seed:"):
            return int(line.split(":", 1)[1])
    return -1


def cell(rows: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """The cell of ``rows`` (one series, mode and length): mean ± std of ``metric`` over the rows whose
    status is ``ok``, their number ``n`` and the number ``na`` of the others."""
    ok = [r[metric] for r in rows if r["status"] == "ok"]
    m, s = mean_std(ok)
    return {"mean": m, "std": s, "n": len(ok), "na": len(rows) - len(ok)}


def aggregate(
    rows: list[dict[str, Any]], series_key: Callable[[dict[str, Any]], str], metric: str
) -> dict[Key, dict[str, Any]]:
    """(series, mode, length) -> :func:`cell` of ``metric``, with ``in_distribution`` and the ``seeds``
    of its runs (read from their run dirs)."""
    groups: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(series_key(r), r["mode"], r["length"])].append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {
            **cell(rs, metric),
            "in_distribution": rs[0].get("in_distribution"),
            "seeds": sorted({run_seed(r["checkpoint"]) for r in rs}),
        }
    return out


def record_cells(
    records: dict[str, dict[str, Any]], series: str, metric: str = "ppl"
) -> dict[Key, dict[str, Any]]:
    """(record[series], mode, length) -> :func:`cell` of ``metric`` over the runs of a study's ledger
    (:mod:`posformer.studies.ledger`; each record's ``rows`` are its evaluation rows), in run order."""
    groups: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for name in sorted(records, key=run_index):
        rec = records[name]
        for r in rec["rows"]:
            groups[(rec[series], r["mode"], r["length"])].append(r)
    return {k: cell(rs, metric) for k, rs in groups.items()}


def fmt_cell(a: dict[str, Any], digits: int = 2, sign: bool = False) -> str:
    """``mean ± std`` (3 significant digits from 1000 on; the mean alone for one value, whose std is
    undefined); ``n/a`` without values, ``–`` for NaN. ``sign``: the mean with its sign (``+0.123``)."""
    if a["n"] == 0:
        return "n/a"
    if not math.isfinite(a["mean"]):
        return "–"
    if a["mean"] >= 1000:
        mean = f"{a['mean']:.3g}"
        std = f"{a['std']:.2g}"
    else:
        mean = f"{a['mean']:{'+' if sign else ''}.{digits}f}"
        std = f"{a['std']:.{digits}f}"
    return mean if a["n"] == 1 else f"{mean} ± {std}"


def table(
    agg: dict[Key, dict[str, Any]],
    series: list[str],
    mode: str,
    lengths: list[int],
    train_len: int | None,
    digits: int = 2,
    label: str = "PE",
) -> list[str]:
    """The Markdown table of ``agg``: one row per series, one column per length (``*``: the training
    length); a missing cell is empty."""
    head = [
        f"| {label} | " + " | ".join(f"{L}{'*' if train_len == L else ''}" for L in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    body = []
    for s in series:
        cells = [fmt_cell(agg[(s, mode, L)], digits) if (s, mode, L) in agg else "" for L in lengths]
        body.append(f"| {s} | " + " | ".join(cells) + " |")
    return head + body
