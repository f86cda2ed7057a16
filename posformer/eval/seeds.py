"""Seeds of one model as one row: ``posformer-eval`` over the checkpoints of a seed sweep, aggregated.

The *group* of a result row is its series without the seed (:func:`posformer.eval.sweep.split_seed`:
``rope · seed 0`` and ``rope · seed 1`` -> ``rope``; a rotary scaling or randomized positions stay in
it). :func:`aggregate_seeds` gives one row per (group, mode, length): the mean, the sample standard
deviation and ``n`` (the seeds that ran) of every metric, as the training sweep summary does
(:func:`posformer.eval.sweep.aggregate`). The standard deviation of one seed is undefined: ``None``,
an empty cell in ``extrapolation_seeds.csv``, never ``0.0``. Rows that did not run (``n/a``,
``too_long``, ``oom``) count in no mean.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from posformer.eval.sweep import split_seed
from posformer.io import atomic_write_text
from posformer.utils.format import csv_table, fmt, markdown_table

SEEDS_CSV, SEEDS_MD = "extrapolation_seeds.csv", "extrapolation_seeds.md"
#: the metrics aggregated per task type
SEED_METRICS = {"lm": ("loss", "ppl"), "task": ("exact_match", "token_acc", "loss")}
CSV_FIELDS = (
    "group",
    "pe",
    "scaling",
    "task_type",
    "mode",
    "length",
    "in_distribution",
    "n",
    "seeds",
) + tuple(f"{m}_{s}" for m in ("loss", "ppl", "exact_match", "token_acc") for s in ("mean", "std"))


def group_of(row: dict[str, Any]) -> str:
    """The series of ``row`` without its seed (``rope · seed 0 +yarn`` -> ``rope +yarn``)."""
    return split_seed(str(row["series"]))[0]


def aggregate_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, mode, length) in first-seen group order: ``n``, ``seeds`` and
    ``<metric>_mean`` / ``<metric>_std`` (``None`` when undefined) over the rows that ran."""
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((group_of(r), str(r["mode"]), int(r["length"])), []).append(r)
    order = list(dict.fromkeys(g for g, _, _ in cells))
    out = []
    for (group, mode, length), items in sorted(
        cells.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1:])
    ):
        ok = [r for r in items if r.get("status") == "ok"]
        first = items[0]
        agg: dict[str, Any] = {
            "group": group,
            "pe": first.get("pe", ""),
            "scaling": first.get("scaling", "none"),
            "task_type": first.get("task_type", "lm"),
            "mode": mode,
            "length": length,
            "in_distribution": first.get("in_distribution"),
            "n": len(ok),
            "seeds": " ".join(str(s) for r in ok if (s := split_seed(str(r["series"]))[1]) is not None),
        }
        for metric in SEED_METRICS["lm" if agg["task_type"] == "lm" else "task"]:
            vals = [float(r[metric]) for r in ok if r.get(metric) is not None]
            agg[f"{metric}_mean"] = statistics.fmean(vals) if vals else None
            agg[f"{metric}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        out.append(agg)
    return out


def has_seeds(agg: list[dict[str, Any]]) -> bool:
    """Whether any group holds more than one evaluated seed (else a per-seed table says it all)."""
    return any(a["n"] > 1 for a in agg)


def seed_cell(agg: dict[str, Any] | None, metric: str, digits: int) -> str:
    """``mean ± std (n=k)``; ``mean`` alone for one seed; ``n/a`` when none ran; ``""`` for no row."""
    if agg is None:
        return ""
    mean, std = agg.get(f"{metric}_mean"), agg.get(f"{metric}_std")
    if mean is None:
        return "n/a"
    return fmt(mean, digits) + (f" ± {fmt(std, digits)}" if std is not None else "") + f" (n={agg['n']})"


def seed_table(
    agg: list[dict[str, Any]], metric: str, digits: int
) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """A group x length table of ``metric`` (one LM mode or the task rows) and its columns."""
    lengths = sorted({a["length"] for a in agg})
    trained = {a["length"] for a in agg if a.get("in_distribution")}
    by = {(a["group"], a["length"]): a for a in agg}
    groups = list(dict.fromkeys(a["group"] for a in agg))
    table = [
        {"group": g, **{str(n): seed_cell(by.get((g, n)), metric, digits) for n in lengths}} for g in groups
    ]
    return table, [("group", "model"), *((str(n), f"{n}*" if n in trained else str(n)) for n in lengths)]


def seed_sections(agg: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]], str, int]]:
    """``(title, rows, metric, digits)`` per table: each LM mode (perplexity), then tasks (exact match)."""
    out = []
    lm = [a for a in agg if a["task_type"] == "lm"]
    for mode in dict.fromkeys(a["mode"] for a in lm):
        out.append((f"perplexity ({mode} windows)", [a for a in lm if a["mode"] == mode], "ppl", 2))
    for mode in dict.fromkeys(a["mode"] for a in agg if a["task_type"] != "lm"):
        out.append((f"exact match ({mode})", [a for a in agg if a["mode"] == mode], "exact_match", 3))
    return out


def write_seed_summary(agg: list[dict[str, Any]], out_dir: Path) -> Path:
    """``extrapolation_seeds.{csv,md}`` in ``out_dir`` (atomically); returns the Markdown path."""
    atomic_write_text(out_dir / SEEDS_CSV, csv_table(agg, CSV_FIELDS))
    lines = [
        "# Length extrapolation over seeds",
        "",
        "mean ± sample std (n = seeds evaluated); * = training length",
        "",
    ]
    for title, rows, metric, digits in seed_sections(agg):
        table, columns = seed_table(rows, metric, digits)
        lines += [f"## {title}", "", markdown_table(table, columns, align={"group": "l"}).rstrip("\n"), ""]
    atomic_write_text(out_dir / SEEDS_MD, "\n".join(lines))
    return out_dir / SEEDS_MD
