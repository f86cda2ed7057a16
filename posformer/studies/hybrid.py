"""Study 5: hybrid per-layer PE stacks: pure RoPE, pure NoPE, ALiBi, iRoPE-, RNoPE-SWA- and
Gemma-3-style schedules as char LMs, perplexity at 1x-16x the training length (mean ± std over seeds).

Every stack is the same 4-layer decoder (``model=decoder_tiny``, d_model 64, 4 heads, ``model.n_layers=4``)
of the main job's setup (``experiment=extrapolation``: the generated corpus ``data=corpus``, L = 32,
600 steps, lr 3e-3); only the per-layer schedule differs (:func:`stack_overrides`). The attention spans are
scaled to the tiny L: windows and chunks of ``--span`` tokens (default L/2 = 16), the iRoPE
temperature's ``floor_scale`` = the chunk, as in Llama 4. One ``posformer-train`` run per (stack, seed)
on the resumable queue, then ``posformer-eval`` over the sweep at 1x-16x L (non-overlapping and
sliding windows, its default scored tokens = training's). Every evaluated run is recorded in
``--ledger`` (:mod:`posformer.studies.ledger`; ``docs/studies/hybrid_corpus32`` for
``docs/leaderboard.md``) and the table and figure are built from the records, so a fresh clone rebuilds
them (``--launch-for 0``: no training, no evaluation).

    posformer-study hybrid --seeds 0 1 2 --cores 0,1 --ledger docs/studies/hybrid_corpus32 \\
        --figure docs/figures/leaderboard_hybrid
    posformer-study hybrid --ledger docs/studies/hybrid_corpus32 --launch-for 0    # from the records

``--task passkey``: the same stacks trained on ``data=passkey`` (haystacks of 8..L filler tokens, L = 64,
800 steps, lr 3e-3, spans L/2 = 32), each run scored by ``posformer-needle`` (exact match per haystack
length 0.5x-8x L × needle depth, 32 keys per cell); the table is the exact match averaged over depths,
the figure one heat map per stack (mean over seeds); ledger ``docs/studies/hybrid_passkey64``.

    posformer-study hybrid --task passkey --seeds 0 1 2 --cores 0,1 --ledger docs/studies/hybrid_passkey64 \\
        --figure docs/figures/leaderboard_hybrid_needle

Outputs in ``--out`` (default ``outputs/studies/hybrid`` / ``hybrid_passkey``): ``train/<i>_<stack>_s<seed>/``
(a passkey run's ``needle/`` inside), ``eval/`` (LM), ``summary.md``; the figure ``--figure``
``.png``/``.svg`` (default ``<out>/summary``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from posformer import metrics
from posformer.studies.aggregate import Key, cells, fmt_cell, record_cells, table
from posformer.studies.commands import eval_sweep, run
from posformer.studies.common import QUIET, VENV_BIN, StudyError, project_root
from posformer.studies.jobs import Job, job_state, parse_cores, run_jobs
from posformer.studies.ledger import (
    check_setup,
    invocations,
    read_records,
    recorded,
    records_wall,
    run_index,
    write_record,
)
from posformer.utils.format import markdown_table

__all__ = [
    "MULTIPLES",
    "STACK_NAMES",
    "add_arguments",
    "eval_overrides",
    "jobs",
    "needle_args",
    "run_study",
    "stack_overrides",
    "summarise",
    "task_common",
]

#: evaluation lengths, in multiples of the training length
MULTIPLES = [1, 2, 4, 8, 16]
#: the stacks, in the table's order
STACK_NAMES = ["rope", "nope", "alibi", "irope", "rnope_swa", "gemma3"]
#: opt-in ablations (``--stacks``): ``gemma3_10k`` is ``gemma3`` with its global layer at RoPE base 10k
ABLATIONS = ["gemma3_10k"]
#: what every run of the study shares (the main job's char-LM setup at 4 layers)
BASE = ["experiment=extrapolation", "model.n_layers=4"]  # the experiment's model: decoder_tiny
#: the passkey runs' base: the default experiment's tiny decoder at 4 layers on data=passkey
PASSKEY_BASE = ["data=passkey", "model.n_layers=4", "optim.lr=3e-3"]
#: per task: default training length L (LM: tokens per window; passkey: the longest haystack) and steps
TASK_DEFAULTS = {"lm": (32, 600), "passkey": (64, 800)}
#: the needle grid's depths and keys per cell; its haystack lengths are NEEDLE_MULTIPLES x L
NEEDLE_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
NEEDLE_MULTIPLES = [0.5, 1, 2, 4, 8]
NEEDLE_KEYS = 32
#: what the ledger keeps of every evaluation row
ROW_FIELDS = ("mode", "length", "status", *metrics.names(kinds=("lm",)), "scored_tokens", "in_distribution")


def stack_overrides(stack: str, span: int) -> list[str]:
    """The ``posformer-train`` overrides of ``stack`` with windows / chunks of ``span`` tokens.

    - ``rope``, ``nope``, ``alibi``: the PE in every layer, full attention;
    - ``irope`` (Llama 4): 3 RoPE layers with chunked attention (chunk ``span``) : 1 NoPE layer with full
      attention and the Llama 4 query temperature (``floor_scale`` = the chunk, ``attn_scale`` 0.1);
    - ``rnope_swa`` (Cohere 2025): 3 RoPE layers with a causal sliding window of ``span`` : 1 NoPE full;
    - ``gemma3``: 3 local layers (RoPE base 10k, sliding window ``span``) : 1 global (RoPE base 1M, full)
      — Gemma 3 is 5:1; 3:1 is what fits 4 layers.
    - ``gemma3_10k`` (ablation): ``gemma3`` with the global layer at base 10k.
    """
    if stack in ("rope", "nope", "alibi"):
        return [f"pe={stack}"]

    def rope(kind: str) -> str:
        return f"{{pe:rope,pe_options:{{base:10000.0}},span:{{kind:{kind},window:{span}}}}}"

    temperature = f"{{kind:llama4,floor_scale:{float(span)},attn_scale:0.1}}"
    kinds = {
        "irope": {"local": rope("chunked"), "global": f"{{pe:nope,temperature:{temperature}}}"},
        "rnope_swa": {"local": rope("sliding"), "global": "{pe:nope}"},
        "gemma3": {"local": rope("sliding"), "global": "{pe:rope,pe_options:{base:1000000.0}}"},
        "gemma3_10k": {"local": rope("sliding"), "global": "{pe:rope,pe_options:{base:10000.0}}"},
    }
    if stack not in kinds:
        raise StudyError(f"--stacks: unknown stack {stack!r}; valid: {', '.join(STACK_NAMES + ABLATIONS)}")
    k = kinds[stack]
    return [
        "pe=nope",  # no embedding PE: every layer's PE is its kind's
        f"+model.layer_kinds={{local:{k['local']},global:{k['global']}}}",
        "+model.layers.pattern=[local,local,local,global]",
    ]


def jobs(stacks: list[str], seeds: list[int], span: int) -> tuple[list[Job], list[tuple[str, int]]]:
    """One job per (stack, seed), seed-major (a study cut short has every stack at its first seeds),
    named ``<i>_<stack>_s<seed>``; and the (stack, seed) of each."""
    grid = [(st, s) for s in seeds for st in stacks]
    out = [Job(f"{i}_{st}_s{s}", [*stack_overrides(st, span), f"seed={s}"]) for i, (st, s) in enumerate(grid)]
    return out, grid


def eval_overrides(train_len: int) -> list[str]:
    """``posformer-eval``'s overrides: 1x-16x ``train_len``, both window modes, the default scored tokens."""
    lengths = [m * train_len for m in MULTIPLES]
    return [
        f"eval.lengths=[{','.join(map(str, lengths))}]",
        "eval.modes=[nonoverlap,sliding]",
        "eval.stride=0.5",
        f"eval.batch_tokens={max(8192, lengths[-1])}",
    ]


def needle_args(train_len: int) -> list[str]:
    """``posformer-needle``'s grid options: haystacks of 0.5x-8x ``train_len`` filler tokens."""
    lengths = [str(int(m * train_len)) for m in NEEDLE_MULTIPLES]
    return ["--lengths", *lengths, "--depths", *map(str, NEEDLE_DEPTHS), "--n", str(NEEDLE_KEYS)]


def task_common(task: str, train_len: int, steps: int) -> list[str]:
    """The overrides every run of ``task`` shares (the LM's list is the committed records' setup)."""
    if task == "passkey":
        head = [*PASSKEY_BASE, f"data.train_len=[8,{train_len}]"]
    else:
        head = [*BASE, f"data.block_size={train_len}"]
    return [*head, f"trainer.max_steps={steps}", f"trainer.val_check_interval={max(steps // 2, 1)}"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the hybrid-stack study."""
    ap.add_argument(
        "--task",
        choices=list(TASK_DEFAULTS),
        default="lm",
        help="lm: char LM, perplexity 1x-16x L; passkey: the needle grid",
    )
    ap.add_argument("--stacks", nargs="+", default=STACK_NAMES, choices=STACK_NAMES + ABLATIONS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--train-len",
        type=int,
        default=None,
        help="training length L: LM window (default 32), longest passkey haystack (default 64)",
    )
    ap.add_argument(
        "--span",
        type=int,
        default=None,
        help="sliding window / chunk of the hybrid stacks' local layers (default L/2)",
    )
    ap.add_argument("--steps", type=int, default=None, help="default 600 (lm), 800 (passkey)")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/studies/hybrid[_passkey]")
    ap.add_argument("--ledger", type=Path, default=None, help="per-run records (default <out>/records)")
    ap.add_argument("--figure", type=Path, default=None, help="figure path without suffix")
    ap.add_argument("--cores", default="0", help="cores to run jobs on, one job per core (e.g. 0,1)")
    ap.add_argument("--extra", nargs="*", default=[], help="more posformer-train overrides for every run")
    ap.add_argument(
        "--launch-for",
        type=float,
        default=None,
        metavar="MIN",
        help="start no training run after this many minutes (0: only the table from the records)",
    )


def run_study(args: argparse.Namespace) -> None:
    """The study (see the module docstring); ``args.command`` is the command line shown in the summary."""
    default_len, default_steps = TASK_DEFAULTS[args.task]
    args.train_len = args.train_len or default_len
    steps = args.steps or default_steps
    span = args.span or args.train_len // 2
    if not 1 <= span <= args.train_len:
        raise StudyError(
            f"--span {span}: must be in 1..--train-len {args.train_len}; pass e.g. "
            f"--span {args.train_len // 2}"
        )
    folder = "hybrid" if args.task == "lm" else f"hybrid_{args.task}"
    out = (args.out or project_root() / "outputs" / "studies" / folder).resolve()
    ledger = (args.ledger or out / "records").resolve()
    todo, grid = jobs(args.stacks, args.seeds, span)
    common = [*task_common(args.task, args.train_len, steps), *args.extra]
    scoring = eval_overrides(args.train_len) if args.task == "lm" else needle_args(args.train_len)
    setup = [*common, f"span={span}", *scoring]
    check_setup(read_records(ledger), setup, ledger, key="setup")
    if args.launch_for != 0:
        out.mkdir(parents=True, exist_ok=True)
        deadline = time.time() + 60 * args.launch_for if args.launch_for is not None else None
        fixed = [f"paths.log_dir={out}", "evaluate=false", *QUIET, *common]
        run_jobs(
            todo,
            out / "train",
            fixed,
            cores=parse_cores(args.cores),
            recorded=recorded(ledger),
            launch_until=deadline,
        )
        record = record_new_runs if args.task == "lm" else record_needle_runs
        record(out, ledger, todo, grid, setup, args.train_len)
    records = read_records(ledger)
    if not records:
        raise StudyError(f"no finished runs yet: no records in {ledger}; run without --launch-for 0")
    stacks = [s for s in args.stacks if any(r["stack"] == s for r in records.values())]
    figure = args.figure or out / "summary"
    if args.task == "lm":
        lines = summary_lines(records, args)
        plot(summarise(records), stacks, args.train_len, figure)
    else:
        lines = needle_lines(records, stacks, args)
        plot_needle(records, stacks, args.train_len, figure)
    if out.is_dir():
        (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def record_new_runs(
    out: Path, ledger: Path, todo: list[Job], grid: list[tuple[str, int]], setup: list[str], train_len: int
) -> None:
    """Evaluate the sweep (skipped when up to date) and record every finished run without a record."""
    sweep = out / "train"
    have = recorded(ledger)
    new = [
        (j, g)
        for j, g in zip(todo, grid, strict=True)
        if j.name not in have and job_state(sweep / j.name) == "done"
    ]
    if not new:
        return
    eval_sweep(sweep, out / "eval", eval_overrides(train_len))
    rows = json.loads((out / "eval" / "extrapolation.json").read_text())["results"]
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_run[Path(r["checkpoint"]).parent.parent.name].append({k: r.get(k) for k in ROW_FIELDS})
    for job, (stack, seed) in new:
        res = json.loads((sweep / job.name / "results.json").read_text())
        write_record(
            ledger,
            job.name,
            {
                "stack": stack,
                "seed": seed,
                "steps": res["global_step"],
                "train_time_s": res.get("train_time_s"),
                "invocations": invocations(sweep, job.name),
                "setup": setup,
                "rows": sorted(by_run[job.name], key=lambda r: (r["mode"], r["length"])),
            },
        )


def summarise(records: dict[str, dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """(stack, mode, length) -> perplexity mean ± std over the recorded seeds (:func:`record_cells`)."""
    return record_cells(records, "stack")


def summary_lines(records: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The summary: setup, command, wall time, one perplexity table per window mode."""
    agg = summarise(records)
    L = args.train_len
    lengths = [m * L for m in MULTIPLES]
    stacks = [s for s in args.stacks if (s, "nonoverlap", L) in agg]
    lines = [
        f"# Hybrid per-layer PE stacks: char LM at L={L}, {len(records)} runs",
        "",
        f"Command: `{args.command}`  ",
        f"Training: {records_wall(records)}.  ",
        "Cells: perplexity per character, mean ± std over seeds (n = seeds); `*` = training length.",
        "",
    ]
    for mode in ("nonoverlap", "sliding"):
        lines += [f"## {mode}", ""] + table(agg, stacks, mode, lengths, L, label="stack") + [""]
    ns = sorted({agg[(s, "nonoverlap", L)]["n"] for s in stacks})
    lines.append(f"n (seeds per stack): {', '.join(map(str, ns))}")
    return lines


def stack_style(stack: str) -> tuple[str, str]:
    """Colour and marker of a stack: a pure PE's own (:func:`posformer.utils.figures.pe_color`), the
    hybrids' distinct colours of the same palette (their names would share one hashed colour)."""
    from posformer.utils.figures import palette, pe_color, pe_marker

    hybrids = {
        "irope": (palette()[3], "D"),
        "rnope_swa": (palette()[2], "^"),
        "gemma3": (palette()[4], "s"),
        "gemma3_10k": (palette()[5], "v"),
    }
    return hybrids.get(stack) or (pe_color(stack), pe_marker(stack))


def plot(agg: dict[Key, dict[str, Any]], stacks: list[str], train_len: int, path: Path) -> None:
    """``path`` .png and .svg: non-overlapping perplexity against length per stack, ± std bands, and a
    zoom panel on the band [lowest, 1.25 × lowest] where the flat stacks lie on one another."""
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    from posformer.utils.figures import length_axis, metric_axis, new_figure, save_figure

    lengths = [m * train_len for m in MULTIPLES]
    fig, ax = new_figure(f"hybrid PE stacks: char-LM perplexity, non-overlapping windows (L={train_len})")
    fig.set_size_inches(6.4, 6.0)
    zoom = make_axes_locatable(ax).append_axes("bottom", size="50%", pad=0.3, sharex=ax)
    lowest = min(a["mean"] for k, a in agg.items() if k[0] in stacks and k[1] == "nonoverlap" and a["n"])
    for s in stacks:
        xs = [n for n in lengths if agg.get((s, "nonoverlap", n), {}).get("n")]
        cells = [agg[(s, "nonoverlap", n)] for n in xs]
        ys, sd = [c["mean"] for c in cells], [c["std"] for c in cells]
        color, marker = stack_style(s)
        for a, label in ((ax, f"{s} (n={max(c['n'] for c in cells)})"), (zoom, None)):
            a.plot(xs, ys, color=color, marker=marker, lw=1.6, ms=6, label=label)
            band = [(y - e, y + e) for y, e in zip(ys, sd, strict=True)]
            a.fill_between(xs, [b[0] for b in band], [b[1] for b in band], color=color, alpha=0.15, lw=0)
    length_axis(ax, lengths, [train_len])
    metric_axis(ax, "ppl")
    zoom.axvline(train_len, color="grey", ls="--", lw=1)
    zoom.set_ylim(lowest * 0.98, lowest * 1.25)
    zoom.set_ylabel("zoom (linear)", fontsize=8)
    zoom.grid(alpha=0.3)
    zoom.set_xlabel(ax.get_xlabel())
    ax.set_xlabel("")
    ax.tick_params(labelbottom=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, ax, path, caption="line: mean over seeds; band: ± 1 std over seeds")


# ------------------------------------------------------------------------------------------ passkey
def record_needle_runs(
    out: Path, ledger: Path, todo: list[Job], grid: list[tuple[str, int]], setup: list[str], train_len: int
) -> None:
    """Score every finished passkey run without a record with ``posformer-needle`` (its ``needle/``
    kept: skipped when there) and record its cells."""
    sweep = out / "train"
    have = recorded(ledger)
    for job, (stack, seed) in zip(todo, grid, strict=True):
        run_dir = sweep / job.name
        if job.name in have or job_state(run_dir) != "done":
            continue
        grid_json = run_dir / "needle" / "needle.json"
        if not grid_json.is_file():
            ckpt = run_dir / "checkpoints" / "last.ckpt"
            needle = [str(VENV_BIN / "posformer-needle"), str(ckpt), *needle_args(train_len)]
            run([*needle, "--out", str(run_dir / "needle")], run_dir / "needle.log")
        res = json.loads((run_dir / "results.json").read_text())
        cells = json.loads(grid_json.read_text())["cells"]
        write_record(
            ledger,
            job.name,
            {
                "stack": stack,
                "seed": seed,
                "steps": res["global_step"],
                "train_time_s": res.get("train_time_s"),
                "invocations": invocations(sweep, job.name),
                "setup": setup,
                "cells": [
                    {k: c[k] for k in ("length", "depth", *metrics.names(kinds=("task",)))} for c in cells
                ],
            },
        )


def needle_cells(records: dict[str, dict[str, Any]]) -> dict[tuple[str, int, float], dict[str, Any]]:
    """(stack, length, depth) -> exact match mean ± std over the recorded seeds; depth ``-1``: the mean
    over depths of each seed, then mean ± std over seeds."""
    rows = []
    for name in sorted(records, key=run_index):
        rec = records[name]
        per_len: dict[int, list[float]] = defaultdict(list)
        for c in rec["cells"]:
            key = (rec["stack"], c["length"], c["depth"])
            rows.append({"cell": key, "status": "ok", "em": c["exact_match"]})
            per_len[c["length"]].append(c["exact_match"])
        for length, ems in per_len.items():
            rows.append({"cell": (rec["stack"], length, -1.0), "status": "ok", "em": sum(ems) / len(ems)})
    return {k: c["em"] for k, c in cells(rows, lambda r: r["cell"], ["em"]).items()}


def needle_lines(
    records: dict[str, dict[str, Any]], stacks: list[str], args: argparse.Namespace
) -> list[str]:
    """The passkey summary: exact match averaged over depths per stack and haystack length."""
    agg = needle_cells(records)
    L = args.train_len
    lengths = sorted({k[1] for k in agg})
    lines = [
        f"# Hybrid per-layer PE stacks: passkey needle grid, trained on 8..{L} filler tokens, "
        f"{len(records)} runs",
        "",
        f"Command: `{args.command}`  ",
        f"Training: {records_wall(records)}.  ",
        f"Cells: exact match averaged over the depths {NEEDLE_DEPTHS} ({NEEDLE_KEYS} keys each), mean ± std "
        "over seeds; `*` = within the training lengths.",
        "",
    ]
    table = [{"s": s, **{str(n): fmt_cell(agg[(s, n, -1.0)]) for n in lengths}} for s in stacks]
    columns = [("s", "stack"), *((str(n), f"{n}{'*' if n <= L else ''}") for n in lengths)]
    lines += markdown_table(table, columns, default_align="").splitlines()
    ns = sorted({agg[(s, lengths[0], -1.0)]["n"] for s in stacks})
    return [*lines, "", f"n (seeds per stack): {', '.join(map(str, ns))}"]


def plot_needle(records: dict[str, dict[str, Any]], stacks: list[str], train_len: int, path: Path) -> None:
    """``path`` .png and .svg: one exact-match heat map (haystack length × depth, mean over seeds) per
    stack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from posformer.utils.figures import write_figure

    agg = needle_cells(records)
    lengths = sorted({k[1] for k in agg})
    cols = min(3, len(stacks))
    rows = -(-len(stacks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax, s in zip(axes.flat, stacks, strict=False):
        grid = np.array([[agg[(s, n, d)]["mean"] for d in NEEDLE_DEPTHS] for n in lengths])
        ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        for i, j in np.ndindex(grid.shape):
            ax.text(
                j,
                i,
                f"{grid[i, j]:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="black" if grid[i, j] > 0.6 else "white",
            )
        ax.set_xticks(range(len(NEEDLE_DEPTHS)), [f"{d:g}" for d in NEEDLE_DEPTHS])
        ax.set_yticks(range(len(lengths)), [f"{n}{'*' if n <= train_len else ''}" for n in lengths])
        ax.set_title(f"{s} (n={agg[(s, lengths[0], -1.0)]['n']})", fontsize=9)
        ax.set_xlabel("needle depth", fontsize=8)
        ax.set_ylabel("haystack (filler tokens)", fontsize=8)
    for ax in list(axes.flat)[len(stacks) :]:
        ax.axis("off")
    title = f"passkey exact match, mean over seeds (trained on 8..{train_len}; * = trained)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_figure(fig, path, dpi=110)
    plt.close(fig)
