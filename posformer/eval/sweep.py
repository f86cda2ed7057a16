"""A training sweep (Hydra multirun) as one table and one figure, written when the multirun ends.

:class:`SweepSummary` is a Hydra callback (``hydra.callbacks.sweep_summary`` in
``configs/hydra/default.yaml``): when ``posformer-train -m …`` ends it calls :func:`collect` on the
sweep dir, prints the summary table, lists the jobs that failed (their one-line error and the path
of their ``error.txt``) and exits with status 1 if any did. ``scripts/collect_sweep.py`` runs
:func:`collect` by hand (e.g. on an older sweep).

Labels: a job is named by its swept overrides only (:func:`posformer.configs.job_items`; the keys
that vary between its ``results.json`` files when the sweep has no ``multirun.yaml``): ``rope · seed 0``,
``rope · n_heads 2 · seed 1``; the PE is always named. The *group* of a job is its label without the
seed; a group's cells are the mean ± std over its seeds (no ± for one seed).

Files written to the sweep dir (or ``out_dir``): ``summary.json`` (every metric, mean and std per group
and length, and the failed jobs), ``summary.csv``, ``summary.md`` and ``summary.{png,svg}`` (the table's
metric vs length, one line per group with a ± std band, coloured by PE).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from posformer import metrics
from posformer.configs import job_items, swept_keys
from posformer.errors import ConfigError
from posformer.utils.figures import length_figure, mean_lines
from posformer.utils.format import by_length, fmt, fmt_spread, markdown_table, print_table, write_tables

#: the summarised metrics, in the order of training's results files
METRICS = metrics.names()
#: between the parts of a label: ``rope · n_heads 2 · seed 0``
SEP = " · "
_SEED = re.compile(rf"{re.escape(SEP)}seed (-?\d+)")
CSV_FIELDS = (
    "group",
    "pe",
    "length",
    "in_distribution",
    "n_runs",
    *(f"{m}_{s}" for m in METRICS for s in ("mean", "std")),
)


# ---------------------------------------------------------------------------------------------- labels
def split_seed(label: str) -> tuple[str, int | None]:
    """``"rope · seed 0"`` -> ``("rope", 0)``; a label without a seed -> ``(label, None)``."""
    m = _SEED.search(label)
    return (_SEED.sub("", label), int(m.group(1))) if m else (label, None)


def job_overrides(job_dir: Path) -> list[str]:
    """The overrides of one job (``.hydra/overrides.yaml``); ``[]`` if it has none."""
    path = Path(job_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in (OmegaConf.load(path) or [])] if path.is_file() else []


def job_label(overrides: list[str], swept: list[str] | tuple[str, ...] | None, pe: str = "") -> str:
    """``rope · n_heads 2 · seed 0``: the swept overrides (``pe`` by its value), the PE first."""
    items = job_items(overrides, swept)
    parts = [v if k == "pe" else f"{k} {v}" for k, v in items]
    if pe and "pe" not in {k for k, _ in items}:
        parts.insert(0, pe)
    return SEP.join(parts) or pe or "run"


def run_label(run_dir: Path | str, pe: str = "") -> str | None:
    """The label of a training run that is a sweep job (its parent holds ``multirun.yaml``); else ``None``."""
    run_dir = Path(run_dir)
    swept = swept_keys(run_dir.parent)
    return None if swept is None else job_label(job_overrides(run_dir), swept, pe)


def _job_number(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else sys.maxsize, path.name)


# ---------------------------------------------------------------------------------------------- loading
def load_jobs(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every job's ``results.json`` (job order) with ``_dir``, ``_label``, ``_group``; and the failed
    jobs (an ``error.txt`` not followed by a ``results.json``) as ``{job, error, path}``."""
    runs = []
    for path in sorted(sweep_dir.rglob("results.json"), key=lambda p: _job_number(p.parent)):
        res = json.loads(path.read_text())
        res["_dir"], res["_overrides"] = str(path.parent), job_overrides(path.parent)
        runs.append(res)
    swept = swept_keys(sweep_dir)
    if swept is None:  # no multirun.yaml: the keys whose value differs between the jobs
        values = [dict(o.lstrip("+~").partition("=")[::2] for o in r["_overrides"]) for r in runs]
        keys = dict.fromkeys(k for v in values for k in v)
        swept = [k for k in keys if len({v.get(k) for v in values}) > 1]
    for r in runs:
        r["_label"] = job_label(r["_overrides"], swept, str(r.get("pe") or ""))
        r["_group"] = split_seed(r["_label"])[0]
    failed = []
    for err in sorted(sweep_dir.rglob("error.txt"), key=lambda p: _job_number(p.parent)):
        res = err.parent / "results.json"
        if res.exists() and res.stat().st_mtime > err.stat().st_mtime:
            continue  # re-run successfully since
        lines = [ln for ln in err.read_text(errors="replace").splitlines() if ln.strip()]
        failed.append({"job": err.parent.name, "error": lines[0] if lines else "(empty)", "path": str(err)})
    return runs, failed


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, length), groups in job order: mean, std (``None`` for one seed) and number of
    values of every metric over the group's runs (:func:`posformer.metrics.aggregate`)."""
    rows = [
        {**row, "group": r["_group"], "seed": r.get("seed"), "pe": r.get("pe")}
        for r in runs
        for row in r.get("results", [])
    ]
    if not rows:
        return []
    frame = pd.DataFrame(rows).astype({"length": int})
    agg = metrics.aggregate(
        frame,
        ["group", "length"],
        METRICS,
        sort_rest=True,
        pe=("pe", metrics.first),
        in_distribution=("in_distribution", lambda s: bool(s.iloc[0])),
        n_runs=("length", "size"),
        seeds=("seed", lambda s: sorted(int(x) for x in s.dropna())),
    )
    agg["pe"] = [str(pe or group) for pe, group in zip(agg["pe"], agg["group"])]
    stats = [f"{m}_{s}" for m in METRICS for s in metrics.STATS]
    return metrics.records(agg[["group", "pe", "length", "in_distribution", "n_runs", "seeds", *stats]])


# ---------------------------------------------------------------------------------------------- outputs
def summary_table(
    rows: list[dict[str, Any]], metric: str
) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
    """The table's rows (one per group, a ``mean ± std`` cell per length) and its ``(key, header)``
    columns."""
    trained = {r["length"] for r in rows if r["in_distribution"]}

    def cell(r: dict[str, Any]) -> str:
        return fmt_spread(r[f"{metric}_mean"], r[f"{metric}_std"])

    return by_length(rows, cell, index="group", trained=trained)


def _caption(rows: list[dict[str, Any]], metric: str) -> str:
    n = sorted({r["n_runs"] for r in rows})
    seeds = f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"
    return f"{metrics.REGISTRY[metric].title}, mean ± std over {seeds} seed(s) per model; * = training length"


def summary_markdown(rows: list[dict[str, Any]], metric: str, failed: list[dict[str, str]]) -> str:
    table, columns = summary_table(rows, metric)
    lines = [
        _caption(rows, metric),
        "",
        markdown_table(table, columns, align={"group": "l"}, missing="").rstrip("\n"),
    ]
    if failed:
        lines += ["", f"failed jobs ({len(failed)}):"]
        lines += [f"- {f['job']}: {f['error']} ({f['path']})" for f in failed]
    return "\n".join(lines) + "\n"


#: a task model "did not learn in distribution" below this exact match at its training lengths
LEARNED_EXACT_MATCH = 0.5
#: an LM "did not learn in distribution" at or above this share of the unigram perplexity
LEARNED_UNIGRAM_SHARE = 0.5


def unigram_baseline(runs: list[dict[str, Any]]) -> float | None:
    """The unigram perplexity of the validation text the runs report (``data.unigram_ppl``), if any."""
    values = [float(v) for r in runs if (v := (r.get("data") or {}).get("unigram_ppl")) is not None]
    return max(values) if values else None


def not_learned_line(rows: list[dict[str, Any]], metric: str, unigram: float | None) -> str:
    """One line naming the groups that did not learn in distribution, with the threshold it used: an LM
    whose perplexity at the training length is at least half the unigram perplexity of the validation
    text (no line without that baseline), a task model below 0.5 exact match at a training length."""
    ind = [r for r in rows if r["in_distribution"] and r[f"{metric}_mean"] is not None]
    if metric == "ppl":
        if unigram is None:
            return ""
        limit = LEARNED_UNIGRAM_SHARE * unigram
        bad = {r["group"] for r in ind if r["ppl_mean"] >= limit}
        rule = (
            f"perplexity at the training length >= {fmt(limit)}, half the unigram perplexity "
            f"{fmt(unigram)} of the validation text"
        )
    elif metric == "exact_match":
        limit = LEARNED_EXACT_MATCH
        bad = {r["group"] for r in ind if r["exact_match_mean"] < limit}
        rule = f"exact match < {limit} at a training length"
    else:
        return ""
    names = [g for g in dict.fromkeys(r["group"] for r in rows) if g in bad]
    return f"did not learn in distribution ({rule}): {', '.join(names) if names else 'none'}"


def scored_caption(results: list[dict[str, Any]], lm: bool) -> str:
    """What one point of a figure averages: ``each point: 8,192 scored tokens per model (256 windows of
    32 … 32 windows of 256)`` for LMs, ``each point: 128 sequences per model and length`` for tasks;
    empty when the results do not say."""
    per_length = {int(x["length"]): int(x["n_sequences"]) for x in results if x.get("n_sequences")}
    # training's results say n_tokens, posformer-eval's scored_tokens
    tokens = sorted({int(x.get("n_tokens") or x.get("scored_tokens") or 0) for x in results} - {0})
    if not per_length:
        return ""
    (l0, n0), (l1, n1) = min(per_length.items()), max(per_length.items())
    if lm and tokens:
        total = f"{tokens[0]:,}" if len(tokens) == 1 else f"{tokens[0]:,}–{tokens[-1]:,}"
        windows = f"{n0:,} windows of {l0}" + (f" … {n1:,} windows of {l1}" if l1 != l0 else "")
        return f"each point: {total} scored tokens per model ({windows})"
    seqs = sorted(set(per_length.values()))
    count = f"{seqs[0]:,}" if len(seqs) == 1 else f"{seqs[0]:,}–{seqs[-1]:,}"
    return f"each point: {count} sequences per model and length"


def plot_summary(
    rows: list[dict[str, Any]],
    metric: str,
    train_lengths: list[int],
    path: Path,
    unigram: float | None = None,
    caption: str = "",
    unit: str = "tokens",
) -> Path:
    """``summary.png``/``.svg``: ``metric`` vs length, one line per group (mean, ± std band); a dotted
    unigram baseline for perplexity when known; ``caption`` under the axes (what each point scores);
    ``unit``: what a length counts (``tokens`` for a language model, ``symbols`` for a task)."""
    lines = mean_lines(rows, metric)
    name = metrics.REGISTRY[metric].title
    title = f"{name[0].upper()}{name[1:]} vs evaluation length ({len(lines)} models)"
    base = (unigram, f"unigram baseline {fmt(unigram)}") if unigram is not None and metric == "ppl" else None
    lengths = [r["length"] for r in rows]
    return length_figure(
        path, title, lines, metric, lengths, train_lengths, unit=unit, baseline=base, caption=caption
    )


def collect(
    sweep_dir: str | Path, out_dir: str | Path | None = None, metric: str | None = None
) -> dict[str, Any]:
    """Summarise ``sweep_dir`` into ``summary.{json,csv,md,png,svg}``; returns the summary dict.

    ``metric``: the table's and figure's metric (default: ``ppl`` for language models, else
    ``exact_match``). Raises :class:`ConfigError` for a missing dir, an unknown metric or no results.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ConfigError(
            f"{sweep_dir} is not a directory; pass the sweep dir printed by posformer-train -m."
        )
    if metric is not None and metric not in METRICS:
        raise ConfigError(f"metric={metric!r} is unknown; valid: {', '.join(METRICS)}.")
    runs, failed = load_jobs(sweep_dir)
    if not runs:
        raise ConfigError(f"no results.json under {sweep_dir}; did the jobs finish (evaluate=true)?")
    if metric is None:
        lm = all((r.get("data") or {}).get("task_type") == "lm" for r in runs)
        metric = "ppl" if lm else "exact_match"
    rows = aggregate(runs)
    tls = sorted({int(r["train_length"]) for r in runs if isinstance(r.get("train_length"), int)})
    out = Path(out_dir) if out_dir else sweep_dir
    md = summary_markdown(rows, metric, failed)
    unigram = unigram_baseline(runs)
    learned = not_learned_line(rows, metric, unigram)
    if learned:
        md += f"\n{learned}\n"
    summary = {
        "sweep_dir": str(sweep_dir),
        "metric": metric,
        "train_length": tls[-1] if tls else None,
        "n_runs": len(runs),
        "groups": list(dict.fromkeys(r["_group"] for r in runs)),
        "runs": [{"label": r["_label"], "group": r["_group"], "dir": r["_dir"]} for r in runs],
        "failed": failed,
        "unigram_ppl": unigram,
        "not_learned": learned,
        "rows": rows,
    }
    write_tables(out, "summary", rows, CSV_FIELDS, md, summary)
    caption = scored_caption([x for r in runs for x in r.get("results", [])], metric == "ppl")
    unit = "tokens" if all((r.get("data") or {}).get("task_type") == "lm" for r in runs) else "symbols"
    summary["figure"] = str(plot_summary(rows, metric, tls, out / "summary.png", unigram, caption, unit))
    summary["markdown"] = md
    return summary


def print_summary(summary: dict[str, Any], out_dir: Path) -> None:
    """The summary table (rich) and the paths of the summary files, on stdout."""
    table, columns = summary_table(summary["rows"], summary["metric"])
    print_table(
        table,
        columns,
        f"sweep: {_caption(summary['rows'], summary['metric'])}",
        align={"group": "l"},
        missing="",
    )
    if summary.get("not_learned"):
        print(summary["not_learned"])
    print(f"summary    : {out_dir / 'summary.md'} (.json, .csv)\nfigure     : {summary['figure']} (.svg)")


def print_failures(failed: list[dict[str, str]], n_jobs: int) -> None:
    """Which jobs failed, their one-line errors and the path of each ``error.txt``, on stderr."""
    print(f"{len(failed)} of {n_jobs} sweep jobs failed:", file=sys.stderr)
    for f in failed:
        print(f"  {f['job']}: {f['error']}\n    {f['path']}", file=sys.stderr)


class SweepSummary(Callback):
    """Hydra callback: when a multirun ends, summarise its sweep dir; exit 1 if any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        runs, failed = load_jobs(sweep_dir) if sweep_dir.is_dir() else ([], [])
        if runs:
            print_summary(collect(sweep_dir), sweep_dir)
        if failed:
            print_failures(failed, len(runs) + len(failed))
            raise SystemExit(1)
