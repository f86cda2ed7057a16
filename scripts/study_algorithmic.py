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
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_lm_extrapolation import (  # noqa: E402
    ALL_PES,
    ROOT,
    eval_sweep,
    fmt_cell,
    mean_std,
    model_overrides,
    plot,
    run_seed,
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
        f"trainer.val_check_interval={max(size['steps'] // 2, 1)}",
        f"schedule.warmup_steps={max(size['steps'] // 10, 1)}",
        "optim.lr=3e-3",
        f"positions.n_max={size['n_max']}",
    ]
    timing = {}
    if not args.skip_train:
        timing["train_s"] = train_sweep(
            out, common, {"pe": args.pes, "positions.randomized": ["false", "true"], "seed": args.seeds}
        )
    eval_dir = out / "eval"
    timing["eval_s"] = eval_sweep(out / "train", eval_dir, [f"eval.lengths=[{','.join(map(str, lengths))}]"])
    rows = json.loads((eval_dir / "extrapolation.json").read_text())["results"]

    def randomized(r: dict[str, Any]) -> bool:
        cfg = Path(r["checkpoint"]).resolve().parent.parent / "config.yaml"
        text = cfg.read_text()
        block = text[text.index("positions:") :].splitlines()[1:3]
        return any("randomized: true" in line for line in block)

    for r in rows:
        r["series"] = f"{r['pe']} + randomized" if randomized(r) else r["pe"]
    series = [s for pe in args.pes for s in (pe, f"{pe} + randomized") if any(r["series"] == s for r in rows)]
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
                "seeds": sorted({run_seed(r["checkpoint"]) for r in rs}),
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
    cmd = " ".join(["python scripts/study_algorithmic.py", *sys.argv[1:]])
    lines = [
        f"# Algorithmic length generalization ({args.task}, {args.size})",
        "",
        f"Command: `{cmd}`  ",
        f"Model: decoder-only, d_model={size['d_model']}, layers={size['n_layers']}, "
        f"heads={size['n_heads']}; "
        f"task `{args.task}` trained on instance lengths {lo}-{hi} for {size['steps']} steps (batch "
        f"{size['batch']}); randomized positions with n_max={size['n_max']}; seeds {args.seeds}; "
        f"{size['n_eval']} test instances per length.  ",
        f"Cells: exact match, mean ± std over seeds; `*` = in the training range. Rows whose in-distribution "
        f"exact match is below {args.id_threshold} are marked ✗ (their OOD numbers are not meaningful).  ",
        f"Wall time: train {timing.get('train_s', 0):.0f} s, eval {timing['eval_s']:.0f} s "
        "(2 shared CPU cores).",
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
    (out / "summary.md").write_text("\n".join(lines))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "length", "metric", "mean", "std", "n_seeds", "id_exact_match"])
        for (metric, s, _, L), a in sorted(agg.items()):
            w.writerow([s, L, metric, a["mean"], a["std"], a["n"], id_acc[s]])
    print("\n".join(lines))
    print(f"\nwritten: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
