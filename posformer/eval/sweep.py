"""A training sweep (Hydra multirun) as one table and one figure: :func:`collect` on the sweep dir, run
by the multirun's callback (:mod:`posformer.cli.sweep_callback`) or by ``scripts/collect_sweep.py``.

A group's cells (jobs: :mod:`posformer.eval.sweep_jobs`) are the mean ± std over its seeds (no ± for
one seed). Files written to the sweep dir (or ``out_dir``): ``summary.json`` (every metric, mean and
std per group and length, and the failed jobs), ``summary.csv``, ``summary.md`` and
``summary.{png,svg}`` (the table's metric vs length, one line per group with a ± std band, coloured
by PE; a group of a named variant, ``+variant=prope``, by its own colour).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd

from posformer import metrics
from posformer.errors import ConfigError
from posformer.eval.sweep_jobs import load_jobs
from posformer.utils.figures import length_figure, mean_lines
from posformer.utils.format import fmt, markdown_table, print_table, spread_table, write_tables

#: the summarised metrics, in the order of training's results files
METRICS = metrics.names()
CSV_FIELDS = (
    "group",
    "pe",
    "length",
    "in_distribution",
    "n_runs",
    *(f"{m}_{s}" for m in METRICS for s in ("mean", "std")),
)


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, length), groups in job order: mean, std (``None`` for one seed) and number of
    values of every metric over the group's runs (:func:`posformer.metrics.aggregate`)."""
    named = [r.get("variant") for r in runs if r.get("variant")]  # runs with a variant (+variant=...)
    rows = [
        {**row, "group": r["_group"], "seed": r.get("seed"), "pe": r.get("pe")}
        | ({"variant": r.get("variant")} if named else {})
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
        **({"variant": ("variant", metrics.first)} if named else {}),
    )
    agg["pe"] = [str(pe or group) for pe, group in zip(agg["pe"], agg["group"])]
    stats = [f"{m}_{s}" for m in METRICS for s in metrics.STATS]
    who = ["group", "pe", *(["variant"] if named else []), "length", "in_distribution", "n_runs", "seeds"]
    return metrics.records(agg[[*who, *stats]])


# ---------------------------------------------------------------------------------------------- outputs
def _caption(rows: list[dict[str, Any]], metric: str) -> str:
    n = sorted({r["n_runs"] for r in rows})
    seeds = f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"
    return f"{metrics.REGISTRY[metric].title}, mean ± std over {seeds} seed(s) per model; * = training length"


def summary_markdown(rows: list[dict[str, Any]], metric: str, failed: list[dict[str, str]]) -> str:
    table, columns = spread_table(rows, metric)
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
    table, columns = spread_table(summary["rows"], summary["metric"])
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
