"""Study 3: Multi30k de->en with several PEs and seeds at an equal number of updates (BLEU mean ± std).

Every (PE, seed) trains ``experiment=multi30k_de_en`` (the 2017 recipe at CPU scale: post-LN 3+3
layers, d_model 256, label smoothing 0.1, Adam + inverse-sqrt; its schedule does not depend on the
run's length, so ``--steps N`` is the first N updates of the full recipe) for exactly ``--steps``
updates, one run per core (the resumable queue of :mod:`posformer.studies.jobs`). Each run is then
translated with the mean of its last ``--average`` periodic checkpoints (``--ckpt-every`` steps apart,
the last at ``--steps``), beam 4, alpha 0.6, max length source + 50, on test_2016_flickr: sacreBLEU
corpus BLEU and chrF.

    posformer-study multi30k --pes sinusoidal learned rope --seeds 0 1 2 --steps 2500 --cores 0,1
    python scripts/study_multi30k.py ...                         # the same

Outputs in ``--out``: ``train/<i>_<pe>_s<seed>/`` (runs; ``translate_<steps>/scores.json`` inside),
``summary.{md,csv,json}``, ``summary_bleu.png``/``.svg``. Every translated run is recorded in
``--ledger`` (:mod:`posformer.studies.ledger`; ``docs/studies/multi30k`` for ``docs/leaderboard.md``)
and the summary is built from the records, so re-running the command, here or from a fresh clone with
the records, skips what is done (``--launch-for 0``: only the summary, no data needed).
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
from posformer.studies.commands import run
from posformer.studies.common import QUIET, VENV_BIN, StudyError, project_root, shared_data
from posformer.studies.figures import plot_bleu
from posformer.studies.jobs import Job, job_state, parse_cores, run_jobs
from posformer.studies.ledger import (
    check_setup,
    invocations,
    read_records,
    recorded,
    run_index,
    train_seconds,
    write_record,
)
from posformer.utils.format import markdown_table

__all__ = ["add_arguments", "records_summary", "run_study", "summarise", "translate"]

#: what the summary keeps of each record
FIELDS = ("pe", "seed", "steps", "bleu", "chrf", "train_time_s")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the Multi30k study."""
    ap.add_argument("--pes", nargs="+", default=["sinusoidal", "learned", "rope"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=2500, help="updates per run (a multiple of 250)")
    ap.add_argument("--average", type=int, default=5, help="periodic checkpoints averaged (paper: 5)")
    ap.add_argument("--ckpt-every", type=int, default=250, help="steps between the periodic checkpoints")
    ap.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder with train.de[.gz], ... (Multi30k; default ../shared/data/multi30k)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default outputs/studies/multi30k")
    ap.add_argument("--cores", default="0", help="cores to run jobs on, one job per core (e.g. 0,1)")
    ap.add_argument("--extra", nargs="*", default=[], help="more posformer-train overrides for every run")
    ap.add_argument(
        "--ledger", type=Path, default=None, help="folder of the per-run records (default: <out>/records)"
    )
    ap.add_argument(
        "--launch-for",
        type=float,
        default=None,
        metavar="MIN",
        help="start no training run after this many minutes; the finished runs are then "
        "translated, recorded and summarised",
    )


def translate(run_dir: Path, steps: int, average: int) -> dict[str, Any]:
    """Beam-search test BLEU of ``run_dir`` at ``steps`` (cached in ``translate_<steps>/scores.json``)."""
    out = run_dir / f"translate_{steps}"
    scores = out / "scores.json"
    if not scores.is_file():
        run(
            [
                str(VENV_BIN / "posformer-eval"),
                "eval=translate",
                f"eval.run_dir={run_dir}",
                f"eval.average_last={average}",
                f"eval.up_to_step={steps}",
                "eval.beam_size=4",
                "eval.alpha=0.6",
                "eval.progress=false",
                f"eval.output_dir={out}",
                f"hydra.run.dir={out}",
            ],
            out.parent / f"translate_{steps}.log",
        )
    return json.loads(scores.read_text())


def _check(args: argparse.Namespace, data: Path, needs_data: bool) -> None:
    """Refuse a checkpoint spacing that does not end at ``--steps``, and missing data when a run trains."""
    every = args.ckpt_every
    if args.steps % every or args.steps < every * args.average:
        raise StudyError(
            f"--steps {args.steps}: must be a multiple of --ckpt-every {every} and at least "
            f"--ckpt-every x --average = {every * args.average}"
        )
    if needs_data and not any((data / f"train.de{ext}").is_file() for ext in ("", ".gz")):
        raise StudyError(f"--data {data}: no train.de[.gz] there; pass the folder holding Multi30k")


def run_study(args: argparse.Namespace) -> None:
    """The study (see the module docstring); ``args.command`` is the command line shown in the summary."""
    data = args.data or shared_data(project_root(), "multi30k")
    out = (args.out or project_root() / "outputs" / "studies" / "multi30k").resolve()
    ledger = (args.ledger or out / "records").resolve()
    # seed-major: a study cut short has every PE at its first seeds, not one PE at all of them
    grid = [(pe, s) for s in args.seeds for pe in args.pes]
    jobs = [Job(f"{i}_{pe}_s{s}", [f"pe={pe}", f"seed={s}"]) for i, (pe, s) in enumerate(grid)]
    have = recorded(ledger)
    to_train = [j for j in jobs if j.name not in have and job_state(out / "train" / j.name) != "done"]
    _check(args, data, needs_data=bool(to_train) and args.launch_for != 0)
    cores = parse_cores(args.cores)
    common = [
        "experiment=multi30k_de_en",
        f"data.path={data}",
        f"trainer.max_steps={args.steps}",
        f"callbacks.periodic_checkpoint.every_n_train_steps={args.ckpt_every}",
        f"paths.log_dir={out}",
        *QUIET,
        *args.extra,
    ]
    setup = [o for o in common if not o.startswith(("data.path=", "paths."))]  # not machine paths
    check_setup(read_records(ledger), setup, ledger, key="setup")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.launch_for if args.launch_for is not None else None
    train_s = run_jobs(
        jobs, out / "train", common, cores=cores, recorded=recorded(ledger), launch_until=deadline
    )
    t0 = time.perf_counter()
    record_new_runs(out / "train", ledger, jobs, grid, args, setup)
    eval_s = time.perf_counter() - t0
    records = read_records(ledger)
    rows = [{k: records[j.name][k] for k in FIELDS} for j in jobs if j.name in records]
    if not rows:
        raise StudyError(f"no finished runs yet: no records in {ledger}")
    write_summary(out, rows, args, train_s, eval_s, records)


def record_new_runs(
    sweep: Path,
    ledger: Path,
    jobs: list[Job],
    grid: list[tuple[str, int]],
    args: argparse.Namespace,
    setup: list[str],
) -> None:
    """Translate and record every finished run of ``jobs`` that ``ledger`` has no record of."""
    have = recorded(ledger)
    for job, (pe, seed) in zip(jobs, grid, strict=True):
        run_dir = sweep / job.name
        if job.name in have or not (run_dir / "results.json").is_file():
            continue
        sc = translate(run_dir, args.steps, args.average)
        res = json.loads((run_dir / "results.json").read_text())
        write_record(
            ledger,
            job.name,
            {
                "pe": pe,
                "seed": seed,
                "steps": res["global_step"],
                "bleu": sc["bleu"],
                "chrf": sc["chrf"],
                "train_time_s": res.get("train_time_s"),
                "invocations": invocations(sweep, job.name),
                "setup": setup,
            },
        )


def summarise(rows: list[dict[str, Any]], pes: list[str]) -> dict[str, dict[str, Any]]:
    """PE -> BLEU and chrF mean ± std over its runs and their number, for the PEs of ``pes`` with runs."""
    if not rows:
        return {}
    agg = metrics.aggregate(rows, ["pe"], ["bleu", "chrf"], n=("pe", "size"))
    by_pe = {r["pe"]: r for r in metrics.records(agg)}
    keys = ("bleu_mean", "bleu_std", "chrf_mean", "chrf_std", "n")
    return {pe: {k: by_pe[pe][k] for k in keys} for pe in pes if pe in by_pe}


def spreads(entry: dict[str, Any]) -> dict[str, str]:
    """BLEU and chrF of a :func:`summarise` entry as ``mean ± std`` cells (the mean alone for one seed)."""
    return {
        m: fmt_cell({"mean": entry[f"{m}_mean"], "std": entry[f"{m}_std"], "n": entry["n"]})
        for m in ("bleu", "chrf")
    }


def records_summary(records: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """The rows of ``records`` in the study's grid order, the :func:`summarise` of every PE they hold
    (in order of first appearance) and their steps: what a ledger alone gives the leaderboard."""
    names = sorted(records, key=run_index)
    rows = [{k: records[n][k] for k in FIELDS} for n in names]
    pes = list(dict.fromkeys(r["pe"] for r in rows))
    steps = max((int(r["steps"]) for r in rows), default=0)
    return rows, summarise(rows, pes), steps


def write_summary(
    out: Path,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    train_s: float,
    eval_s: float,
    records: dict[str, dict[str, Any]],
) -> None:
    """``summary.md`` (the table), ``summary.json``, ``summary.csv`` and the BLEU figure of ``rows``."""
    lines = [
        f"# Multi30k de→en at {args.steps} updates, {len(args.seeds)} seeds",
        "",
        f"Command: `{args.command}`  ",
        f"Weights: mean of the last {args.average} checkpoints (every {args.ckpt_every} steps, the last "
        f"at step {args.steps}); beam 4, α 0.6, max length source + 50; test_2016_flickr (1000 sentences).  ",
        f"Runs: {len(rows)} of {len(args.pes) * len(args.seeds)} recorded.  ",
        "Wall time: training {:.0f} s summed over {} process runs (this call: {:.0f} s), translation of this "
        "call's new runs {:.0f} s.".format(*train_seconds(records), train_s, eval_s),
        "",
    ]
    summary = summarise(rows, args.pes)
    table = []
    for pe, v in summary.items():
        per_seed = ", ".join(f"s{r['seed']} {r['bleu']:.2f}" for r in rows if r["pe"] == pe)
        table.append({"pe": pe, **spreads(v), "seeds": per_seed})
    columns = [("pe", "PE"), ("bleu", "BLEU mean ± std"), ("chrf", "chrF mean ± std")]
    columns.append(("seeds", "BLEU per seed"))
    lines += markdown_table(table, columns, align={"pe": "", "seeds": ""}).splitlines()
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot_bleu(rows, [pe for pe in args.pes if pe in summary], out / "summary_bleu.png", args.steps)
    print("\n".join(lines))
