"""Study 1: language-model length extrapolation of every PE on char-level tinyshakespeare.

Every PE is trained (one ``posformer-train`` run per PE and seed, >= 3 seeds, the resumable queue,
seed-major: every PE's first seed before any second) at one length L. Each run, as soon as it has
trained, is evaluated with ``posformer-eval`` on the core that trained it, at 1x-16x L in
non-overlapping and sliding-window mode plus many 16L windows for the loss per position, and recorded
in ``--ledger`` (:mod:`posformer.studies.ledger`; ``docs/studies/lm_small`` for the leaderboard): its
rows and its loss per position. The summary (mean ± std over the recorded seeds, a table and a plot per
mode) is built from the records, so a study continues across machines and ``--launch-for 0`` rebuilds
it from a fresh clone. With ``--memory`` (default on) it also measures the peak memory of one forward
pass at 16 384 tokens for every PE with a small (untrained) model.

    posformer-study lm --size tiny                                  # CPU, minutes
    posformer-study lm --size small --seeds 0 1 2 --out outputs/studies/lm_small \
        --ledger docs/studies/lm_small --cores 0,1 --launch-for 100 # no run starts after 100 min
    posformer-study lm --size small --ledger docs/studies/lm_small --launch-for 0   # from the records
    python scripts/study_lm_extrapolation.py --size tiny            # the same as the first

Outputs in ``--out``: ``train/`` (the sweep), ``eval/<run>/`` and ``eval_positions/<run>/``
(extrapolation.* of posformer-eval), ``records/`` (the default ledger), ``summary.md``, ``summary.csv``,
``summary_<mode>.png``, ``memory.md``, ``memory.json``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from posformer import metrics
from posformer.studies.aggregate import Key, record_cells, table
from posformer.studies.commands import eval_sweep
from posformer.studies.common import StudyError, all_pes, project_root, shared_data
from posformer.studies.context_use import window_curves
from posformer.studies.figures import plot_series
from posformer.studies.jobs import Job, job_state, parse_cores, sweep_jobs, train_sweep
from posformer.studies.ledger import (
    check_setup,
    invocations,
    read_records,
    recorded,
    records_wall,
    run_index,
    write_record,
)
from posformer.studies.memory import write_memory

__all__ = ["ALL_PES", "MULTIPLES", "SIZES", "add_arguments", "model_overrides", "run_study"]

ALL_PES = all_pes()
#: d_model, layers, heads, d_ff, training length, steps, batch, scored tokens per evaluation length,
#: windows of the loss-per-position evaluation
_MODEL_FIELDS = ("d_model", "n_layers", "n_heads", "d_ff")
_RUN_FIELDS = ("train_len", "steps", "batch", "n_tokens", "position_windows")
SIZES: dict[str, dict[str, Any]] = {
    name: dict(zip(_MODEL_FIELDS + _RUN_FIELDS, values, strict=True))
    for name, *values in (
        ("tiny", 64, 2, 4, 256, 64, 300, 32, 8192, 32),
        ("small", 128, 4, 4, 512, 128, 1500, 32, 16384, 48),
        ("medium", 256, 6, 8, 1024, 256, 5000, 32, 32768, 24),
    )
}
#: evaluation lengths, in multiples of the training length
MULTIPLES = [1, 2, 4, 8, 16]
#: what a record keeps of every evaluation row
ROW_FIELDS = (
    "mode",
    "length",
    "status",
    *metrics.names(kinds=("lm",)),
    "scored_tokens",
    "n_sequences",
    "in_distribution",
)


def default_text() -> Path:
    """tinyshakespeare next to the project root (``../shared/data/tinyshakespeare/input.txt``)."""
    return shared_data(project_root(), "tinyshakespeare", "input.txt")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the LM study."""
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pes", nargs="+", default=ALL_PES)
    ap.add_argument("--steps", type=int, default=None, help="override the size's training steps")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/studies/lm_extrapolation_<size>")
    ap.add_argument(
        "--text",
        type=Path,
        default=None,
        help="tinyshakespeare's input.txt (default ../shared/data/tinyshakespeare/input.txt)",
    )
    ap.add_argument(
        "--extra", nargs="*", default=[], help="more posformer-train overrides for every run (an ablation)"
    )
    ap.add_argument(
        "--skip-train",
        action="store_true",
        help="no training or evaluation: the summary from the records (= --launch-for 0)",
    )
    ap.add_argument(
        "--ledger",
        type=Path,
        default=None,
        help="per-run records (default <out>/records; docs/studies/lm_small for the leaderboard)",
    )
    ap.add_argument(
        "--launch-for",
        type=float,
        default=None,
        metavar="MIN",
        help="start no training run after this many minutes (0: only the summary from the records)",
    )
    ap.add_argument(
        "--cores", default="0", help="cores to run jobs on, one job per core (e.g. 0,1); none = unpinned"
    )
    ap.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure peak memory at 16384 tokens for every PE",
    )
    ap.add_argument("--memory-only", action="store_true", help="only the 16384-token peak-memory measurement")


def model_overrides(size: dict[str, Any]) -> list[str]:
    """The ``posformer-train`` overrides of a size's decoder (no dropout)."""
    return [
        "model=decoder_tiny",
        f"model.d_model={size['d_model']}",
        f"model.n_layers={size['n_layers']}",
        f"model.n_heads={size['n_heads']}",
        f"model.d_ff={size['d_ff']}",
        "model.dropout=0.0",
    ]


def lm_overrides(size: dict[str, Any], text: Path) -> list[str]:
    """The overrides of a char-LM trained at the size's length: data, steps, schedule, learning rate."""
    L = size["train_len"]
    return [
        *model_overrides(size),
        "data=text",
        f"data.path={text}",
        f"data.block_size={L}",
        f"data.batch_size={size['batch']}",
        f"trainer.max_steps={size['steps']}",
        f"trainer.val_check_interval={max(size['steps'] // 2, 1)}",
        "trainer.limit_val_batches=20",
        f"schedule.warmup_steps={max(size['steps'] // 10, 1)}",
        "optim.lr=2e-3",
    ]


def run_study(args: argparse.Namespace) -> None:
    """The study (see the module docstring); ``args.command`` is the command line shown in the summary."""
    if args.memory_only:
        out = (args.out or project_root() / "outputs" / "studies" / "memory_16k").resolve()
        lines = write_memory(out, args.pes)
        (out / "memory.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    out = (args.out or project_root() / "outputs" / "studies" / f"lm_extrapolation_{args.size}").resolve()
    ledger = (args.ledger or out / "records").resolve()
    launch_for = 0 if args.skip_train else args.launch_for
    text = args.text or default_text()
    if launch_for != 0 and not text.is_file():
        raise StudyError(f"tinyshakespeare not found at {text}; pass --text path/to/input.txt")
    setup = study_setup(size, text, args.extra) if launch_for != 0 else None
    if setup is not None:
        check_setup(read_records(ledger), setup, ledger, key="setup")
        out.mkdir(parents=True, exist_ok=True)
        todo = jobs(args.pes, args.seeds)
        deadline = time.time() + 60 * launch_for if launch_for is not None else None
        record = functools.partial(record_run, out, ledger, setup, size)
        for job in todo:  # trained earlier but not recorded (stopped while evaluating)
            if job.name not in recorded(ledger) and job_state(out / "train" / job.name) == "done":
                record(job, parse_cores(args.cores)[0])
        train_sweep(
            out,
            [*lm_overrides(size, text), *args.extra],
            grid(args.pes, args.seeds),
            cores=parse_cores(args.cores),
            recorded=recorded(ledger),
            launch_until=deadline,
            on_done=record,
        )
    records = read_records(ledger)
    if not records:
        raise StudyError(f"no finished runs yet: no records in {ledger}; run without --launch-for 0")
    out.mkdir(parents=True, exist_ok=True)
    lines = summarise(out, records, args, size)
    if args.memory and launch_for != 0:
        lines += write_memory(out, args.pes)
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


def grid(pes: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """One run per (seed, PE), seed-major: every PE's first seed trains before any PE's second, so a
    study stopped part-way has a complete table of fewer seeds."""
    return [{"pe": pe, "seed": s} for s in seeds for pe in pes]


def jobs(pes: list[str], seeds: list[int]) -> list[Job]:
    """The runs of :func:`grid`, named ``<i>_<pe>_s<seed>`` (:func:`~posformer.studies.jobs.sweep_jobs`)."""
    return sweep_jobs(grid(pes, seeds))


def study_setup(size: dict[str, Any], text: Path, extra: list[str]) -> list[str]:
    """What every record of one ledger must share: the training overrides (the text by its content's
    SHA-256, not its path) and the evaluation's."""
    digest = hashlib.sha256(text.read_bytes()).hexdigest()[:16]
    train = [o for o in lm_overrides(size, text) if not o.startswith("data.path=")]
    return [*train, f"text_sha256={digest}", *extra, *eval_overrides(size)[0], *eval_overrides(size)[1]]


def eval_overrides(size: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``posformer-eval`` overrides of the main evaluation (every multiple of L, non-overlapping and
    sliding windows) and of the loss-per-position windows (many 16L windows: the main evaluation's
    are too few for the first positions)."""
    lengths = [m * size["train_len"] for m in MULTIPLES]
    batch = f"eval.batch_tokens={max(8192, lengths[-1])}"
    main = [
        f"eval.lengths=[{','.join(map(str, lengths))}]",
        f"eval.n_tokens={size['n_tokens']}",
        "eval.stride=0.5",
        batch,
    ]
    positions = [
        f"eval.lengths=[{lengths[-1]}]",
        "eval.modes=[nonoverlap]",
        f"eval.n_tokens={size['position_windows'] * lengths[-1]}",
        batch,
    ]
    return main, positions


def record_run(
    out: Path, ledger: Path, setup: list[str], size: dict[str, Any], job: Job, core: int | None
) -> None:
    """Evaluate the finished run ``job`` (both evaluations, pinned to ``core``) and write its record:
    its settings, steps, invocations, evaluation rows and its loss per position (pooled over every
    non-overlapping 16L window of both evaluations, :func:`window_curves`; 4 decimals)."""
    run_dir = out / "train" / job.name
    main, positions = eval_overrides(size)
    outs = {"eval": main, "eval_positions": positions}
    rows: dict[str, list[dict[str, Any]]] = {}
    for folder, overrides in outs.items():
        dest = out / folder / job.name
        eval_sweep(run_dir, dest, overrides, log_name=f"{job.name}.log", core=core)
        rows[folder] = json.loads((dest / "extrapolation.json").read_text())["results"]
    res = json.loads((run_dir / "results.json").read_text())
    pe = rows["eval"][0]["pe"]
    curve = window_curves(rows["eval"] + rows["eval_positions"], pe)
    write_record(
        ledger,
        job.name,
        {
            "pe": pe,
            "seed": int(next(o for o in job.overrides if o.startswith("seed=")).split("=", 1)[1]),
            "steps": res["global_step"],
            "train_len": size["train_len"],
            "train_time_s": res.get("train_time_s"),
            "invocations": invocations(out / "train", job.name),
            "setup": setup,
            "rows": sorted(
                ({k: r.get(k) for k in ROW_FIELDS} for r in rows["eval"]),
                key=lambda r: (r["mode"], r["length"]),
            ),
            "position_loss": [round(v, 4) for v in curve[0]] if curve else [],
        },
    )
    print(f"  recorded: {job.name} in {ledger}", flush=True)


def record_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record's loss per position as one evaluation-like row (``pe``, ``mode``, ``position_loss``,
    ``n_sequences`` 1, ``checkpoint`` the run), in run order (seed 0 first), the input of
    :func:`~posformer.studies.context_use.lm_context_use` and ``position_lines``."""
    return [
        {
            "pe": rec["pe"],
            "mode": "nonoverlap",
            "position_loss": rec["position_loss"],
            "n_sequences": 1,
            "checkpoint": name,
        }
        for name, rec in sorted(records.items(), key=lambda kv: run_index(kv[0]))
        if rec.get("position_loss")
    ]


def summarise(
    out: Path, records: dict[str, dict[str, Any]], args: argparse.Namespace, size: dict[str, Any]
) -> list[str]:
    """The summary's lines (header, one perplexity table per mode), its plots and ``summary.csv``."""
    L = size["train_len"]
    lengths = [m * L for m in MULTIPLES]
    series = [pe for pe in args.pes if any(r["pe"] == pe for r in records.values())]
    agg_ppl, agg_loss = record_cells(records, "pe", "ppl"), record_cells(records, "pe", "loss")
    scored = sorted({r["scored_tokens"] for rec in records.values() for r in rec["rows"]} - {None})
    seeds = sorted({rec["seed"] for rec in records.values()})
    lines = [
        f"# LM extrapolation study ({args.size}): {len(records)} of {len(args.pes) * len(args.seeds)} runs "
        "recorded",
        "",
        f"Command: `{args.command}`  ",
        f"Model: decoder-only, d_model={size['d_model']}, layers={size['n_layers']}, "
        f"heads={size['n_heads']}, "
        f"d_ff={size['d_ff']}; char-level tinyshakespeare, trained at L={L} for {size['steps']} steps "
        f"(batch {size['batch']}); seeds recorded: {seeds}.  ",
        f"Evaluation: validation split (last 10%), {', '.join(map(str, scored))} scored tokens at every "
        "length; "
        "sliding: stride = half the window, each window scores its second half (every scored token "
        "has at least half a window of context). Cells: perplexity mean ± std over seeds; `*` = training "
        "length.  ",
        f"Training: {records_wall(records)}. Records: {args.ledger or out / 'records'}.",
        "",
    ]
    for mode in ("nonoverlap", "sliding"):
        lines += [f"## {mode}", ""] + table(agg_ppl, series, mode, lengths, L) + [""]
        plot_series(
            agg_ppl,
            series,
            mode,
            lengths,
            L,
            out / f"summary_{mode}.png",
            "perplexity",
            title=f"char-LM perplexity, {mode} (train L={L})",
        )
    write_csv(out / "summary.csv", agg_ppl, agg_loss)
    return lines


def write_csv(path: Path, agg_ppl: dict[Key, dict[str, Any]], agg_loss: dict[Key, dict[str, Any]]) -> None:
    """``summary.csv``: perplexity and loss mean ± std per PE, mode and length."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["pe", "mode", "length", "ppl_mean", "ppl_std", "loss_mean", "loss_std", "n_seeds", "n_na"]
        )
        for (s, mode, Ln), a in sorted(agg_ppl.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            b = agg_loss[(s, mode, Ln)]
            w.writerow([s, mode, Ln, a["mean"], a["std"], b["mean"], b["std"], a["n"], a["na"]])
