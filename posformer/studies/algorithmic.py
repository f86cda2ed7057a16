"""Study 2: algorithmic length generalization of every PE, with and without randomized positions.

A decoder-only model learns a synthetic task (``reverse`` by default) on instance lengths
``train_len``; every PE is trained with ordinary positions and with randomized positions (Ruoss et
al. 2023: sorted random subsets of ``[0, n_max)`` in training), >= 3 seeds, then evaluated with
``posformer-eval`` (exact match and token accuracy per length). Out-of-distribution numbers are only
read for configurations whose in-distribution exact match reaches ``--id-threshold`` (default 0.9):
the table marks the others. Every evaluated run is recorded in ``--ledger``
(:mod:`posformer.studies.ledger`) and the summary is built from the records
(:mod:`posformer.studies.algorithmic_summary`).

    posformer-study algorithmic --size tiny
    posformer-study algorithmic --size small --task addition --seeds 0 1 2
    python scripts/study_algorithmic.py --size tiny                # the same

Outputs in ``--out``: ``train/`` (the sweep), ``eval/``, ``summary.md``, ``summary.csv``,
``summary.json``, ``summary_exact_match.png``, ``summary_token_acc.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

from posformer import metrics
from posformer.studies.aggregate import fmt_cell
from posformer.studies.algorithmic_summary import (
    ID_THRESHOLD,
    METRICS,
    ORDINARY_EVAL,
    gain_table,
    mean_gains,
    randomization_gains,
    reads_positions,
    summarise,
    to_json,
)
from posformer.studies.commands import run
from posformer.studies.common import VENV_BIN, StudyError, all_pes, project_root
from posformer.studies.figures import plot_series
from posformer.studies.jobs import parse_cores, train_sweep
from posformer.studies.ledger import check_setup as ledger_check_setup
from posformer.studies.ledger import invocations, read_records, recorded, records_wall, write_record
from posformer.studies.lm import model_overrides

__all__ = ["SIZES", "add_arguments", "check_setup", "record_runs", "run_study"]

#: the model, steps, batch, training and evaluation lengths, test instances per length, n_max of each size
_MODEL_FIELDS = ("d_model", "n_layers", "n_heads", "d_ff")
_RUN_FIELDS = ("steps", "batch", "train_len", "lengths", "n_eval", "n_max")
SIZES: dict[str, dict[str, Any]] = {
    name: dict(zip(_MODEL_FIELDS + _RUN_FIELDS, values, strict=True))
    for name, *values in (
        ("tiny", 64, 2, 4, 256, 500, 64, [1, 5], [3, 5, 8, 10, 15, 20], 128, 64),
        ("small", 128, 3, 4, 512, 3000, 64, [1, 16], [8, 16, 24, 32, 48, 64], 256, 256),
        # indirect indexing (--task indirect_index --symbols 64): one CPU core trains a run in ~4 min
        ("indirect", 64, 2, 4, 256, 8000, 64, [4, 16], [4, 8, 12, 16, 24, 32], 256, 64),
    )
}
#: what a run's record keeps of each evaluation row (nothing machine-bound)
KEEP = (
    "pe",
    "task_type",
    "mode",
    "length",
    "train_len",
    "in_distribution",
    "status",
    "reason",
    *(m for m in metrics.names(lead="lm") if not metrics.REGISTRY[m].exp),  # perplexity: exp(loss)
    "scored_tokens",
    "n_sequences",
    "seconds",
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the algorithmic study."""
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pes", nargs="+", default=all_pes())
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--symbols", type=int, default=None, help="data.symbols (default: the data config's, 16)")
    ap.add_argument(
        "--n-train",
        type=int,
        default=None,
        help="data.n_train, training instances (default: the data config's, 20000)",
    )
    ap.add_argument(
        "--plain-only",
        action="store_true",
        help="train with ordinary positions only (no randomized-positions runs)",
    )
    ap.add_argument("--id-threshold", type=float, default=ID_THRESHOLD)
    ap.add_argument(
        "--out", type=Path, default=None, help="default outputs/studies/algorithmic_<task>_<size>"
    )
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--cores", default="0", help="cores to run jobs on, one job per core (e.g. 0,1)")
    ap.add_argument(
        "--stop-at",
        type=float,
        default=None,
        help="stop a run once its validation exact match (training lengths) reaches this value "
        "(Lightning EarlyStopping stopping_threshold, checked every --val-every steps); "
        "default: train every run for the full --steps",
    )
    ap.add_argument("--val-every", type=int, default=None, help="validation interval (default: steps / 2)")
    ap.add_argument(
        "--ledger",
        type=Path,
        default=None,
        help="folder of the per-run records (posformer.studies.ledger; the studies of "
        "docs/leaderboard.md commit theirs under docs/studies/); recorded runs are not trained "
        "again (default: <out>/records)",
    )
    ap.add_argument(
        "--launch-for",
        type=float,
        default=None,
        metavar="MIN",
        help="start no training run after this many minutes; the running ones finish, then the "
        "finished runs are evaluated, recorded and summarised (the rest: run the command again)",
    )


def train_overrides(args: argparse.Namespace, size: dict[str, Any]) -> list[str]:
    """The study's ``posformer-train`` overrides (recorded with every run: a ledger is one setting)."""
    lo, hi = size["train_len"]
    common = [
        *model_overrides(size),
        "data=synthetic",
        f"data.task={args.task}",
        f"data.train_len=[{lo},{hi}]",
        f"data.eval_lengths=[{','.join(map(str, size['lengths']))}]",
        f"data.n_eval_per_length={size['n_eval']}",
        "data.n_val=256",
        f"data.batch_size={size['batch']}",
        *([f"data.symbols={args.symbols}"] if args.symbols is not None else []),
        *([f"data.n_train={args.n_train}"] if args.n_train is not None else []),
        "data.seed=1234",
        f"trainer.max_steps={size['steps']}",
        f"trainer.val_check_interval={args.val_every or max(size['steps'] // 2, 1)}",
        f"schedule.warmup_steps={max(size['steps'] // 10, 1)}",
        "optim.lr=3e-3",
        f"positions.n_max={size['n_max']}",
    ]
    if args.stop_at is not None:
        common += [
            "callbacks=early_stopping",
            "callbacks.early_stopping.monitor=val/exact_match",
            "callbacks.early_stopping.mode=max",
            f"callbacks.early_stopping.stopping_threshold={args.stop_at}",
            f"callbacks.early_stopping.patience={10**6}",  # only the threshold stops a run
        ]
    return common


def grid(pes: list[str], seeds: list[int], plain_only: bool = False) -> list[dict[str, Any]]:
    """The runs: every PE with ordinary positions, and with randomized ones if it reads positions
    (unless ``plain_only``)."""
    return [
        {"pe": pe, "positions.randomized": rand, "seed": seed}
        for pe in pes
        for rand in (["false", "true"] if reads_positions(pe) and not plain_only else ["false"])
        for seed in seeds
    ]


def run_study(args: argparse.Namespace) -> None:
    """The study (see the module docstring); ``args.command`` is the command line shown in the summary."""
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    name = f"algorithmic_{args.task}_{args.size}"
    out = (args.out or project_root() / "outputs" / "studies" / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = train_overrides(args, size)
    ledger = (args.ledger or out / "records").resolve()
    deadline = time.time() + 60 * args.launch_for if args.launch_for is not None else None
    runs = grid(args.pes, args.seeds, args.plain_only)
    check_setup(read_records(ledger), common, ledger)
    timing = {}
    if not args.skip_train:
        timing["train_s"] = train_sweep(
            out, common, runs, cores=parse_cores(args.cores), recorded=recorded(ledger), launch_until=deadline
        )
    timing["eval_s"] = record_runs(out / "train", ledger, size["lengths"], common)
    records = {
        name: rec
        for name, rec in read_records(ledger).items()
        if rec["pe"] in args.pes and rec["seed"] in args.seeds
    }
    if not records:
        raise StudyError(f"no finished runs yet: no records in {ledger}; train first (without --skip-train)")
    summary = summarise(records, args.pes, size["train_len"][1], args.id_threshold)
    lines = header(
        args,
        size,
        f"Runs: {len(records)} of {len(runs)} recorded in `{ledger}`.  ",
        f"Wall time: training {records_wall(records)}, evaluation of this call's new runs "
        f"{timing['eval_s']:.0f} s.",
    )
    lines += tables(out, args, size, summary)
    write_summary(out, args, summary, timing, lines)


def header(args: argparse.Namespace, size: dict[str, Any], runs_line: str, wall_line: str) -> list[str]:
    """The summary's first lines: the command, the setup, how to read the cells, the runs, the wall time."""
    lo, hi = size["train_len"]
    stop = (
        f" at most, stopped once validation exact match reached {args.stop_at} (checked every "
        f"{args.val_every} steps)"
        if args.stop_at is not None
        else ""
    )
    return [
        f"# Algorithmic length generalization ({args.task}, {args.size})",
        "",
        f"Command: `{args.command}`  ",
        f"Model: decoder-only, d_model={size['d_model']}, layers={size['n_layers']}, "
        f"heads={size['n_heads']}; "
        f"task `{args.task}` trained on instance lengths {lo}-{hi} for {size['steps']} steps"
        + stop
        + f" (batch {size['batch']}); randomized positions with n_max={size['n_max']}; seeds {args.seeds}; "
        f"{size['n_eval']} test instances per length.  ",
        f"Cells: exact match, mean ± std over seeds; `*` = in the training range. Rows whose in-distribution "
        f"exact match is below {args.id_threshold} are marked ✗ (their OOD numbers are not meaningful).  ",
        runs_line,
        wall_line,
        "",
    ]


def tables(out: Path, args: argparse.Namespace, size: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """One table and plot per metric (cells per length), then the gain table and the ordinary-eval gain."""
    lo, hi = size["train_len"]
    lengths, series = size["lengths"], summary["series"]
    agg, id_acc = summary["cells"], summary["id_exact_match"]
    lines: list[str] = []
    for metric in METRICS:
        marks = [f"{L}{'*' if lo <= L <= hi else ''}" for L in lengths]
        lines += [f"## {metric}", "", "| PE | ID ok | " + " | ".join(marks) + " |"]
        lines.append("|---" * (len(lengths) + 2) + "|")
        for s in series:
            ok = "✓" if id_acc[s] >= args.id_threshold else f"✗ ({id_acc[s]:.2f})"
            keys = [(metric, s, "task", L) for L in lengths]
            row = [fmt_cell(agg[k]) if k in agg else "" for k in keys]
            lines.append(f"| {s} | {ok} | " + " | ".join(row) + " |")
        lines.append("")
        sub = {k[1:]: v for k, v in agg.items() if k[0] == metric}
        plot_series(
            sub,
            series,
            "task",
            lengths,
            (lo, hi),
            out / f"summary_{metric}.png",
            metric,
            logy=False,
            title=f"{args.task}: {metric} (train lengths {lo}-{hi})",
        )
    lines += gain_table(summary["ood"], args.pes, id_acc, args.id_threshold, summary["steps"])
    ordinary = randomization_gains(summary["ood"], args.pes, ORDINARY_EVAL)
    for _, n, mean in mean_gains(ordinary):  # every PE
        lines += [
            f"The same randomized runs evaluated with ordinary positions (0 … T-1; the "
            f"`{ORDINARY_EVAL[2:]}` rows): mean gain over {n} PEs {mean['token_acc']:+.1f} pp token "
            f"accuracy, {mean['exact_match']:+.1f} pp exact match.",
            "",
        ]
    return lines


def write_summary(
    out: Path, args: argparse.Namespace, summary: dict[str, Any], timing: dict[str, float], lines: list[str]
) -> None:
    """``summary.md`` (``lines``), ``summary.json`` (what the leaderboard reads) and ``summary.csv``."""
    (out / "summary.md").write_text("\n".join(lines))
    agg, id_acc = summary["cells"], summary["id_exact_match"]
    cells = [{"metric": k[0], "series": k[1], "length": k[3], **v} for k, v in agg.items()]
    content = {"task": args.task, "size": args.size, **to_json(summary), "timing": timing, "cells": cells}
    (out / "summary.json").write_text(json.dumps(content, indent=1))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "length", "metric", "mean", "std", "n_seeds", "id_exact_match"])
        for (metric, s, _, L), a in sorted(agg.items()):
            w.writerow([s, L, metric, a["mean"], a["std"], a["n"], id_acc[s]])
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


def record_runs(sweep: Path, ledger: Path, lengths: list[int], common: list[str]) -> float:
    """Evaluate every finished run of ``sweep`` (``results.json``) that ``ledger`` has no record of, at
    ``lengths`` (``posformer-eval``, final weights), and record each: its PE, randomized positions or
    not, seed, steps, training invocations, the study's overrides and its evaluation rows. A run trained
    with randomized positions is evaluated twice: with randomized positions (row mode
    ``task_randomized``: Ruoss et al.'s protocol, whose code samples positions in every forward) and with
    ordinary ones (mode ``task``). Interrupted runs are left out. Returns the evaluations' seconds."""
    from omegaconf import OmegaConf

    have = recorded(ledger)
    names = [p.parent.name for p in sorted(sweep.glob("*/results.json")) if p.parent.name not in have]
    if not names:
        return 0.0
    cfgs = {n: OmegaConf.load(sweep / n / "config.yaml") for n in names}
    ckpt = {n: sweep / n / "checkpoints" / "last.ckpt" for n in names}
    rows: list[dict[str, Any]] = []
    seconds = 0.0
    for randomized in (False, True):
        group = [n for n in names if bool(cfgs[n].positions.randomized) is randomized]
        if group:
            seconds += _evaluate(sweep, [ckpt[n] for n in group], lengths, randomized, rows)
    for name in names:
        mine = [{k: r.get(k) for k in KEEP} for r in rows if Path(r["checkpoint"]) == ckpt[name]]
        if not mine:
            raise StudyError(f"no evaluation rows of {ckpt[name]}; its run is not recorded")
        res = json.loads((sweep / name / "results.json").read_text())
        write_record(
            ledger,
            name,
            {
                "pe": mine[0]["pe"],
                "randomized": bool(cfgs[name].positions.randomized),
                "seed": int(cfgs[name].seed),
                "steps": int(res["global_step"]),
                "invocations": invocations(sweep, name),
                "overrides": common,
                "rows": mine,
            },
        )
    print(f"  recorded {len(names)} run(s) in {ledger}", flush=True)
    return seconds


def _evaluate(sweep: Path, ckpts: list[Path], lengths: list[int], randomized: bool, rows: list) -> float:
    """``posformer-eval`` of ``ckpts`` at ``lengths`` into ``<sweep>/../eval/<time>[_randomized]``; its
    rows are appended to ``rows``. Returns its seconds."""
    out = sweep.parent / "eval" / (time.strftime("%Y%m%d_%H%M%S") + ("_randomized" if randomized else ""))
    cmd = [
        str(VENV_BIN / "posformer-eval"),
        f"eval.checkpoints=[{','.join(map(str, ckpts))}]",
        f"eval.lengths=[{','.join(map(str, lengths))}]",
        f"eval.task_positions=[{'ordinary,randomized' if randomized else 'ordinary'}]",
        f"eval.output_dir={out}",
        f"paths.log_dir={out}",
        "eval.progress=false",
    ]
    seconds = run(cmd, out.parent / f"{out.name}.log")
    rows += json.loads((out / "extrapolation.json").read_text())["results"]
    return seconds


def check_setup(records: dict[str, dict[str, Any]], common: list[str], ledger: Path) -> None:
    """Refuse records trained with other overrides than ``common``
    (:func:`posformer.studies.ledger.check_setup`)."""
    ledger_check_setup(records, common, ledger, key="overrides")
