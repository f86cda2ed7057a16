"""A study's evaluation rows as cells of mean ± std over seeds, and their Markdown.

A *row* is one evaluation result of ``posformer-eval`` (one run × mode × length: ``pe``, ``mode``,
``length``, ``status``, the metrics, ``checkpoint``). :func:`cells` groups rows by a key (``(series,
mode, length)``) into *cells* ``{"mean", "std", "n", "na"}`` (:func:`posformer.metrics.aggregate`;
``n``: the rows that ran; ``na``: the others, e.g. a learned table shorter than the length; ``std``
``None`` for one seed; mean and std NaN when none ran); :func:`fmt_cell` and :func:`table` write them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from posformer import metrics
from posformer.studies.ledger import run_index
from posformer.utils.format import fmt_spread, markdown_table

__all__ = ["Key", "cells", "fmt_cell", "record_cells", "run_seed", "table"]

#: a cell's key: (series, mode, length)
Key = tuple[Any, ...]


def run_seed(checkpoint: str) -> int:
    """The ``seed`` of the run a checkpoint belongs to (its run dir's ``config.yaml``; -1 if absent)."""
    cfg = Path(checkpoint).resolve().parent.parent / "config.yaml"
    for line in cfg.read_text().splitlines():
        if line.startswith("seed:"):
            return int(line.split(":", 1)[1])
    return -1


def cells(
    rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Key], values: Sequence[str], **extra: Any
) -> dict[Key, dict[str, dict[str, Any]]]:
    """key -> value -> the cell of the rows with that key (first-seen order): mean ± std of the value
    over the rows that ran (status ``ok``), their number ``n``, the number ``na`` of the others, and
    ``extra`` (pandas named aggregations, the same for every value)."""
    if not rows:
        return {}
    frame = pd.DataFrame(rows).assign(key=[key(r) for r in rows])
    ran = frame["status"] == "ok"
    frame.loc[~ran, [v for v in values if v in frame]] = None
    frame["ran"] = ran
    count = {"n": ("ran", "sum"), "na": ("ran", lambda s: int((~s).sum()))}
    agg = metrics.aggregate(frame, ["key"], values, **count, **extra)
    out: dict[Key, dict[str, dict[str, Any]]] = {}
    for r in metrics.records(agg):
        common = {"n": r["n"], "na": r["na"], **{k: r[k] for k in extra}}
        out[r["key"]] = {v: {**_spread(r[f"{v}_mean"], r[f"{v}_std"]), **common} for v in values}
    return out


def _spread(mean: float | None, std: float | None) -> dict[str, float | None]:
    """A cell's mean and std: both NaN without a value, the std ``None`` for one."""
    return {"mean": math.nan, "std": math.nan} if mean is None else {"mean": mean, "std": std}


def record_cells(
    records: dict[str, dict[str, Any]], series: str, metric: str = "ppl"
) -> dict[Key, dict[str, Any]]:
    """(record[series], mode, length) -> the cell of ``metric`` over the runs of a study's ledger
    (:mod:`posformer.studies.ledger`; each record's ``rows`` are its evaluation rows), in run order."""
    names = sorted(records, key=run_index)
    rows = [{**r, "series": records[n][series]} for n in names for r in records[n]["rows"]]
    by_cell = cells(rows, lambda r: (r["series"], r["mode"], r["length"]), [metric])
    return {k: c[metric] for k, c in by_cell.items()}


def fmt_cell(a: dict[str, Any], digits: int = 2, sign: bool = False) -> str:
    """A cell as :func:`~posformer.utils.format.fmt_spread` writes it (3 significant digits from 1000 on)."""
    return fmt_spread(a["mean"], a["std"], digits, a["n"], sign=sign, sig_from=1000)


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
    rows = [
        {str(n): fmt_cell(agg[(s, mode, n)], digits) for n in lengths if (s, mode, n) in agg} for s in series
    ]
    rows = [{"s": s, **r} for s, r in zip(series, rows, strict=True)]
    columns = [("s", label), *((str(n), f"{n}{'*' if train_len == n else ''}") for n in lengths)]
    return markdown_table(rows, columns, default_align="", missing="").splitlines()
