#!/usr/bin/env python
"""Collect a posformer-train sweep (multirun) into one table and one plot.

    posformer-train -m pe=sinusoidal,learned,rope,alibi,t5,nope seed=0,1,2
    python scripts/collect_sweep.py outputs/train/multiruns/<date_time>

Reads every job's ``results.json`` under SWEEP_DIR, groups the runs by their overrides minus
``seed`` (e.g. ``rope``; or ``model=..,pe=..`` when several keys vary), and writes to SWEEP_DIR
(or ``--out``): ``summary.json``, ``summary.csv``, ``summary.md`` (mean ± std over seeds of each
metric, per group and length) and ``summary.png`` (metric vs length, one line per group, the
training length marked). Failed jobs (``error.txt``) are listed.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from posformer.io import atomic_write_text as write_atomic

METRICS = ("exact_match", "token_acc", "loss", "ppl")


def _overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    import yaml

    items = yaml.safe_load(path.read_text()) or []
    out = {}
    for item in items:
        key, _, value = str(item).partition("=")
        out[key.lstrip("+~")] = value
    return out


def load_runs(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every job's results plus its overrides; and the directories of failed jobs."""
    runs, failed = [], []
    for path in sorted(sweep_dir.rglob("results.json")):
        res = json.loads(path.read_text())
        res["_dir"] = str(path.parent)
        res["_overrides"] = _overrides(path.parent)
        runs.append(res)
    failed = [str(p.parent) for p in sorted(sweep_dir.rglob("error.txt"))]
    return runs, failed


def label_runs(runs: list[dict[str, Any]]) -> None:
    """Set ``_label``: the overrides that vary between runs, without the seed."""
    keys = sorted({k for r in runs for k in r["_overrides"]} - {"seed"})
    varying = [k for k in keys if len({r["_overrides"].get(k) for r in runs}) > 1]
    for r in runs:
        if varying == ["pe"] or not varying:
            r["_label"] = r["_overrides"].get("pe") or str(r.get("pe"))
        else:
            r["_label"] = ",".join(f"{k}={r['_overrides'].get(k)}" for k in varying)


def _mean_std(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, length): mean and std over seeds of every metric."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        for row in r.get("results", []):
            cells[(r["_label"], int(row["length"]))].append({**row, "seed": r.get("seed")})
    rows = []
    for (label, length), items in sorted(cells.items()):
        out: dict[str, Any] = {
            "group": label,
            "length": length,
            "in_distribution": bool(items[0].get("in_distribution")),
            "n_runs": len(items),
            "seeds": sorted(i["seed"] for i in items if i["seed"] is not None),
        }
        for m in METRICS:
            mean, std = _mean_std([i.get(m) for i in items])
            out[f"{m}_mean"], out[f"{m}_std"] = mean, std
        rows.append(out)
    return rows


def _cell(mean: float, std: float) -> str:
    return "n/a" if math.isnan(mean) else f"{mean:.3f} ± {std:.3f}"


def to_markdown(rows: list[dict[str, Any]], metric: str, train_length: int | None, failed: list[str]) -> str:
    groups = sorted({r["group"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    by = {(r["group"], r["length"]): r for r in rows}

    def head(n: int) -> str:
        return f"{n}*" if train_length is not None and n == train_length else str(n)

    n_runs = max((r["n_runs"] for r in rows), default=0)
    lines = [
        f"{metric} (mean ± std over {n_runs} seed(s)); * = training length",
        "",
        "| group | " + " | ".join(head(n) for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for g in groups:
        cells = [
            _cell(by[(g, n)][f"{metric}_mean"], by[(g, n)][f"{metric}_std"]) if (g, n) in by else ""
            for n in lengths
        ]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    if failed:
        lines += ["", f"failed jobs ({len(failed)}): " + ", ".join(failed)]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    cols = ["group", "length", "in_distribution", "n_runs"] + [
        f"{m}_{s}" for m in METRICS for s in ("mean", "std")
    ]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def plot(rows: list[dict[str, Any]], metric: str, train_length: int | None, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for g in sorted({r["group"] for r in rows}):
        pts = sorted((r["length"], r[f"{metric}_mean"], r[f"{metric}_std"]) for r in rows if r["group"] == g)
        pts = [p for p in pts if not math.isnan(p[1])]
        if not pts:
            continue
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, marker="o", ms=4, capsize=3, label=g)
    if train_length is not None:
        ax.axvline(train_length, color="grey", ls="--", lw=1)
        ax.text(
            train_length, ax.get_ylim()[1], " train length", va="top", ha="left", fontsize=8, color="grey"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def collect(
    sweep_dir: str | Path, out_dir: str | Path | None = None, metric: str = "exact_match"
) -> dict[str, Any]:
    """Collect ``sweep_dir``; returns the summary dict (also written as files)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise SystemExit(
            f"error: {sweep_dir} is not a directory (pass the sweep dir printed by posformer-train -m)"
        )
    if metric not in METRICS:
        raise SystemExit(f"error: --metric={metric!r} is unknown; valid: {', '.join(METRICS)}")
    runs, failed = load_runs(sweep_dir)
    if not runs:
        raise SystemExit(f"error: no results.json under {sweep_dir}; did the jobs finish (evaluate=true)?")
    label_runs(runs)
    rows = aggregate(runs)
    tls = {r.get("train_length") for r in runs if r.get("train_length") is not None}
    train_length = max(tls) if tls else None
    out = Path(out_dir) if out_dir else sweep_dir
    summary = {
        "sweep_dir": str(sweep_dir),
        "metric": metric,
        "train_length": train_length,
        "n_runs": len(runs),
        "groups": sorted({r["_label"] for r in runs}),
        "failed": failed,
        "rows": [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows
        ],
    }
    md = to_markdown(rows, metric, train_length, failed)
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_atomic(out / "summary.csv", to_csv(rows))
    write_atomic(out / "summary.md", md)
    plot(rows, metric, train_length, out / "summary.png", f"{metric} vs length ({len(runs)} runs)")
    summary["markdown"] = md
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", help="a posformer-train multirun directory")
    ap.add_argument("--out", default=None, help="where to write summary.* (default: the sweep dir)")
    ap.add_argument("--metric", default="exact_match", help=f"table/plot metric: {', '.join(METRICS)}")
    args = ap.parse_args(argv)
    summary = collect(args.sweep_dir, args.out, args.metric)
    print(summary["markdown"], end="")
    out = Path(args.out or args.sweep_dir)
    print(f"\nwrote {out / 'summary.md'} (.json, .csv, .png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
