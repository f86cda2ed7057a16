"""Same seed, two trees: are the metrics and the weights bitwise equal? (the check a refactor must pass)

    python scripts/same_seed_ab.py 6b05113                 # that commit (a git worktree) vs this tree
    python scripts/same_seed_ab.py 6b05113 --jobs rope,t5-encdec --out /tmp/ab

Trains each job for 40 steps on the CPU (one thread, pinned to ``--core``) once with the other tree's
code (``PYTHONPATH``) and once with this one's, then compares ``results.json`` (timings and paths left
out) and every tensor of ``last.ckpt``. Prints one line per job; exits 1 if any differs or fails.
About 20 s per job and side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "data.n_train=256",
    "data.n_val=32",
    "data.n_eval_per_length=16",
    "data.batch_size=16",
    "trainer.max_steps=40",
    "trainer.val_check_interval=20",
    "trainer=cpu",
    "logger=none",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
    "callbacks.model_checkpoint.monitor=null",
]
DECODER = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.d_ff=64"]
ENCDEC = ["model=encdec_tiny", "model.d_model=32", "model.n_heads=2", "data=copy"]
PES = ("rope", "sinusoidal", "alibi", "t5", "fire", "shaw", "kerple", "xpos")
#: job name -> overrides: PEs of every kind, randomized positions, both models with cross-attention
JOBS: dict[str, list[str]] = {
    **{
        pe: [f"pe={pe}", *DECODER]
        for pe in ("rope", "sinusoidal", "alibi", "t5", "fire", "shaw", "kerple", "xpos")
    },
    "learned-randomized": ["pe=learned", *DECODER, "positions.randomized=true", "positions.n_max=64"],
    "t5-encdec": ["pe=t5", *ENCDEC, "model.pe_apply.cross=true"],
    "rope-encdec": ["pe=rope", *ENCDEC],
}
#: results.json keys that measure time or name paths, the device report and the data fingerprint
#: (records added in 2026-12: present on one side only, not metrics)
VOLATILE = {"train_time_s", "checkpoint", "output_dir", "wall_time_s", "tokens_per_s"}
VOLATILE |= {"accelerator", "device", "precision", "fingerprint"}


def clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items() if k.split("/")[-1] not in VOLATILE}
    return value


def train(code: Path, job: list[str], out: Path, core: int) -> bool:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    paths = [f"paths.output_dir={out}", f"paths.cache_dir={out.parent}/cache"]
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "posformer.cli.train", *job, *COMMON, *paths]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=code).returncode == 0


def same(a: Path, b: Path) -> tuple[bool, bool]:
    """(metrics equal, weights equal) of two run dirs."""
    ra, rb = (clean(json.loads((d / "results.json").read_text())) for d in (a, b))
    paths = (d / "checkpoints" / "last.ckpt" for d in (a, b))
    wa, wb = (torch.load(p, map_location="cpu", weights_only=False)["state_dict"] for p in paths)
    return ra == rb, wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", help="the other side: a commit (checked out as a git worktree)")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {', '.join(JOBS)}")
    ap.add_argument("--out", type=Path, default=Path("/tmp/same_seed_ab"))
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    base = args.out / "tree"
    if not base.exists():
        subprocess.run(["git", "worktree", "add", "-f", str(base), args.commit], cwd=ROOT, check=True)
    ok = True
    for name in args.jobs.split(","):
        runs = {side: args.out / side / name for side in ("base", "new")}
        trained = all(
            train(code, JOBS[name], runs[side], args.core) for side, code in (("base", base), ("new", ROOT))
        )
        if not trained:
            ok = False
            print(f"{name}: FAILED to train (logs in {args.out})", flush=True)
            continue
        metrics, weights = same(runs["base"], runs["new"])
        ok &= metrics and weights
        word = {True: "EQUAL", False: "DIFFER"}
        print(f"{name}: metrics {word[metrics]}, weights {word[weights]}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
