"""The numbers of the algorithmic study, from its records alone: rows per series, cells per length,
in-distribution exact match, out-of-distribution means and the randomized-positions gain.

A record (:mod:`posformer.studies.ledger`) holds one run's evaluation rows. :func:`rows_of` gives each
row its *series*: the PE for a plain run; for a run trained with randomized positions
``"<pe> + randomized"`` (evaluated with randomized positions, the protocol of Ruoss et al. 2023) and
``"<pe> + randomized, ordinary eval"`` (the same run with ordinary positions 0 … T-1).
:func:`summarise` computes everything the study's ``summary.json`` and the leaderboard's table read.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from posformer import metrics
from posformer.studies.aggregate import cells as study_cells
from posformer.studies.aggregate import fmt_cell
from posformer.utils.format import markdown_table

__all__ = [
    "ID_THRESHOLD",
    "METRICS",
    "ORDINARY_EVAL",
    "gain_table",
    "mean_gains",
    "randomization_gains",
    "reads_positions",
    "rows_of",
    "series_means",
    "summarise",
    "to_json",
    "train_range",
]

#: the series suffix of a randomized-positions run evaluated with ordinary positions
ORDINARY_EVAL = ", ordinary eval"
METRICS = metrics.names(kinds=("task",))
#: the same, token accuracy first: the gain Ruoss et al. 2023 report
GAIN_METRICS = METRICS[::-1]
#: the in-distribution exact match from which a configuration's OOD numbers count (``--id-threshold``)
ID_THRESHOLD = 0.9


def reads_positions(pe: str) -> bool:
    """Whether the PE's output depends on the positions tensor (its declared capabilities): NoPE (no
    hooks) and content-position PEs (CoPE, forgetting ALiBi) are unchanged by randomized positions,
    so their randomized runs would repeat the plain ones."""
    import posformer.pe.registry

    cls = posformer.pe.registry.get_encoding_class(pe)
    return bool(cls.capabilities.hooks) and not cls.content_positions


def rows_of(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation rows of every record, each with its run, seed, steps and series (module docstring)."""
    rows = []
    for name, rec in records.items():
        for r in rec["rows"]:
            series = rec["pe"]
            if rec["randomized"]:
                series += " + randomized" + ("" if r.get("mode") == "task_randomized" else ORDINARY_EVAL)
            rows.append({**r, "run": name, "seed": rec["seed"], "steps": rec["steps"], "series": series})
    return rows


def train_range(records: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """The training instance lengths ``(lo, hi)`` of the records (their ``data.train_len`` override)."""
    for rec in records.values():
        for o in rec.get("overrides", []):
            m = re.fullmatch(r"data\.train_len=\[(\d+),(\d+)\]", o)
            if m:
                return int(m.group(1)), int(m.group(2))
    raise ValueError("no data.train_len=[lo,hi] in the records' overrides")


def series_of(rows: list[dict[str, Any]], pes: list[str]) -> list[str]:
    """The series present in ``rows``, in the order of ``pes``: plain, randomized, ordinary eval."""
    variants = [v for pe in pes for v in (pe, f"{pe} + randomized", f"{pe} + randomized{ORDINARY_EVAL}")]
    return [s for s in variants if any(r["series"] == s for r in rows)]


def cells(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(metric, series, "task", length) -> mean ± std over seeds (:func:`~posformer.studies.aggregate.cells`
    with the ``seeds``)."""
    seeds = ("seed", lambda s: sorted(set(s)))
    by_cell = study_cells(rows, lambda r: (r["series"], "task", r["length"]), METRICS, seeds=seeds)
    return {(m, *key): c for key, per_metric in by_cell.items() for m, c in per_metric.items()}


def series_means(rows: list[dict[str, Any]], series: list[str], hi: int) -> dict[str, Any]:
    """Per series: the mean exact match over its in-distribution rows that ran (every length and seed:
    the precondition for reading its out-of-distribution numbers), the mean steps its runs trained
    (over its in-distribution rows) and, per metric, mean ± std over seeds of each run's mean over the
    lengths > ``hi`` (``n``: the runs) — ``id_exact_match``, ``steps`` and ``ood`` of :func:`summarise`."""
    frame = pd.DataFrame([{"in_distribution": False, "steps": math.nan, **r} for r in rows])
    ok, ind = frame["status"] == "ok", frame["in_distribution"].fillna(False).astype(bool)
    per_run = metrics.aggregate(frame[ok & (frame["length"] > hi)], ["series", "run"], METRICS)
    ids = frame.assign(id_em=frame["exact_match"].where(ok & ind), steps=frame["steps"].where(ind))
    ood = per_run.rename(columns={f"{m}_mean": m for m in METRICS})
    both = pd.concat([ids[["series", "id_em", "steps"]], ood[["series", *METRICS]]], ignore_index=True)
    agg = metrics.aggregate(both, ["series"], ["id_em", "steps", *METRICS]).set_index("series")
    out: dict[str, Any] = {"id_exact_match": {}, "steps": {}, "ood": {}}
    for sr in series:
        a = agg.loc[sr] if sr in agg.index else pd.Series(dtype=object)
        out["id_exact_match"][sr] = float(a.get("id_em_mean", math.nan))
        out["steps"][sr] = float(a.get("steps_mean", math.nan))
        for m in METRICS:
            std = a.get(f"{m}_std", math.nan)
            n = int(a.get(f"{m}_n", 0))
            out["ood"][(m, sr)] = {
                "mean": float(a.get(f"{m}_mean", math.nan)),
                "std": None if math.isnan(std) else float(std),
                "n": n,
                "na": 0,
            }
    return out


def randomization_gains(
    ood: dict[tuple[str, str], dict[str, Any]], pes: list[str], suffix: str = ""
) -> dict[str, dict[str, float]]:
    """PE -> metric -> randomized minus plain mean OOD accuracy (percentage points), for the PEs with
    both rows; ``suffix``: the randomized series' variant (``ORDINARY_EVAL``: evaluated with ordinary
    positions)."""
    out = {}
    for pe in pes:
        rnd = f"{pe} + randomized{suffix}"
        if ("token_acc", pe) in ood and ("token_acc", rnd) in ood:
            out[pe] = {m: 100 * (ood[(m, rnd)]["mean"] - ood[(m, pe)]["mean"]) for m in GAIN_METRICS}
    return out


def mean_gains(
    gains: dict[str, dict[str, float]],
    id_acc: dict[str, float] | None = None,
    threshold: float = ID_THRESHOLD,
    both: str = "both ID EM",
) -> list[tuple[str, int, dict[str, float]]]:
    """The mean of :func:`randomization_gains`' ``gains`` per metric over every PE and, with ``id_acc``,
    over the PEs whose plain and randomized runs both reach ``threshold`` in-distribution exact match
    (``both``: that group's label): ``(label, PEs, metric -> mean)`` per group that has a PE
    (:func:`posformer.metrics.aggregate`)."""
    frame = pd.DataFrame([{"pe": pe, **g} for pe, g in gains.items()], columns=["pe", *GAIN_METRICS])
    acc = id_acc or {}
    ok = [bool(acc) and acc[pe] >= threshold and acc[f"{pe} + randomized"] >= threshold for pe in frame["pe"]]
    groups = pd.concat([frame.assign(label="every PE"), frame.loc[ok].assign(label=f"{both} ≥ {threshold}")])
    agg = metrics.aggregate(groups, ["label"], GAIN_METRICS, n=("pe", "size"))
    return [(r["label"], r["n"], {m: r[f"{m}_mean"] for m in GAIN_METRICS}) for r in metrics.records(agg)]


def summarise(
    records: dict[str, dict[str, Any]], pes: list[str], hi: int, threshold: float
) -> dict[str, Any]:
    """Everything the tables read, from ``records``: ``rows``, ``series``, ``cells``, ``id_exact_match``,
    ``steps`` (means), ``ood``, ``gain_pp`` and ``gain_pp_ordinary_eval``, and ``id_threshold``."""
    rows = rows_of(records)
    series = series_of(rows, pes)
    means = series_means(rows, series, hi)
    ood = means["ood"]
    return {
        "rows": rows,
        "series": series,
        "cells": cells(rows),
        "id_threshold": threshold,
        **means,
        "gain_pp": randomization_gains(ood, pes),
        "gain_pp_ordinary_eval": randomization_gains(ood, pes, ORDINARY_EVAL),
    }


def to_json(summary: dict[str, Any]) -> dict[str, Any]:
    """The part of :func:`summarise` that ``summary.json`` keeps and the leaderboard reads: threshold,
    in-distribution exact match, mean steps, OOD means (keys ``"<metric>|<series>"``) and gains."""
    return {
        "id_threshold": summary["id_threshold"],
        "id_exact_match": summary["id_exact_match"],
        "steps": summary["steps"],
        "ood": {f"{k[0]}|{k[1]}": v for k, v in summary["ood"].items()},
        "gain_pp": summary["gain_pp"],
        "gain_pp_ordinary_eval": summary["gain_pp_ordinary_eval"],
    }


#: the gain table's columns: plain / randomized in-distribution exact match and steps, then per metric
#: (:data:`GAIN_METRICS`) the plain and randomized OOD means and the gain
GAIN_COLUMNS = [("pe", "PE"), ("id", "ID EM plain / rand"), ("steps", "steps plain / rand")]
GAIN_COLUMNS += [
    (f"{m}_{k}", h)
    for m, title in zip(GAIN_METRICS, ("OOD token acc", "OOD exact match"))
    for k, h in (("plain", f"{title} plain"), ("rand", "rand"), ("gain", "gain"))
]
_GAIN_INTRO = (
    "Mean over the OOD lengths of each run, then mean ± std over seeds; gain = randomized − plain "
    "(percentage points). Steps: mean steps trained. `–`: PEs that do not read the positions tensor "
    "(no hooks, or content positions) are not trained with randomized positions, which would "
    "repeat the plain runs; they are left out of the mean gain."
)


def gain_table(
    ood: dict[tuple[str, str], dict[str, Any]],
    pes: list[str],
    id_acc: dict[str, float],
    threshold: float,
    steps: dict[str, float],
) -> list[str]:
    """Mean OOD accuracy plain vs randomized per PE, the difference, and its mean over PEs (Ruoss et al.
    2023 report the mean over tasks of the token accuracy averaged over the OOD lengths)."""
    per_pe = randomization_gains(ood, pes)
    rows: list[dict[str, str]] = []
    for pe in pes:
        rnd = f"{pe} + randomized"
        plain = {f"{m}_plain": fmt_cell(ood[(m, pe)]) for m in GAIN_METRICS if (m, pe) in ood}
        if ("token_acc", pe) in ood and ("token_acc", rnd) not in ood and not reads_positions(pe):
            # not trained: the PE ignores the positions tensor, randomized = plain
            row = {"pe": pe, "id": f"{id_acc[pe]:.2f} / –", "steps": f"{steps[pe]:.0f} / –", **plain}
            rows.append(row | {f"{m}_{k}": "–" for m in GAIN_METRICS for k in ("rand", "gain")})
            continue
        if pe not in per_pe:
            continue
        row = {"pe": pe, "id": f"{id_acc[pe]:.2f} / {id_acc[rnd]:.2f}", **plain}
        row["steps"] = f"{steps[pe]:.0f} / {steps[rnd]:.0f}"
        for m, g in per_pe[pe].items():
            row |= {f"{m}_rand": fmt_cell(ood[(m, rnd)]), f"{m}_gain": f"{g:+.1f}"}
        rows.append(row)
    for label, n, mean in mean_gains(per_pe, id_acc, threshold, "PEs with both ID EM"):
        rows.append(
            {"pe": f"**mean gain, {label}** (n={n})", **{f"{m}_gain": f"{v:+.1f}" for m, v in mean.items()}}
        )
    align = {"pe": "", "id": "", "steps": ""}
    table = markdown_table(rows, GAIN_COLUMNS, align=align, blank=" ", missing="").splitlines()
    return ["## Out-of-distribution means and the randomized-positions gain", "", _GAIN_INTRO, "", *table, ""]
