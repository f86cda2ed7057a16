#!/usr/bin/env python
"""Study 3: RoPE context extension, zero-shot and after a short fine-tune.

RoPE char-LMs trained at length L on tinyshakespeare (>= 3 seeds; by default trained here, or taken
from the rope runs of study 1 with ``--base-sweep``) are evaluated at 1x, 2x, 4x, 8x L
(non-overlapping) with every context-extension method of ``posformer.pe.rope.scaling``:

* zero-shot: ``posformer-eval eval.rope_scaling=[...]`` on the trained checkpoints; the factor is
  ``auto`` (= evaluation length / L) for linear, ntk, yarn and llama3, and 2 for dynamic_ntk (which
  grows with the length by itself);
* fine-tuned: ``scripts/finetune.py`` continues each checkpoint for a few steps at 4L with the method
  set in the model (factor 4; plain RoPE for ``none``), then the same evaluation.

    python scripts/study_rope_extension.py --size tiny
    python scripts/study_rope_extension.py --base-sweep outputs/studies/lm_extrapolation_tiny/train

Outputs in ``--out``: ``zeroshot/``, ``finetune/`` (runs), ``finetune_eval/``, ``summary.md``,
``summary.csv``, ``summary_zeroshot.png``, ``summary_finetuned.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_jobs import VENV_BIN, run  # noqa: E402
from study_lm_extrapolation import (  # noqa: E402
    QUIET,
    ROOT,
    SIZES,
    TEXT,
    fmt_cell,
    mean_std,
    model_overrides,
    plot,
    run_seed,
    train_sweep,
)

METHODS = ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
MULTIPLES = [1, 2, 4, 8]
FT = {
    "tiny": dict(steps=60, batch=8, lr=5e-4),
    "small": dict(steps=300, batch=8, lr=3e-4),
    "medium": dict(steps=1000, batch=8, lr=2e-4),
}


def zero_shot_scaling(method: str) -> str:
    if method == "none":
        return "null"
    factor = 2 if method == "dynamic_ntk" else "auto"
    return f"{{type:{method},factor:{factor}}}"


def finetune_scaling(method: str, L: int) -> str:
    if method == "none":
        return "null"
    factor = 2 if method == "dynamic_ntk" else 4
    return f"{{type:{method},factor:{factor},original_max_len:{L}}}"


def run_config(checkpoint: str) -> str:
    return (Path(checkpoint).resolve().parent.parent / "config.yaml").read_text()


def method_of(row: dict[str, Any], finetuned: bool) -> str:
    if not finetuned:
        return row["scaling"].split("(")[0]
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(run_config(row["checkpoint"]))
    sc = cfg.model.pe_options.get("scaling")
    return "none" if not sc else str(sc["type"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--base-sweep", type=Path, default=None, help="use the rope runs of this (study 1) sweep")
    ap.add_argument("--steps", type=int, default=None, help="override the base training steps")
    ap.add_argument("--ft-steps", type=int, default=None)
    ap.add_argument("--no-finetune", action="store_true")
    ap.add_argument("--n-tokens", type=int, default=None, help="scored tokens per length (default: size)")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/studies/rope_extension_<size>")
    ap.add_argument("--text", type=Path, default=TEXT)
    args = ap.parse_args()
    size, ft = dict(SIZES[args.size]), dict(FT[args.size])
    if args.ft_steps:
        ft["steps"] = args.ft_steps
    if args.steps:
        size["steps"] = args.steps
    out = (args.out or ROOT / "outputs" / "studies" / f"rope_extension_{args.size}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.n_tokens:
        size["n_tokens"] = args.n_tokens
    L = size["train_len"]
    lengths = [m * L for m in MULTIPLES]
    data = ["data=text", f"data.path={args.text}"]
    common = [
        *model_overrides(size),
        *data,
        f"data.block_size={L}",
        f"data.batch_size={size['batch']}",
        f"trainer.max_steps={size['steps']}",
        f"trainer.val_check_interval={max(size['steps'] // 2, 1)}",
        "trainer.limit_val_batches=20",
        f"schedule.warmup_steps={max(size['steps'] // 10, 1)}",
        "optim.lr=2e-3",
    ]
    timing: dict[str, float] = {}
    if args.base_sweep:
        bases = sorted(args.base_sweep.resolve().glob("*_rope_s*/checkpoints/last.ckpt"))
        bases = [b for b in bases if run_seed(str(b)) in args.seeds]
    else:  # a re-run reuses the base runs (and the fine-tunes below) already in --out
        if not list((out / "train").glob("*_rope_s*/checkpoints/last.ckpt")):
            timing["train_s"] = train_sweep(out, common, {"pe": ["rope"], "seed": args.seeds})
        bases = sorted((out / "train").glob("*_rope_s*/checkpoints/last.ckpt"))
    if not bases:
        raise SystemExit("no rope checkpoints found (*_rope_s*/checkpoints/last.ckpt)")
    eval_common = [
        str(VENV_BIN / "posformer-eval"),
        "eval.progress=false",
        "eval.modes=[nonoverlap]",
        f"eval.lengths=[{','.join(map(str, lengths))}]",
        f"eval.n_tokens={size['n_tokens']}",
        f"eval.batch_tokens={max(8192, lengths[-1])}",
    ]
    # zero-shot
    scalings = ",".join(zero_shot_scaling(m) for m in args.methods)
    zs_dir = out / "zeroshot"
    timing["zeroshot_eval_s"] = run(
        [
            *eval_common,
            f"eval.checkpoints=[{','.join(map(str, bases))}]",
            f"eval.rope_scaling=[{scalings}]",
            f"eval.output_dir={zs_dir}",
            f"paths.log_dir={zs_dir}",
        ],
        out / "zeroshot.log",
    )
    rows = [(r, False) for r in json.loads((zs_dir / "extrapolation.json").read_text())["results"]]
    # fine-tune at 4L with each method, then evaluate
    if not args.no_finetune:
        timing["finetune_s"] = 0.0
        for base in bases:
            seed = run_seed(str(base))
            ft_over = [
                *model_overrides(size),
                *data,
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
            sweep = ",".join(finetune_scaling(m, L) for m in args.methods)
            done = list((out / "finetune" / f"seed{seed}").glob("*/checkpoints/last.ckpt"))
            if len(done) >= len(args.methods):
                continue
            timing["finetune_s"] += run(
                [
                    str(VENV_BIN / "python"),
                    str(ROOT / "scripts" / "finetune.py"),
                    "-m",
                    f"init_from={base}",
                    f"hydra.sweep.dir={out / 'finetune' / f'seed{seed}'}",
                    "hydra.sweep.subdir=${hydra.job.num}",
                    f"paths.log_dir={out / 'finetune'}",
                    "evaluate=false",
                    *QUIET,
                    *ft_over,
                    f"model.pe_options.scaling={sweep}",
                ],
                out / f"finetune_seed{seed}.log",
            )
        fe_dir = out / "finetune_eval"
        timing["finetune_eval_s"] = run(
            [
                *eval_common,
                f"eval.sweep_dir={out / 'finetune'}",
                "eval.which=last",
                f"eval.output_dir={fe_dir}",
                f"paths.log_dir={fe_dir}",
            ],
            out / "finetune_eval.log",
        )
        rows += [(r, True) for r in json.loads((fe_dir / "extrapolation.json").read_text())["results"]]

    # aggregate: (series, "nonoverlap", length) -> mean ± std over seeds
    groups: dict[tuple, list[float]] = {}
    seeds: set[int] = set()
    for r, finetuned in rows:
        key = (f"{method_of(r, finetuned)}{' (ft)' if finetuned else ''}", r["mode"], r["length"])
        groups.setdefault(key, [])
        if r["status"] == "ok":
            groups[key].append(r["ppl"])
        seeds.add(run_seed(r["checkpoint"]))
    agg = {k: dict(zip(("mean", "std"), mean_std(v)), n=len(v)) for k, v in groups.items()}
    zs_series = [m for m in args.methods if any(k[0] == m for k in agg)]
    ft_series = [f"{m} (ft)" for m in args.methods if any(k[0] == f"{m} (ft)" for k in agg)]
    cmd = " ".join(["python scripts/study_rope_extension.py", *sys.argv[1:]])
    tt = ", ".join(f"{k} {v:.0f} s" for k, v in timing.items())
    lines = [
        f"# RoPE context extension ({args.size})",
        "",
        f"Command: `{cmd}`  ",
        f"Base: RoPE char-LM (d_model={size['d_model']}, layers={size['n_layers']}) trained at L={L} on "
        f"tinyshakespeare, seeds {sorted(seeds)}. Zero-shot factor: auto (= length/L; dynamic_ntk: 2). "
        f"Fine-tune: {ft['steps']} steps at {4 * L} tokens (batch {ft['batch']}, lr {ft['lr']}), factor 4 "
        f"(dynamic_ntk: 2). Cells: perplexity (non-overlapping, {size['n_tokens']} scored tokens per "
        "length), "
        "mean ± std over seeds.  ",
        f"Wall time: {tt} (2 shared CPU cores).",
        "",
        "## zero-shot",
        "",
    ]
    head = "| method | " + " | ".join(f"{L_}{'*' if L_ == L else ''}" for L_ in lengths) + " |"
    sep = "|---" * (len(lengths) + 1) + "|"
    lines += [head, sep]
    for s in zs_series:
        lines.append(f"| {s} | " + " | ".join(fmt_cell(agg[(s, "nonoverlap", x)]) for x in lengths) + " |")
    plot(
        agg,
        zs_series,
        "nonoverlap",
        lengths,
        L,
        out / "summary_zeroshot.png",
        "perplexity",
        title=f"RoPE zero-shot extension (train L={L})",
    )
    if ft_series:
        lines += ["", f"## after fine-tuning at {4 * L}", "", head.replace("*", ""), sep]
        for s in ft_series:
            lines.append(
                f"| {s} | " + " | ".join(fmt_cell(agg[(s, "nonoverlap", x)]) for x in lengths) + " |"
            )
        plot(
            agg,
            ft_series,
            "nonoverlap",
            lengths,
            4 * L,
            out / "summary_finetuned.png",
            "perplexity",
            title=f"RoPE after fine-tuning at {4 * L}",
        )
    lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "length", "ppl_mean", "ppl_std", "n_seeds"])
        for (s, _, x), a in sorted(agg.items()):
            w.writerow([s, x, a["mean"], a["std"], a["n"]])
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
