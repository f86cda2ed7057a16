#!/usr/bin/env python
"""Study 3: Multi30k de->en with several PEs and seeds at an equal number of updates (BLEU mean ± std).

Every (PE, seed) trains ``experiment=multi30k_de_en`` (the 2017 recipe at CPU scale: post-LN 3+3
layers, d_model 256, label smoothing 0.1, Adam + inverse-sqrt; its schedule does not depend on the
run's length, so ``--steps N`` is the first N updates of the full recipe) for exactly ``--steps``
updates, one run per core (the resumable queue of :mod:`study_jobs`). Each run is then translated
with the mean of its last ``--average`` periodic checkpoints (``--ckpt-every`` steps apart, the last
at ``--steps``),
beam 4, alpha 0.6, max length source + 50, on test_2016_flickr: sacreBLEU corpus BLEU and chrF.

    python scripts/study_multi30k.py --pes sinusoidal learned rope --seeds 0 1 2 --steps 2500 --cores 0,1

Outputs in ``--out``: ``train/<i>_<pe>_s<seed>/`` (runs; ``translate_<steps>/scores.json`` inside),
``summary.{md,csv,json}``, ``summary_bleu.png``/``.svg``. Every translated run is recorded in
``--ledger`` (:mod:`study_ledger`; ``docs/studies/multi30k`` for ``docs/leaderboard.md``) and the
summary is built from the records, so re-running the command, here or from a fresh clone with the
records, skips what is done.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_jobs import ROOT, VENV_BIN, Job, parse_cores, run, run_jobs  # noqa: E402
from study_ledger import check_setup, invocations, read_records, recorded, train_seconds, write_record  # noqa: E402
from study_lm_extrapolation import QUIET, mean_std  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"


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


def plot(rows: list[dict[str, Any]], pes: list[str], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posformer.eval.plots import pe_color, write_figure

    colors = {pe: pe_color(pe) for pe in pes}
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, pe in enumerate(pes):
        ys = [r["bleu"] for r in rows if r["pe"] == pe]
        ax.scatter([i] * len(ys), ys, color=colors[pe], alpha=0.6, zorder=3)
        m, s = mean_std(ys)
        ax.errorbar([i + 0.15], [m], yerr=[s], fmt="D", color=colors[pe], capsize=4, zorder=4)
    ax.set_xticks(range(len(pes)), pes)
    ax.set_ylabel("test BLEU (sacreBLEU)")
    ax.set_title(f"Multi30k de→en, {steps} updates: seeds (dots), mean ± std (diamond)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    write_figure(fig, path, dpi=120)  # PNG + a byte-reproducible SVG
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pes", nargs="+", default=["sinusoidal", "learned", "rope"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=2500, help="updates per run (a multiple of 250)")
    ap.add_argument("--average", type=int, default=5, help="periodic checkpoints averaged (paper: 5)")
    ap.add_argument("--ckpt-every", type=int, default=250, help="steps between the periodic checkpoints")
    ap.add_argument("--data", type=Path, default=DATA, help="folder with train.de[.gz], ... (Multi30k)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "studies" / "multi30k")
    ap.add_argument("--cores", default="0", help="cores to run jobs on, one job per core (e.g. 0,1)")
    ap.add_argument("--extra", nargs="*", default=[], help="more posformer-train overrides for every run")
    ap.add_argument("--ledger", type=Path, default=None,
                    help="folder of the per-run records (default: <out>/records)")  # fmt: skip
    ap.add_argument("--launch-for", type=float, default=None, metavar="MIN",
                    help="start no training run after this many minutes; the finished runs are then "
                    "translated, recorded and summarised")  # fmt: skip
    args = ap.parse_args()
    every = args.ckpt_every
    if args.steps % every or args.steps < every * args.average:
        raise SystemExit(
            f"--steps {args.steps}: must be a multiple of --ckpt-every {every} and at least "
            f"--ckpt-every x --average = {every * args.average}"
        )
    if not any((args.data / f"train.de{ext}").is_file() for ext in ("", ".gz")):
        raise SystemExit(f"--data {args.data}: no train.de[.gz] there; pass the folder holding Multi30k")
    cores = parse_cores(args.cores)
    out = args.out.resolve()
    # seed-major: a study cut short by a session has every PE at its first seeds, not one PE at all of them
    grid = [(pe, s) for s in args.seeds for pe in args.pes]
    jobs = [Job(f"{i}_{pe}_s{s}", [f"pe={pe}", f"seed={s}"]) for i, (pe, s) in enumerate(grid)]
    common = [
        "experiment=multi30k_de_en",
        f"data.path={args.data}",
        f"trainer.max_steps={args.steps}",
        f"callbacks.periodic_checkpoint.every_n_train_steps={every}",
        f"paths.log_dir={out}",
        *QUIET,
        *args.extra,
    ]
    ledger = (args.ledger or out / "records").resolve()
    setup = [o for o in common if not o.startswith(("data.path=", "paths."))]  # not machine paths
    check_setup(read_records(ledger), setup, ledger, key="setup")
    deadline = time.time() + 60 * args.launch_for if args.launch_for is not None else None
    train_s = run_jobs(jobs, out / "train", common, cores=cores, recorded=recorded(ledger),
                       launch_until=deadline)  # fmt: skip
    t0 = time.perf_counter()
    have = recorded(ledger)
    for job, (pe, seed) in zip(jobs, grid, strict=True):
        run_dir = out / "train" / job.name
        if job.name in have or not (run_dir / "results.json").is_file():
            continue
        sc = translate(run_dir, args.steps, args.average)
        res = json.loads((run_dir / "results.json").read_text())
        write_record(ledger, job.name, {
            "pe": pe,
            "seed": seed,
            "steps": res["global_step"],
            "bleu": sc["bleu"],
            "chrf": sc["chrf"],
            "train_time_s": res.get("train_time_s"),
            "invocations": invocations(out / "train", job.name),
            "setup": setup,
        })  # fmt: skip
    eval_s = time.perf_counter() - t0
    records = read_records(ledger)
    rows = [
        {k: records[j.name][k] for k in ("pe", "seed", "steps", "bleu", "chrf", "train_time_s")}
        for j in jobs
        if j.name in records
    ]
    if not rows:
        raise SystemExit(f"no finished runs yet: no records in {ledger}")
    write_summary(out, rows, args, train_s, eval_s, records)


def write_summary(
    out: Path,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    train_s: float,
    eval_s: float,
    records: dict[str, dict[str, Any]],
) -> None:
    cmd = " ".join(["python scripts/study_multi30k.py", *sys.argv[1:]])
    lines = [
        f"# Multi30k de→en at {args.steps} updates, {len(args.seeds)} seeds",
        "",
        f"Command: `{cmd}`  ",
        f"Weights: mean of the last {args.average} checkpoints (every {args.ckpt_every} steps, the last "
        f"at step {args.steps}); beam 4, α 0.6, max length source + 50; test_2016_flickr (1000 sentences).  ",
        f"Runs: {len(rows)} of {len(args.pes) * len(args.seeds)} recorded.  ",
        "Wall time: training {:.0f} s summed over {} process runs (this call: {:.0f} s), translation of this "
        "call's new runs {:.0f} s.".format(*train_seconds(records), train_s, eval_s),
        "",
        "| PE | BLEU mean ± std | chrF mean ± std | BLEU per seed |",
        "|---|---:|---:|---|",
    ]
    summary = {}
    for pe in args.pes:
        rs = [r for r in rows if r["pe"] == pe]
        if not rs:
            continue
        b, bs = mean_std([r["bleu"] for r in rs])
        c, cs = mean_std([r["chrf"] for r in rs])
        summary[pe] = {"bleu_mean": b, "bleu_std": bs, "chrf_mean": c, "chrf_std": cs, "n": len(rs)}
        per_seed = ", ".join(f"s{r['seed']} {r['bleu']:.2f}" for r in rs)
        lines.append(f"| {pe} | {b:.2f} ± {bs:.2f} | {c:.2f} ± {cs:.2f} | {per_seed} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, [pe for pe in args.pes if pe in summary], out / "summary_bleu.png", args.steps)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
