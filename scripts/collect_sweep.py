#!/usr/bin/env python
"""Collect a posformer-train sweep (multirun) into one table and one figure, by hand.

    posformer-train -m pe=sinusoidal,learned,rope,alibi,t5,nope seed=0,1,2   # does this itself at the end
    python scripts/collect_sweep.py outputs/train/multiruns/<date_time> [--metric token_acc] [--out DIR]

Writes ``summary.{json,csv,md,png,svg}`` (mean ± std over seeds per model and length) to the sweep
dir or ``--out`` and prints the table; exit status 1 if a job failed. The logic is
:func:`posformer.eval.sweep.collect`, which the multirun's Hydra callback also runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posformer.cli.boundary import error_boundary
from posformer.eval.sweep import METRICS, collect, print_failures, print_summary


@error_boundary("collect_sweep")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", help="a posformer-train multirun directory")
    ap.add_argument("--out", default=None, help="where to write summary.* (default: the sweep dir)")
    ap.add_argument(
        "--metric", default=None, help=f"{', '.join(METRICS)} (default: ppl for LMs, else exact_match)"
    )
    args = ap.parse_args(argv)
    summary = collect(args.sweep_dir, args.out, args.metric)
    print_summary(summary, Path(args.out or args.sweep_dir))
    if summary["failed"]:
        print_failures(summary["failed"], summary["n_runs"] + len(summary["failed"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
