"""Study 1: language-model length extrapolation of every PE on char-level tinyshakespeare.

Every PE is trained (one ``posformer-train`` run per PE and seed, >= 3 seeds, the resumable queue) at
one length L, then every run is evaluated with ``posformer-eval`` at 1x-16x L in non-overlapping and
sliding-window mode; the study aggregates mean ± std over seeds into a table and a plot. With
``--memory`` (default on) it also measures the peak memory of one forward pass at 16 384 tokens for
every PE with a small (untrained) model.

    posformer-study lm --size tiny                                  # CPU, minutes
    posformer-study lm --size small --seeds 0 1 2 --out outputs/studies/lm
    posformer-study lm --size tiny --skip-train                     # re-evaluate an existing sweep
    python scripts/study_lm_extrapolation.py --size tiny            # the same

Outputs in ``--out``: ``train/`` (the sweep), ``eval/`` (extrapolation.* of posformer-eval),
``eval_positions/`` (the loss per position of the 16L window, from ``position_windows`` windows),
``summary.md``, ``summary.csv``, ``summary_<mode>.png``, ``memory.md``, ``memory.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

from posformer.studies.aggregate import Key, aggregate, table
from posformer.studies.commands import eval_sweep
from posformer.studies.common import StudyError, all_pes, project_root, shared_data
from posformer.studies.figures import plot_series
from posformer.studies.jobs import parse_cores, train_sweep, train_wall
from posformer.studies.memory import write_memory

__all__ = ["ALL_PES", "MULTIPLES", "SIZES", "add_arguments", "model_overrides", "run_study"]

ALL_PES = all_pes()
#: d_model, layers, heads, d_ff, training length, steps, batch, scored tokens per evaluation length,
#: windows of the loss-per-position evaluation
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, d_ff=256, train_len=64, steps=300, batch=32,
                 n_tokens=8192, position_windows=32),
    "small": dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, train_len=128, steps=1500, batch=32,
                  n_tokens=16384, position_windows=48),
    "medium": dict(d_model=256, n_layers=6, n_heads=8, d_ff=1024, train_len=256, steps=5000, batch=32,
                   n_tokens=32768, position_windows=24),
}  # fmt: skip
#: evaluation lengths, in multiples of the training length
MULTIPLES = [1, 2, 4, 8, 16]


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
    ap.add_argument("--text", type=Path, default=None,
                    help="tinyshakespeare's input.txt (default ../shared/data/tinyshakespeare/input.txt)")
    ap.add_argument("--extra", nargs="*", default=[],
                    help="more posformer-train overrides for every run (an ablation)")
    ap.add_argument("--skip-train", action="store_true", help="evaluate the sweep already in --out")
    ap.add_argument("--cores", default="0",
                    help="cores to run jobs on, one job per core (e.g. 0,1); none = unpinned")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure peak memory at 16384 tokens for every PE")
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
    text = args.text or default_text()
    if not text.is_file():
        raise StudyError(f"tinyshakespeare not found at {text}; pass --text path/to/input.txt")
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    out = (args.out or project_root() / "outputs" / "studies" / f"lm_extrapolation_{args.size}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    timing: dict[str, float] = {}
    if not args.skip_train:
        common = [*lm_overrides(size, text), *args.extra]
        timing["train_s"] = train_sweep(out, common, {"pe": args.pes, "seed": args.seeds},
                                        cores=parse_cores(args.cores))  # fmt: skip
    timing.update(evaluate(out, size))
    rows = json.loads((out / "eval" / "extrapolation.json").read_text())["results"]
    lines = summarise(out, rows, args, size, timing)
    if args.memory:
        t0 = time.perf_counter()
        lines += write_memory(out, args.pes)
        timing["memory_s"] = time.perf_counter() - t0
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


def evaluate(out: Path, size: dict[str, Any]) -> dict[str, float]:
    """Evaluate the sweep of ``out`` at every multiple of L (``eval/``), then the loss per position of
    the longest window from many windows (``eval_positions/``: the curves of the main evaluation
    average n_tokens / 16L windows, too few for the first positions). Returns their seconds."""
    lengths = [m * size["train_len"] for m in MULTIPLES]
    batch = f"eval.batch_tokens={max(8192, lengths[-1])}"
    main = [f"eval.lengths=[{','.join(map(str, lengths))}]", f"eval.n_tokens={size['n_tokens']}",
            "eval.stride=0.5", batch]  # fmt: skip
    positions = [f"eval.lengths=[{lengths[-1]}]", "eval.modes=[nonoverlap]",
                 f"eval.n_tokens={size['position_windows'] * lengths[-1]}", batch]  # fmt: skip
    return {
        "eval_s": eval_sweep(out / "train", out / "eval", main),
        "eval_positions_s": eval_sweep(out / "train", out / "eval_positions", positions,
                                       log_name="eval_positions.log"),
    }  # fmt: skip


def summarise(
    out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, size: dict[str, Any], timing: dict
) -> list[str]:
    """The summary's lines (header, one perplexity table per mode), its plots and ``summary.csv``."""
    L = size["train_len"]
    lengths = [m * L for m in MULTIPLES]
    series = [pe for pe in args.pes if any(r["pe"] == pe for r in rows)]
    agg_ppl = aggregate(rows, lambda r: r["pe"], "ppl")
    agg_loss = aggregate(rows, lambda r: r["pe"], "loss")
    scored = sorted({r["scored_tokens"] for r in rows if r.get("scored_tokens")})
    lines = [
        f"# LM extrapolation study ({args.size})",
        "",
        f"Command: `{args.command}`  ",
        f"Model: decoder-only, d_model={size['d_model']}, layers={size['n_layers']}, "
        f"heads={size['n_heads']}, "
        f"d_ff={size['d_ff']}; char-level tinyshakespeare, trained at L={L} for {size['steps']} steps "
        f"(batch {size['batch']}); seeds {args.seeds}.  ",
        f"Evaluation: validation split (last 10%), {', '.join(map(str, scored))} scored tokens at every "
        "length; "
        "sliding: stride = half the window, each window scores its second half (every scored token "
        "has at least half a window of context). Cells: perplexity mean ± std over seeds; `*` = training "
        "length.  ",
        f"Wall time: training {train_wall(out)}, evaluation {timing['eval_s']:.0f} s.",
        "",
    ]
    for mode in ("nonoverlap", "sliding"):
        lines += [f"## {mode}", ""] + table(agg_ppl, series, mode, lengths, L) + [""]
        plot_series(agg_ppl, series, mode, lengths, L, out / f"summary_{mode}.png", "perplexity",
                    title=f"char-LM perplexity, {mode} (train L={L})")  # fmt: skip
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
