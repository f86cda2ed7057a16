"""Study 4: RoPE context extension, zero-shot and after a short fine-tune.

RoPE char-LMs trained at length L on tinyshakespeare (>= 3 seeds; by default trained here, or taken
from the rope runs of the LM study with ``--base-sweep``) are evaluated at 1x, 2x, 4x, 8x L
(non-overlapping) with every context-extension method of ``posformer.pe.rope.scaling``:

* zero-shot: ``posformer-eval eval.rope_scaling=[...]`` on the trained checkpoints; the factor is
  ``auto`` (= evaluation length / L) for linear, ntk, yarn and llama3, and 2 for dynamic_ntk (which
  grows with the length by itself);
* fine-tuned: ``posformer-train init_from=`` continues each checkpoint for a few steps at 4L with the method
  set in the model (factor 4; plain RoPE for ``none``), then the same evaluation.

    posformer-study rope-extension --size tiny
    posformer-study rope-extension --base-sweep outputs/studies/lm_extrapolation_tiny/train
    python scripts/study_rope_extension.py --size tiny             # the same

Outputs in ``--out``: ``zeroshot/``, ``finetune/`` (runs), ``finetune_eval/``, ``summary.md``,
``summary.csv``, ``summary_zeroshot.png``, ``summary_finetuned.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from posformer.studies.aggregate import Key, cells, run_seed, table
from posformer.studies.commands import run
from posformer.studies.common import QUIET, VENV_BIN, StudyError, project_root
from posformer.studies.figures import plot_series
from posformer.studies.jobs import train_sweep
from posformer.studies.lm import SIZES, default_text, lm_overrides, model_overrides

__all__ = ["FT", "METHODS", "add_arguments", "run_study"]

METHODS = ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
#: evaluation lengths, in multiples of the training length
MULTIPLES = [1, 2, 4, 8]
#: the fine-tune of each size: steps at 4L, batch, learning rate
FT = {
    "tiny": dict(steps=60, batch=8, lr=5e-4),
    "small": dict(steps=300, batch=8, lr=3e-4),
    "medium": dict(steps=1000, batch=8, lr=2e-4),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the RoPE context-extension study."""
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--base-sweep", type=Path, default=None, help="use the rope runs of this (study 1) sweep")
    ap.add_argument("--steps", type=int, default=None, help="override the base training steps")
    ap.add_argument("--ft-steps", type=int, default=None)
    ap.add_argument("--no-finetune", action="store_true")
    ap.add_argument("--n-tokens", type=int, default=None, help="scored tokens per length (default: size)")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/studies/rope_extension_<size>")
    ap.add_argument(
        "--text",
        type=Path,
        default=None,
        help="tinyshakespeare's input.txt (default ../shared/data/tinyshakespeare/input.txt)",
    )


def zero_shot_scaling(method: str) -> str:
    """The ``eval.rope_scaling`` entry of ``method`` (factor ``auto``; dynamic_ntk 2)."""
    if method == "none":
        return "null"
    factor = 2 if method == "dynamic_ntk" else "auto"
    return f"{{type:{method},factor:{factor}}}"


def finetune_scaling(method: str, L: int) -> str:
    """The ``model.pe_options.scaling`` of a fine-tune at 4L with ``method`` (factor 4; dynamic_ntk 2)."""
    if method == "none":
        return "null"
    factor = 2 if method == "dynamic_ntk" else 4
    return f"{{type:{method},factor:{factor},original_max_len:{L}}}"


def method_of(row: dict[str, Any], finetuned: bool) -> str:
    """The extension method of an evaluation row: its scaling label, or the fine-tuned run's config."""
    if not finetuned:
        return row["scaling"].split("(")[0]
    from omegaconf import OmegaConf

    cfg = OmegaConf.create((Path(row["checkpoint"]).resolve().parent.parent / "config.yaml").read_text())
    sc = cfg.model.pe_options.get("scaling")
    return "none" if not sc else str(sc["type"])


def run_study(args: argparse.Namespace) -> None:
    """The study (see the module docstring); ``args.command`` is the command line shown in the summary."""
    size, ft = dict(SIZES[args.size]), dict(FT[args.size])
    if args.ft_steps:
        ft["steps"] = args.ft_steps
    if args.steps:
        size["steps"] = args.steps
    out = (args.out or project_root() / "outputs" / "studies" / f"rope_extension_{args.size}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.n_tokens:
        size["n_tokens"] = args.n_tokens
    text = args.text or default_text()
    L = size["train_len"]
    lengths = [m * L for m in MULTIPLES]
    timing: dict[str, float] = {}
    bases = base_checkpoints(args, out, size, text, timing)
    eval_common = [
        str(VENV_BIN / "posformer-eval"),
        "eval.progress=false",
        "eval.modes=[nonoverlap]",
        f"eval.lengths=[{','.join(map(str, lengths))}]",
        f"eval.n_tokens={size['n_tokens']}",
        f"eval.batch_tokens={max(8192, lengths[-1])}",
    ]
    scalings = ",".join(zero_shot_scaling(m) for m in args.methods)
    zeroshot = [f"eval.checkpoints=[{','.join(map(str, bases))}]", f"eval.rope_scaling=[{scalings}]"]
    rows = [(r, False) for r in evaluate(out, "zeroshot", eval_common, timing, "zeroshot_eval_s", zeroshot)]
    if not args.no_finetune:
        timing["finetune_s"] = sum(finetune(out, base, args.methods, size, ft, text) for base in bases)
        finetuned = [f"eval.sweep_dir={out / 'finetune'}", "eval.which=last"]
        rows += [
            (r, True)
            for r in evaluate(out, "finetune_eval", eval_common, timing, "finetune_eval_s", finetuned)
        ]
    write_summary(out, args, rows, size, ft, timing)


def base_checkpoints(
    args: argparse.Namespace, out: Path, size: dict[str, Any], text: Path, timing: dict[str, float]
) -> list[Path]:
    """The trained RoPE checkpoints: the rope runs of ``--base-sweep`` (of ``--seeds``), else those in
    ``out/train``, trained first (seconds into ``timing``) unless a re-run finds them there."""
    if args.base_sweep:
        bases = sorted(args.base_sweep.resolve().glob("*_rope_s*/checkpoints/last.ckpt"))
        bases = [b for b in bases if run_seed(str(b)) in args.seeds]
    else:  # a re-run reuses the base runs (and the fine-tunes) already in --out
        if not list((out / "train").glob("*_rope_s*/checkpoints/last.ckpt")):
            grid = {"pe": ["rope"], "seed": args.seeds}
            timing["train_s"] = train_sweep(out, lm_overrides(size, text), grid)
        bases = sorted((out / "train").glob("*_rope_s*/checkpoints/last.ckpt"))
    if not bases:
        raise StudyError("no rope checkpoints found (*_rope_s*/checkpoints/last.ckpt)")
    return bases


def evaluate(
    out: Path, name: str, eval_common: list[str], timing: dict[str, float], key: str, extra: list[str]
) -> list[dict[str, Any]]:
    """``posformer-eval`` into ``out/<name>`` (log ``<name>.log``; seconds into ``timing[key]``); its rows."""
    target = out / name
    cmd = [*eval_common, *extra, f"eval.output_dir={target}", f"paths.log_dir={target}"]
    timing[key] = run(cmd, out / f"{name}.log")
    return json.loads((target / "extrapolation.json").read_text())["results"]


def finetune(out: Path, base: Path, methods: list[str], size: dict, ft: dict, text: Path) -> float:
    """Fine-tune ``base`` at 4L with every method (one ``posformer-train -m init_from=<base>`` multirun
    into ``out/finetune/seed<seed>``), unless each method has its run there; returns seconds."""
    seed, L = run_seed(str(base)), size["train_len"]
    if len(list((out / "finetune" / f"seed{seed}").glob("*/checkpoints/last.ckpt"))) >= len(methods):
        return 0.0
    ft_over = [
        *model_overrides(size),
        "data=text",
        f"data.path={text}",
        f"data.block_size={4 * L}",
        f"data.batch_size={ft['batch']}",
        f"trainer.max_steps={ft['steps']}",
        f"trainer.val_check_interval={ft['steps']}",
        "trainer.limit_val_batches=10",
        f"schedule.warmup_steps={max(ft['steps'] // 10, 1)}",
        f"optim.lr={ft['lr']}",
        "pe=rope",
        f"seed={seed}",
    ]
    sweep = ",".join(finetune_scaling(m, L) for m in methods)
    cmd = [
        str(VENV_BIN / "posformer-train"),
        "-m",
        f"init_from={base}",
        f"hydra.sweep.dir={out / 'finetune' / f'seed{seed}'}",
        "hydra.sweep.subdir=${hydra.job.num}",
        f"paths.log_dir={out / 'finetune'}",
        "evaluate=false",
        *QUIET,
        *ft_over,
        f"model.pe_options.scaling={sweep}",
    ]
    return run(cmd, out / f"finetune_seed{seed}.log")


def aggregate_rows(rows: list[tuple[dict[str, Any], bool]]) -> tuple[dict[Key, dict[str, Any]], set[int]]:
    """(method[ (ft)], mode, length) -> perplexity mean ± std over seeds, and the seeds seen."""
    named = [{**r, "series": f"{method_of(r, ft)}{' (ft)' if ft else ''}"} for r, ft in rows]
    by_cell = cells(named, lambda r: (r["series"], r["mode"], r["length"]), ["ppl"])
    return {k: c["ppl"] for k, c in by_cell.items()}, {run_seed(r["checkpoint"]) for r in named}


def write_summary(
    out: Path,
    args: argparse.Namespace,
    rows: list[tuple[dict[str, Any], bool]],
    size: dict,
    ft: dict,
    timing: dict[str, float],
) -> None:
    """``summary.md`` (zero-shot and fine-tuned tables), their plots and ``summary.csv``."""
    agg, seeds = aggregate_rows(rows)
    L = size["train_len"]
    lengths = [m * L for m in MULTIPLES]
    zs_series = [m for m in args.methods if any(k[0] == m for k in agg)]
    ft_series = [f"{m} (ft)" for m in args.methods if any(k[0] == f"{m} (ft)" for k in agg)]
    tt = ", ".join(f"{k} {v:.0f} s" for k, v in timing.items())
    lines = [
        f"# RoPE context extension ({args.size})",
        "",
        f"Command: `{args.command}`  ",
        f"Base: RoPE char-LM (d_model={size['d_model']}, layers={size['n_layers']}) trained at L={L} on "
        f"tinyshakespeare, seeds {sorted(seeds)}. Zero-shot factor: auto (= length/L; dynamic_ntk: 2). "
        f"Fine-tune: {ft['steps']} steps at {4 * L} tokens (batch {ft['batch']}, lr {ft['lr']}), factor 4 "
        f"(dynamic_ntk: 2). Cells: perplexity (non-overlapping, {size['n_tokens']} scored tokens per "
        "length), mean ± std over seeds.  ",
        f"Wall time: {tt} (2 shared CPU cores).",
        "",
        "## zero-shot",
        "",
    ]
    lines += table(agg, zs_series, "nonoverlap", lengths, L, label="method")
    path, title = out / "summary_zeroshot.png", f"RoPE zero-shot extension (train L={L})"
    plot_series(agg, zs_series, "nonoverlap", lengths, L, path, "perplexity", title=title)
    if ft_series:
        lines += ["", f"## after fine-tuning at {4 * L}", ""]
        lines += table(agg, ft_series, "nonoverlap", lengths, None, label="method")
        path, title = out / "summary_finetuned.png", f"RoPE after fine-tuning at {4 * L}"
        plot_series(agg, ft_series, "nonoverlap", lengths, 4 * L, path, "perplexity", title=title)
    lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "length", "ppl_mean", "ppl_std", "n_seeds"])
        for (s, _, x), a in sorted(agg.items()):
            w.writerow([s, x, a["mean"], a["std"], a["n"]])
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")
