#!/usr/bin/env python
"""Study 2: algorithmic length generalization of every PE, with and without randomized positions.

A decoder-only model learns a synthetic task (``reverse`` by default) on instance lengths
``train_len``; every PE is trained with ordinary positions and with randomized positions (Ruoss et
al. 2023: sorted random subsets of ``[0, n_max)`` in training, ordinary positions in evaluation),
>= 3 seeds, then evaluated with ``posformer-eval`` (exact match and token accuracy per length).
Out-of-distribution numbers are only read for configurations whose in-distribution exact match
reaches ``--id-threshold`` (default 0.9): the table marks the others.

    python scripts/study_algorithmic.py --size tiny
    python scripts/study_algorithmic.py --size small --task addition --seeds 0 1 2

Outputs in ``--out``: ``train/`` (the sweep), ``eval/``, ``summary.md``, ``summary.csv``,
``summary_exact_match.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import posformer.pe.registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_jobs import VENV_BIN, run  # noqa: E402
from study_ledger import check_setup as ledger_check_setup  # noqa: E402
from study_ledger import invocations, read_records, recorded, train_seconds, write_record  # noqa: E402
from study_lm_extrapolation import (  # noqa: E402
    ALL_PES,
    ROOT,
    fmt_cell,
    mean_std,
    model_overrides,
    parse_cores,
    plot,
    train_sweep,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=256,
        steps=500,
        batch=64,
        train_len=[1, 5],
        lengths=[3, 5, 8, 10, 15, 20],
        n_eval=128,
        n_max=64,
    ),
    "small": dict(
        d_model=128,
        n_layers=3,
        n_heads=4,
        d_ff=512,
        steps=3000,
        batch=64,
        train_len=[1, 16],
        lengths=[8, 16, 24, 32, 48, 64],
        n_eval=256,
        n_max=256,
    ),
}


#: the series suffix of a randomized-positions run evaluated with ordinary positions
ORDINARY_EVAL = ", ordinary eval"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pes", nargs="+", default=ALL_PES)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--id-threshold", type=float, default=0.9)
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
        help="folder of the per-run records (study_ledger.py; the studies of docs/leaderboard.md commit "
        "theirs under docs/studies/); recorded runs are not trained again (default: <out>/records)",
    )
    ap.add_argument(
        "--launch-for",
        type=float,
        default=None,
        metavar="MIN",
        help="start no training run after this many minutes; the running ones finish, then the finished "
        "runs are evaluated, recorded and summarised (the rest: run the command again)",
    )
    args = ap.parse_args()
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    out = (args.out or ROOT / "outputs" / "studies" / f"algorithmic_{args.task}_{args.size}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    lo, hi = size["train_len"]
    lengths = size["lengths"]
    common = [
        *model_overrides(size),
        "data=synthetic",
        f"data.task={args.task}",
        f"data.train_len=[{lo},{hi}]",
        f"data.eval_lengths=[{','.join(map(str, lengths))}]",
        f"data.n_eval_per_length={size['n_eval']}",
        "data.n_val=256",
        f"data.batch_size={size['batch']}",
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
    ledger = (args.ledger or out / "records").resolve()
    deadline = time.time() + 60 * args.launch_for if args.launch_for is not None else None
    grid = [
        {"pe": pe, "positions.randomized": rand, "seed": seed}
        for pe in args.pes
        for rand in (["false", "true"] if reads_positions(pe) else ["false"])
        for seed in args.seeds
    ]
    n_grid = len(grid)
    check_setup(read_records(ledger), common, ledger)
    timing = {}
    if not args.skip_train:
        timing["train_s"] = train_sweep(
            out,
            common,
            grid,
            cores=parse_cores(args.cores),
            recorded=recorded(ledger),
            launch_until=deadline,
        )
    timing["eval_s"] = record_runs(out / "train", ledger, lengths, common)
    records = {
        name: rec
        for name, rec in read_records(ledger).items()
        if rec["pe"] in args.pes and rec["seed"] in args.seeds
    }
    if not records:
        raise SystemExit(f"no finished runs yet: no records in {ledger}; train first (without --skip-train)")
    rows = rows_of(records)
    variants = [v for pe in args.pes for v in (pe, f"{pe} + randomized", f"{pe} + randomized{ORDINARY_EVAL}")]
    series = [s for s in variants if any(r["series"] == s for r in rows)]
    agg: dict[tuple, dict[str, Any]] = {}
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["series"], "task", r["length"])].append(r)
    for key, rs in groups.items():
        for metric in ("exact_match", "token_acc"):
            ok = [r[metric] for r in rs if r["status"] == "ok"]
            m, s = mean_std(ok)
            agg[(metric, *key)] = {
                "mean": m,
                "std": s,
                "n": len(ok),
                "na": len(rs) - len(ok),
                "seeds": sorted({r["seed"] for r in rs}),
            }
    # precondition: in-distribution exact match (mean over in-distribution lengths and seeds)
    id_acc = {}
    for s in series:
        vals = [
            r["exact_match"]
            for r in rows
            if r["series"] == s and r.get("in_distribution") and r["status"] == "ok"
        ]
        id_acc[s] = mean_std(vals)[0]
    ood = ood_means(rows, series, hi)
    steps = {
        sr: mean_std([r["steps"] for r in rows if r["series"] == sr and r["in_distribution"]])
        for sr in series
    }
    cmd = " ".join(["python scripts/study_algorithmic.py", *sys.argv[1:]])
    lines = [
        f"# Algorithmic length generalization ({args.task}, {args.size})",
        "",
        f"Command: `{cmd}`  ",
        f"Model: decoder-only, d_model={size['d_model']}, layers={size['n_layers']}, "
        f"heads={size['n_heads']}; "
        f"task `{args.task}` trained on instance lengths {lo}-{hi} for {size['steps']} steps"
        + (
            f" at most, stopped once validation exact match reached {args.stop_at} (checked every "
            f"{args.val_every} steps)"
            if args.stop_at is not None
            else ""
        )
        + f" (batch "
        f"{size['batch']}); randomized positions with n_max={size['n_max']}; seeds {args.seeds}; "
        f"{size['n_eval']} test instances per length.  ",
        f"Cells: exact match, mean ± std over seeds; `*` = in the training range. Rows whose in-distribution "
        f"exact match is below {args.id_threshold} are marked ✗ (their OOD numbers are not meaningful).  ",
        f"Runs: {len(records)} of {n_grid} recorded in `{ledger}`.  ",
        f"Wall time: training {records_wall(records)}, evaluation of this call's new runs "
        f"{timing['eval_s']:.0f} s.",
        "",
    ]
    for metric in ("exact_match", "token_acc"):
        lines += [
            f"## {metric}",
            "",
            "| PE | ID ok | " + " | ".join(f"{L}{'*' if lo <= L <= hi else ''}" for L in lengths) + " |",
            "|---" * (len(lengths) + 2) + "|",
        ]
        for s in series:
            ok = "✓" if id_acc[s] >= args.id_threshold else f"✗ ({id_acc[s]:.2f})"
            cells = [
                fmt_cell(agg[(metric, s, "task", L)]) if (metric, s, "task", L) in agg else ""
                for L in lengths
            ]
            lines.append(f"| {s} | {ok} | " + " | ".join(cells) + " |")
        lines.append("")
        sub = {k[1:]: v for k, v in agg.items() if k[0] == metric}
        plot(
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
    lines += gain_table(ood, args.pes, id_acc, args.id_threshold, steps)
    ordinary = randomization_gains(ood, args.pes, ORDINARY_EVAL)
    if ordinary:
        tok = statistics.fmean(g["token_acc"] for g in ordinary.values())
        em = statistics.fmean(g["exact_match"] for g in ordinary.values())
        lines += [
            f"The same randomized runs evaluated with ordinary positions (0 … T-1; the `{ORDINARY_EVAL[2:]}` "
            f"rows): mean gain over {len(ordinary)} PEs {tok:+.1f} pp token accuracy, {em:+.1f} pp exact "
            "match.",
            "",
        ]
    (out / "summary.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(
        json.dumps(
            {
                "task": args.task,
                "size": args.size,
                "id_threshold": args.id_threshold,
                "id_exact_match": id_acc,
                "steps": {k: v[0] for k, v in steps.items()},
                "ood": {f"{k[0]}|{k[1]}": v for k, v in ood.items()},
                "gain_pp": randomization_gains(ood, args.pes),
                "gain_pp_ordinary_eval": randomization_gains(ood, args.pes, ORDINARY_EVAL),
                "timing": timing,
                "cells": [{"metric": k[0], "series": k[1], "length": k[3], **v} for k, v in agg.items()],
            },
            indent=1,
        )
    )
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "length", "metric", "mean", "std", "n_seeds", "id_exact_match"])
        for (metric, s, _, L), a in sorted(agg.items()):
            w.writerow([s, L, metric, a["mean"], a["std"], a["n"], id_acc[s]])
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


def record_runs(sweep: Path, ledger: Path, lengths: list[int], common: list[str]) -> float:
    """Evaluate every finished run of ``sweep`` (``results.json``) that ``ledger`` has no record of, at
    ``lengths`` (``posformer-eval``, final weights), and record each (:mod:`study_ledger`): its PE,
    randomized positions or not, seed, steps, training invocations, the study's overrides and its
    evaluation rows. A run trained with randomized positions is evaluated twice: with randomized
    positions (row mode ``task_randomized``: Ruoss et al.'s protocol, whose code samples positions in
    every forward) and with ordinary ones (mode ``task``). Interrupted runs are left out. Returns the
    evaluations' seconds (0 if none)."""
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
        if not group:
            continue
        out = sweep.parent / "eval" / (time.strftime("%Y%m%d_%H%M%S") + ("_randomized" if randomized else ""))
        cmd = [
            str(VENV_BIN / "posformer-eval"),
            f"eval.checkpoints=[{','.join(str(ckpt[n]) for n in group)}]",
            f"eval.lengths=[{','.join(map(str, lengths))}]",
            f"eval.task_positions=[{'ordinary,randomized' if randomized else 'ordinary'}]",
            f"eval.output_dir={out}",
            f"paths.log_dir={out}",
            "eval.progress=false",
        ]
        seconds += run(cmd, out.parent / f"{out.name}.log")
        rows += json.loads((out / "extrapolation.json").read_text())["results"]
    keep = ("pe", "task_type", "mode", "length", "train_len", "in_distribution", "status", "reason", "loss",
            "exact_match", "token_acc", "scored_tokens", "n_sequences", "seconds")  # fmt: skip
    for name in names:
        run_dir = sweep / name
        mine = [{k: r.get(k) for k in keep} for r in rows if Path(r["checkpoint"]) == ckpt[name]]
        if not mine:
            raise SystemExit(f"no evaluation rows of {ckpt[name]}; its run is not recorded")
        res = json.loads((run_dir / "results.json").read_text())
        write_record(ledger, name, {
            "pe": mine[0]["pe"],
            "randomized": bool(cfgs[name].positions.randomized),
            "seed": int(cfgs[name].seed),
            "steps": int(res["global_step"]),
            "invocations": invocations(sweep, name),
            "overrides": common,
            "rows": mine,
        })  # fmt: skip
    print(f"  recorded {len(names)} run(s) in {ledger}", flush=True)
    return seconds


def check_setup(records: dict[str, dict[str, Any]], common: list[str], ledger: Path) -> None:
    """Refuse records trained with other overrides than ``common`` (:func:`study_ledger.check_setup`)."""
    ledger_check_setup(records, common, ledger, key="overrides")


def rows_of(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation rows of every record, each with its run, seed, steps and series: the PE for a
    plain run; for a randomized-positions run ``<pe> + randomized`` (evaluated with randomized
    positions, the protocol of Ruoss et al.) and ``<pe> + randomized, ordinary eval``."""
    rows = []
    for name, rec in records.items():
        for r in rec["rows"]:
            series = rec["pe"]
            if rec["randomized"]:
                series += " + randomized" + ("" if r.get("mode") == "task_randomized" else ORDINARY_EVAL)
            rows.append({**r, "run": name, "seed": rec["seed"], "steps": rec["steps"], "series": series})
    return rows


def records_wall(records: dict[str, dict[str, Any]]) -> str:
    """The summed wall time of every training invocation of the recorded runs."""
    seconds, n = train_seconds(records)
    return f"{seconds:.0f} s summed over {n} process runs (one core each, run side by side)"


def reads_positions(pe: str) -> bool:
    """Whether the PE's output depends on the positions tensor (its declared capabilities): NoPE (no
    hooks) and content-position PEs (CoPE, forgetting ALiBi) are unchanged by randomized positions,
    so their randomized runs would repeat the plain ones."""
    caps = posformer.pe.registry.get_encoding_class(pe).capabilities
    return bool(caps.hooks) and not caps.content_positions


def ood_means(
    rows: list[dict[str, Any]], series: list[str], hi: int
) -> dict[tuple[str, str], dict[str, Any]]:
    """(metric, series) -> mean ± std over seeds of each run's mean over the lengths > ``hi``."""
    out = {}
    for metric in ("exact_match", "token_acc"):
        for sr in series:
            per_run: dict[str, list[float]] = defaultdict(list)
            for r in rows:
                if r["series"] == sr and r["length"] > hi and r["status"] == "ok":
                    per_run[r["run"]].append(r[metric])
            m, s = mean_std([statistics.fmean(v) for v in per_run.values()])
            out[(metric, sr)] = {"mean": m, "std": s, "n": len(per_run), "na": 0}
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
            out[pe] = {
                m: 100 * (ood[(m, rnd)]["mean"] - ood[(m, pe)]["mean"]) for m in ("token_acc", "exact_match")
            }
    return out


def gain_table(
    ood: dict[tuple[str, str], dict[str, Any]],
    pes: list[str],
    id_acc: dict[str, float],
    threshold: float,
    steps: dict[str, tuple[float, float]],
) -> list[str]:
    """Mean OOD accuracy plain vs randomized per PE, the difference, and its mean over PEs (Ruoss et al.
    2023 report the mean over tasks of the token accuracy averaged over the OOD lengths)."""
    lines = [
        "## Out-of-distribution means and the randomized-positions gain",
        "",
        "Mean over the OOD lengths of each run, then mean ± std over seeds; gain = randomized − plain "
        "(percentage points). Steps: mean steps trained. `–`: PEs that do not read the positions tensor "
        "(no hooks, or content positions) are not trained with randomized positions, which would "
        "repeat the plain runs; they are left out of the mean gain.",
        "",
        "| PE | ID EM plain / rand | steps plain / rand | OOD token acc plain | rand | gain | "
        "OOD exact match plain | rand | gain |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    per_pe = randomization_gains(ood, pes)
    gains: dict[str, list[float]] = defaultdict(list)
    both_ok: dict[str, list[float]] = defaultdict(list)
    for pe in pes:
        rnd = f"{pe} + randomized"
        if ("token_acc", pe) in ood and ("token_acc", rnd) not in ood and not reads_positions(pe):
            lines.append(
                f"| {pe} | {id_acc[pe]:.2f} / – | {steps[pe][0]:.0f} / – | "
                f"{fmt_cell(ood[('token_acc', pe)])} | – | – | {fmt_cell(ood[('exact_match', pe)])} "
                "| – | – |"
            )
            continue  # not trained: the PE ignores the positions tensor, randomized = plain
        if pe not in per_pe:
            continue
        cells = []
        for metric in ("token_acc", "exact_match"):
            a, b = ood[(metric, pe)], ood[(metric, rnd)]
            g = per_pe[pe][metric]
            gains[metric].append(g)
            if id_acc[pe] >= threshold and id_acc[rnd] >= threshold:
                both_ok[metric].append(g)
            cells += [fmt_cell(a), fmt_cell(b), f"{g:+.1f}"]
        ids = f"{id_acc[pe]:.2f} / {id_acc[rnd]:.2f}"
        st = f"{steps[pe][0]:.0f} / {steps[rnd][0]:.0f}"
        lines.append(f"| {pe} | {ids} | {st} | " + " | ".join(cells) + " |")
    for label, g in (("every PE", gains), (f"PEs with both ID EM ≥ {threshold}", both_ok)):
        if g:
            n = len(g["token_acc"])
            lines.append(
                f"| **mean gain, {label}** (n={n}) | | | | | {statistics.fmean(g['token_acc']):+.1f} | | | "
                f"{statistics.fmean(g['exact_match']):+.1f} |"
            )
    return [*lines, ""]


if __name__ == "__main__":
    main()
