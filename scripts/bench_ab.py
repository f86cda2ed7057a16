"""Before/after of a code change in one run: the benchmark's training step at two git revisions, alternated.

    python scripts/bench_ab.py --before 4af2c5d --pes alibi,t5,kerple,fire,shaw --reps 7 --threads 1
    python scripts/bench_ab.py --before HEAD~2 --after HEAD --pes t5 --out outputs/ab

Each revision is checked out into a temporary git worktree (``--after`` defaults to this working tree,
uncommitted changes included) and gets one worker process with that tree first on ``PYTHONPATH``. The
workers build posformer's benchmark model (:func:`posformer.bench.models.posformer_model`, the
:class:`posformer.bench.measure.Trainer` step: forward, cross-entropy, backward, AdamW) and time one
step each when asked, in turn, so machine noise hits both; the order flips every repetition. Only one
worker runs at a time, so both can use the same cores. Reported: the medians of each side's tokens/s
and of the per-repetition ratios after/before; ``ab.json`` (every repetition, revisions, machine) and
``ab.md`` in ``--out``. Each side runs its own code as it is, e.g. its own denormal setting.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from posformer.utils.format import markdown_table

ROOT = Path(__file__).resolve().parents[1]

#: the worker: one JSON command per stdin line, one JSON answer per stdout line
WORKER = r"""
import json, sys, torch
import posformer
print(json.dumps({"imported": posformer.__file__}), flush=True)
from posformer.bench.config import BenchConfig
from posformer.bench.measure import Trainer
from posformer.bench.models import posformer_model
sizes = json.loads(sys.argv[1])
torch.set_num_threads(sizes.pop("threads"))
cfg = BenchConfig(**sizes)
trainer = None
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["do"] == "build":
        torch.manual_seed(0)
        model = posformer_model(cmd["pe"], cfg, cfg.d_model, cfg.seq_len)
        trainer = Trainer(model, cfg, torch.device("cpu"), torch.float32, cfg.batch, cfg.seq_len)
        answer = {"built": cmd["pe"]}
    elif cmd["do"] == "warmup":
        trainer.step()
        answer = {"warm": True}
    else:
        answer = {"tok_s": trainer.timed()[0]}
    print(json.dumps(answer), flush=True)
"""


class Worker:
    """One revision's benchmark process."""

    def __init__(self, tree: Path, sizes: dict, threads: int):
        # threads through torch.set_num_threads only, as posformer-train's torch_threads does
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(tree)}
        # -P: no current directory on sys.path (``-c`` would put it first: this tree's posformer)
        args = [sys.executable, "-P", "-c", WORKER, json.dumps({**sizes, "threads": threads})]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.tree = tree

    def check_tree(self) -> None:
        """Exit with one line unless the worker imported posformer from its own tree."""
        where = Path(json.loads(self.proc.stdout.readline())["imported"]).resolve()
        if not where.is_relative_to(self.tree.resolve()):
            raise SystemExit(f"bench_ab.py: the worker for {self.tree} imported posformer from {where}")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_ab.py: a worker exited (status {self.proc.wait()}); see its error above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def describe(rev: str | None) -> str:
    """A revision's short hash (``None``: this working tree), or exit with one line if it is unknown."""
    if rev is None:
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        return f"working tree ({head}{' + changes' if dirty else ''})"
    out = git("rev-parse", "--short", rev)
    if out.returncode:
        raise SystemExit(f"bench_ab.py: {rev!r} is not a git revision of {ROOT} ({out.stderr.strip()})")
    return out.stdout.strip()


def checkout(rev: str, where: Path) -> Path:
    tree = where / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True)
    return tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the 'before' side")
    p.add_argument(
        "--after", default=None, help="git revision of the 'after' side (default: the working tree)"
    )
    p.add_argument("--pes", default="alibi,t5", help="comma list of PEs")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    for name, default in (("d-model", 256), ("n-layers", 4), ("n-heads", 4), ("seq-len", 512), ("batch", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--out", default="bench_ab_out", help="folder for ab.json and ab.md")
    a = p.parse_args()
    for flag, value, low in (("--reps", a.reps, 1), ("--warmup", a.warmup, 0), ("--threads", a.threads, 1)):
        if value < low:
            raise SystemExit(f"bench_ab.py: {flag} {value} must be >= {low}")
    revs = {"before": describe(a.before), "after": describe(a.after)}
    sizes = {k: getattr(a, k) for k in ("d_model", "n_layers", "n_heads", "seq_len", "batch")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:
        trees = {"before": checkout(a.before, Path(tmp))}
        trees["after"] = checkout(a.after, Path(tmp)) if a.after else ROOT
        try:
            results = run(trees, sizes, a)
        finally:
            for side in ("before", "after"):
                if trees[side] != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(trees[side])], cwd=ROOT)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    record = {"revisions": revs, "sizes": sizes, "threads": a.threads, "reps": a.reps, "machine": machine}
    record["pes"] = results
    (out / "ab.json").write_text(json.dumps(record, indent=2))
    title = (
        f"before: {revs['before']}; after: {revs['after']}; {a.threads} thread(s), {a.reps} alternated reps"
    )
    rows = [
        {"pe": pe, **r, "per_rep": ", ".join(f"{x:.2f}" for x in r["ratios"])} for pe, r in results.items()
    ]
    cols = [("pe", "PE"), ("before", "before tok/s"), ("after", "after tok/s"), ("ratio", "after / before")]
    cols.append(("per_rep", "per rep"))
    digits, align = {"before": 0, "after": 0, "ratio": 2}, {"pe": "l", "per_rep": "l"}
    table = markdown_table(rows, cols, digits=digits, align=align, thousands=True)
    text = f"{title}\n\n{table}"
    (out / "ab.md").write_text(text)
    print(text, end="")
    print(f"wrote {out / 'ab.json'} and {out / 'ab.md'}")


def run(trees: dict[str, Path], sizes: dict, a: argparse.Namespace) -> dict:
    workers = {side: Worker(tree, sizes, a.threads) for side, tree in trees.items()}
    results = {}
    try:
        for w in workers.values():
            w.check_tree()
        for pe in [x for x in a.pes.split(",") if x]:
            tok: dict[str, list[float]] = {"before": [], "after": []}
            for w in workers.values():
                w.ask(do="build", pe=pe)
                for _ in range(a.warmup):
                    w.ask(do="warmup")
            for rep in range(a.reps):
                for side in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                    tok[side].append(workers[side].ask(do="step")["tok_s"])
            ratios = [x / y for x, y in zip(tok["after"], tok["before"])]
            r = {side: statistics.median(tok[side]) for side in ("before", "after")}
            results[pe] = {**r, "ratio": statistics.median(ratios), "ratios": ratios, "tok_s": tok}
            print(
                f"{pe}: before {r['before']:.0f} tok/s, after {r['after']:.0f} (x{results[pe]['ratio']:.2f})"
            )
    finally:
        for w in workers.values():
            w.close()
    return results


if __name__ == "__main__":
    main()
