"""Seeds of one model as one row: ``posformer-eval`` over the checkpoints of a seed sweep, aggregated.

The *group* of a result row is its series without the seed (:func:`posformer.eval.sweep.split_seed`:
``rope · seed 0`` and ``rope · seed 1`` -> ``rope``; a rotary scaling or randomized positions stay in
it). :func:`aggregate_seeds` gives one row per (group, mode, length): the mean, the sample standard
deviation and ``n`` (the seeds that ran) of every metric (:func:`posformer.metrics.aggregate`, as the
training sweep summary). The standard deviation of one seed is undefined: ``None``, an empty cell in
``extrapolation_seeds.csv``, never ``0.0``. Rows that did not run (``n/a``, ``too_long``, ``oom``)
count in no mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from posformer.eval.sweep_jobs import split_seed
from posformer.metrics import aggregate, first, headline, names, records
from posformer.utils.format import markdown_table, spread_table, write_tables

#: the aggregated metrics, in the order of posformer-eval's files
METRICS = names(lead="lm")
_GROUP = ("group", "pe", "scaling", "task_type", "mode", "length", "in_distribution", "n", "seeds")
CSV_FIELDS = (*_GROUP, *(f"{m}_{s}" for m in METRICS for s in ("mean", "std")))


def group_of(row: dict[str, Any]) -> str:
    """The series of ``row`` without its seed (``rope · seed 0 +yarn`` -> ``rope +yarn``)."""
    return split_seed(str(row["series"]))[0]


def aggregate_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, mode, length) in first-seen group order, then mode and length: ``n``,
    ``seeds`` and ``<metric>_mean`` / ``<metric>_std`` (``None`` when undefined) over the rows that ran."""
    if not rows:
        return []
    frame = pd.DataFrame(rows)
    ran = frame["status"] == "ok"
    frame["group"] = [group_of(r) for r in rows]
    frame["seed"] = [split_seed(str(r["series"]))[1] if ok else None for r, ok in zip(rows, ran)]
    frame.loc[~ran, [m for m in METRICS if m in frame]] = None  # rows that did not run: no value
    frame["ran"] = ran
    agg = aggregate(
        frame,
        ["group", "mode", "length"],
        METRICS,
        sort_rest=True,
        **{k: (k, first) for k in ("pe", "scaling", "task_type", "in_distribution")},
        n=("ran", "sum"),
        seeds=("seed", lambda s: " ".join(str(int(x)) for x in s.dropna())),
    )
    return records(agg)


def has_seeds(agg: list[dict[str, Any]]) -> bool:
    """Whether any group holds more than one evaluated seed (else a per-seed table says it all)."""
    return any(a["n"] > 1 for a in agg)


def seed_sections(agg: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]], list[tuple[str, str]]]]:
    """``(title, rows, columns)`` per group × length table of mean ± std (n)
    (:func:`~posformer.utils.format.spread_table`): each LM mode (perplexity), then tasks (exact match)."""
    out = []
    lm, task = headline("lm"), headline("task")
    for mode in dict.fromkeys(a["mode"] for a in agg if a["task_type"] == "lm"):
        rows = [a for a in agg if a["task_type"] == "lm" and a["mode"] == mode]
        out.append((f"{lm.title} ({mode} windows)", *spread_table(rows, lm.name, lm.brief, count=True)))
    for mode in dict.fromkeys(a["mode"] for a in agg if a["task_type"] != "lm"):
        rows = [a for a in agg if a["mode"] == mode]
        out.append((f"{task.title} ({mode})", *spread_table(rows, task.name, task.brief, count=True)))
    return out


def write_seed_summary(agg: list[dict[str, Any]], out_dir: Path) -> Path:
    """``extrapolation_seeds.{csv,md}`` in ``out_dir`` (:func:`write_tables`); returns the Markdown path."""
    lines = [
        "# Length extrapolation over seeds",
        "",
        "mean ± sample std (n = seeds evaluated); * = training length",
        "",
    ]
    for title, table, columns in seed_sections(agg):
        lines += [f"## {title}", "", markdown_table(table, columns, align={"group": "l"}, missing="")]
    return write_tables(out_dir, "extrapolation_seeds", agg, CSV_FIELDS, "\n".join(lines))["md"]
