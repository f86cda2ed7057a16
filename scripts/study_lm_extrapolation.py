#!/usr/bin/env python
"""Study 1: language-model length extrapolation of every PE on char-level tinyshakespeare.

Every PE is trained (``posformer-train -m``, one multirun, >= 3 seeds) at one length L, then every
run is evaluated with ``posformer-eval`` at 1x-16x L in non-overlapping and sliding-window mode; the
script aggregates mean ± std over seeds into a table and a plot. With ``--memory`` (default on) it
also measures the peak memory of one forward pass at 16 384 tokens for every PE with a small
(untrained) model.

    python scripts/study_lm_extrapolation.py --size tiny            # CPU, minutes
    python scripts/study_lm_extrapolation.py --size small --seeds 0 1 2 --out outputs/studies/lm
    python scripts/study_lm_extrapolation.py --size tiny --skip-train   # re-evaluate an existing sweep

Outputs in ``--out``: ``train/`` (the sweep), ``eval/`` (extrapolation.* of posformer-eval),
``eval_positions/`` (the loss per position of the 16L window, from ``position_windows`` windows),
``summary.md``, ``summary.csv``, ``summary_<mode>.png``, ``memory.md``, ``memory.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from study_jobs import ROOT, eval_sweep, parse_cores, wall_seconds

import posformer

# every registered PE: the tables' usual order first (absolute, rotary, biases), the others by name
_ORDER = ["nope", "sinusoidal", "learned", "rope", "xpos", "alibi", "t5", "kerple", "fire", "shaw"]
ALL_PES = [n for n in _ORDER if n in posformer.list_encodings()]
ALL_PES += [n for n in posformer.list_encodings() if n not in _ORDER]
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
QUIET = [
    "logger=none",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
]

SIZES: dict[str, dict[str, Any]] = {
    # d_model, layers, heads, d_ff, train length, steps, batch, scored tokens per eval length
    "tiny": dict(
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=256,
        train_len=64,
        steps=300,
        batch=32,
        n_tokens=8192,
        position_windows=32,
    ),
    "small": dict(
        d_model=128,
        n_layers=4,
        n_heads=4,
        d_ff=512,
        train_len=128,
        steps=1500,
        batch=32,
        n_tokens=16384,
        position_windows=48,
    ),
    "medium": dict(
        d_model=256,
        n_layers=6,
        n_heads=8,
        d_ff=1024,
        train_len=256,
        steps=5000,
        batch=32,
        n_tokens=32768,
        position_windows=24,
    ),
}
MULTIPLES = [1, 2, 4, 8, 16]


# ------------------------------------------------------------------------------------------ helpers
def model_overrides(size: dict[str, Any]) -> list[str]:
    return [
        "model=decoder_tiny",
        f"model.d_model={size['d_model']}",
        f"model.n_layers={size['n_layers']}",
        f"model.n_heads={size['n_heads']}",
        f"model.d_ff={size['d_ff']}",
        "model.dropout=0.0",
    ]


def train_sweep(
    out: Path,
    common: list[str],
    sweep: dict[str, list[Any]] | list[dict[str, Any]],
    tag: str = "train",
    cores: list[int | None] | None = None,
    recorded: set[str] | frozenset[str] = frozenset(),
    launch_until: float | None = None,
) -> float:
    """Train the product of ``sweep`` (or each overrides dict of a list; run dirs
    ``out/<tag>/<i>_<pe>_s<seed>``) with the resumable job queue of :mod:`study_jobs`: finished runs are
    skipped, interrupted ones resume; ``recorded`` and ``launch_until``: see
    :func:`study_jobs.run_jobs`. Returns seconds."""
    import itertools

    from study_jobs import Job, run_jobs

    if isinstance(sweep, dict):
        keys = list(sweep)
        sweep = [dict(zip(keys, values)) for values in itertools.product(*(sweep[k] for k in keys))]
    jobs = []
    for i, over in enumerate(sweep):
        flags = [
            k.rsplit(".", 1)[-1] + ("" if str(v) == "true" else str(v))
            for k, v in over.items()
            if k not in ("pe", "seed") and str(v) != "false"
        ]
        name = "_".join([str(i), str(over.get("pe", "run")), *flags, f"s{over.get('seed', 0)}"])
        jobs.append(Job(name, [f"{k}={v}" for k, v in over.items()]))
    fixed = [f"paths.log_dir={out}", "evaluate=false", *QUIET, *common]
    return run_jobs(jobs, out / tag, fixed, cores=cores, recorded=recorded, launch_until=launch_until)


def train_wall(out: Path, tag: str = "train") -> str:
    """The summed wall time of every training invocation of the study (one core each)."""
    seconds, n = wall_seconds(out / tag)
    return f"{seconds:.0f} s summed over {n} process runs (one core each, run side by side)"


def run_seed(checkpoint: str) -> int:
    cfg = Path(checkpoint).resolve().parent.parent / "config.yaml"
    for line in cfg.read_text().splitlines():
        if line.startswith("seed:"):
            return int(line.split(":", 1)[1])
    return -1


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def aggregate(rows: list[dict[str, Any]], series_key, metric: str) -> dict[tuple, dict[str, Any]]:
    """(series, mode, length) -> mean, std, n seeds, n/a count."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(series_key(r), r["mode"], r["length"])].append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r[metric] for r in rs if r["status"] == "ok"]
        m, s = mean_std(ok)
        out[key] = {
            "mean": m,
            "std": s,
            "n": len(ok),
            "na": len(rs) - len(ok),
            "in_distribution": rs[0].get("in_distribution"),
            "seeds": sorted({run_seed(r["checkpoint"]) for r in rs}),
        }
    return out


def fmt_cell(a: dict[str, Any], digits: int = 2) -> str:
    if a["n"] == 0:
        return "n/a"
    if not math.isfinite(a["mean"]):
        return "–"
    if a["mean"] >= 1000:
        return f"{a['mean']:.3g} ± {a['std']:.2g}"
    return f"{a['mean']:.{digits}f} ± {a['std']:.{digits}f}"


def table(
    agg: dict[tuple, dict[str, Any]],
    series: list[str],
    mode: str,
    lengths: list[int],
    train_len,
    digits: int = 2,
) -> list[str]:
    head = [
        "| PE | " + " | ".join(f"{L}{'*' if train_len == L else ''}" for L in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    body = []
    for s in series:
        cells = [fmt_cell(agg[(s, mode, L)], digits) if (s, mode, L) in agg else "" for L in lengths]
        body.append(f"| {s} | " + " | ".join(cells) + " |")
    return head + body


def plot(
    agg: dict[tuple, dict[str, Any]],
    series: list[str],
    mode: str,
    lengths: list[int],
    train_len,
    path: Path,
    ylabel: str,
    logy: bool = True,
    title: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posformer.eval.plots import pe_color

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in series:
        pts = [(L, agg[(s, mode, L)]) for L in lengths if (s, mode, L) in agg and agg[(s, mode, L)]["n"]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1]["mean"] for p in pts]
        es = [p[1]["std"] for p in pts]
        pe, _, variant = s.partition(" + ")  # "rope + randomized": rope's colour, dashed
        ax.errorbar(
            xs, ys, yerr=es, marker="o", capsize=3, label=s, color=pe_color(pe), ls="--" if variant else "-"
        )
    if isinstance(train_len, (list, tuple)):
        ax.axvspan(train_len[0], train_len[1], color="grey", alpha=0.15, label="training lengths")
    elif train_len:
        ax.axvline(train_len, color="grey", ls="--", label="training length")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("evaluation length")
    ax.set_ylabel(ylabel)
    ax.set_title(title or mode)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(path.with_suffix(f".{ext}"), dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ memory
def measure_memory(out: Path, pes: list[str], length: int = 16384) -> list[dict[str, Any]]:
    """Peak memory of evaluating one ``length``-token window with a small model of every PE (CPU fp32)."""
    import torch

    from posformer.eval.harness import evaluate_subjects
    from posformer.eval.settings import EvalSettings, Subject
    from posformer.model import ModelConfig, build_model

    rows = []
    stream = torch.randint(0, 64, (length + 1,), generator=torch.Generator().manual_seed(0))
    for pe in pes:
        torch.manual_seed(0)
        opts = {"max_len": length} if pe == "learned" else {}
        cfg = ModelConfig(
            kind="decoder",
            vocab_size=64,
            d_model=128,
            n_heads=4,
            n_layers=2,
            d_ff=512,
            dropout=0.0,
            pe=pe,
            pe_options=opts,
        )
        model = build_model(cfg).eval()
        settings = EvalSettings(
            lengths=[length],
            modes=("nonoverlap",),
            n_tokens=length,
            batch_tokens=length,
            position_curves=False,
            progress=False,
        )
        t0 = time.perf_counter()
        res = evaluate_subjects(
            [Subject(pe, model, "lm", stream, pe=pe)],
            settings,
            out / "memory" / pe,
            plots=False,
            tensorboard=False,
        )
        r = res.rows[0]
        rows.append(
            {
                "pe": pe,
                "length": length,
                "peak_mem_mb": r.get("peak_mem_mb"),
                "peak_mem_delta_mb": r.get("peak_mem_delta_mb"),
                "seconds": round(time.perf_counter() - t0, 1),
                "status": r["status"],
            }
        )
        print(
            f"  memory {pe}: peak {r.get('peak_mem_mb')} MiB (+{r.get('peak_mem_delta_mb')}) "
            f"in {rows[-1]['seconds']}s",
            flush=True,
        )
    return rows


def memory_table(mem: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Peak memory at 16 384 tokens (one window, batch 1, fp32 CPU)",
        "",
        "Model d_model=128, 4 heads, 2 layers, untrained; process peak RSS and its increase during the "
        "forward (attention_chunk_mb=256, the default).",
        "",
        "| PE | peak MiB | increase MiB | seconds |",
        "|---|---|---|---|",
    ]
    lines += [f"| {m['pe']} | {m['peak_mem_mb']} | {m['peak_mem_delta_mb']} | {m['seconds']} |" for m in mem]
    return lines


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pes", nargs="+", default=ALL_PES)
    ap.add_argument("--steps", type=int, default=None, help="override the size's training steps")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/studies/lm_extrapolation_<size>")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument(
        "--extra", nargs="*", default=[], help="more posformer-train overrides for every run (an ablation)"
    )
    ap.add_argument("--skip-train", action="store_true", help="evaluate the sweep already in --out")
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
    args = ap.parse_args()
    if args.memory_only:
        out = (args.out or ROOT / "outputs" / "studies" / "memory_16k").resolve()
        mem = measure_memory(out, args.pes)
        lines = memory_table(mem)
        (out / "memory.json").write_text(json.dumps(mem, indent=1))
        (out / "memory.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    if not args.text.is_file():
        raise SystemExit(f"tinyshakespeare not found at {args.text}; pass --text path/to/input.txt")
    size = dict(SIZES[args.size])
    if args.steps:
        size["steps"] = args.steps
    out = (args.out or ROOT / "outputs" / "studies" / f"lm_extrapolation_{args.size}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    L = size["train_len"]
    lengths = [m * L for m in MULTIPLES]
    timing: dict[str, float] = {}
    common = [
        *model_overrides(size),
        "data=text",
        f"data.path={args.text}",
        f"data.block_size={L}",
        f"data.batch_size={size['batch']}",
        f"trainer.max_steps={size['steps']}",
        f"trainer.val_check_interval={max(size['steps'] // 2, 1)}",
        "trainer.limit_val_batches=20",
        f"schedule.warmup_steps={max(size['steps'] // 10, 1)}",
        "optim.lr=2e-3",
        *args.extra,
    ]
    if not args.skip_train:
        timing["train_s"] = train_sweep(
            out, common, {"pe": args.pes, "seed": args.seeds}, cores=parse_cores(args.cores)
        )
    eval_dir = out / "eval"
    timing["eval_s"] = eval_sweep(
        out / "train",
        eval_dir,
        [
            f"eval.lengths=[{','.join(map(str, lengths))}]",
            f"eval.n_tokens={size['n_tokens']}",
            "eval.stride=0.5",
            f"eval.batch_tokens={max(8192, lengths[-1])}",
        ],
    )
    # the per-position loss curve of the longest window, from many windows (the curves of the main
    # evaluation average n_tokens / 16L windows: too few for the first positions)
    timing["eval_positions_s"] = eval_sweep(
        out / "train",
        out / "eval_positions",
        [
            f"eval.lengths=[{lengths[-1]}]",
            "eval.modes=[nonoverlap]",
            f"eval.n_tokens={size['position_windows'] * lengths[-1]}",
            f"eval.batch_tokens={max(8192, lengths[-1])}",
        ],
        log_name="eval_positions.log",
    )
    rows = json.loads((eval_dir / "extrapolation.json").read_text())["results"]
    series = [pe for pe in args.pes if any(r["pe"] == pe for r in rows)]
    agg_ppl = aggregate(rows, lambda r: r["pe"], "ppl")
    agg_loss = aggregate(rows, lambda r: r["pe"], "loss")
    scored = sorted({r["scored_tokens"] for r in rows if r.get("scored_tokens")})
    cmd = " ".join(["python scripts/study_lm_extrapolation.py", *sys.argv[1:]])
    lines = [
        f"# LM extrapolation study ({args.size})",
        "",
        f"Command: `{cmd}`  ",
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
        plot(
            agg_ppl,
            series,
            mode,
            lengths,
            L,
            out / f"summary_{mode}.png",
            "perplexity",
            title=f"char-LM perplexity, {mode} (train L={L})",
        )
    if args.memory:
        t0 = time.perf_counter()
        mem = measure_memory(out, args.pes)
        timing["memory_s"] = time.perf_counter() - t0
        (out / "memory.json").write_text(json.dumps(mem, indent=1))
        lines += memory_table(mem)
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["pe", "mode", "length", "ppl_mean", "ppl_std", "loss_mean", "loss_std", "n_seeds", "n_na"]
        )
        for (s, mode, Ln), a in sorted(agg_ppl.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            b = agg_loss[(s, mode, Ln)]
            w.writerow([s, mode, Ln, a["mean"], a["std"], b["mean"], b["std"], a["n"], a["na"]])
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
