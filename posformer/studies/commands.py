"""One-off commands of the studies: a logged subprocess (:func:`run`) and a skippable evaluation of a
whole sweep (:func:`eval_sweep`).

The training runs go through the queue of :mod:`posformer.studies.jobs`; everything else a study runs
(``posformer-eval`` over a sweep or a list of checkpoints, a translation, a fine-tune) is one
:func:`run`: niced, its output in a log file, a failure reported with the log's last lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from posformer.io import atomic_write_json
from posformer.studies.common import VENV_BIN, StudyError, project_root

__all__ = ["eval_sweep", "finished_runs", "package_hash", "run"]

#: lines of a failed command's log shown before its error line
TAIL_LINES = 30


def run(cmd: list[str], log: Path, nice: int = 10, core: int | None = None) -> float:
    """Run ``cmd`` (niced; pinned to ``core`` if given) in :func:`~posformer.studies.common.project_root`,
    its output to ``log``; returns its seconds. On failure the log's last lines go to stderr and a
    :class:`StudyError` names the exit status and the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    pin = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    full = pin + (["nice", "-n", str(nice)] if nice else []) + cmd
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(full, stdout=f, stderr=subprocess.STDOUT, cwd=project_root(), env=env)
    dt = time.perf_counter() - t0
    if proc.returncode:
        tail = log.read_text().splitlines()[-TAIL_LINES:]
        print("\n".join([f"--- last lines of {log}:", *tail, "---"]), file=sys.stderr, flush=True)
        raise StudyError(
            f"command failed (exit {proc.returncode}) after {dt:.0f}s: {cmd[0]}; "
            f"its log (last lines above): {log}"
        )
    print(f"  done in {dt:.0f}s (log: {log})", flush=True)
    return dt


def eval_sweep(
    sweep_dir: Path, out_dir: Path, extra: list[str], log_name: str = "eval.log", core: int | None = None
) -> float:
    """Evaluate every run of ``sweep_dir`` with ``posformer-eval`` into ``out_dir``; returns seconds.

    Skipped when ``out_dir`` already holds the results of the same arguments over the same finished
    runs with the same package code (``eval_stamp.json``: the arguments, every run's ``results.json``
    modification time and a hash of ``posformer/``), so re-running a study after an interruption
    does not redo a finished evaluation. The seconds returned are then those of the recorded one.
    ``core``: the core to pin the evaluation to (:func:`run`)."""
    args = [
        str(VENV_BIN / "posformer-eval"),
        f"eval.sweep_dir={sweep_dir}",
        f"eval.output_dir={out_dir}",
        f"paths.log_dir={out_dir}",
        "eval.progress=false",
        "eval.which=last",
        *extra,
    ]
    stamp = out_dir / "eval_stamp.json"
    inputs = {"args": args[1:], "runs": finished_runs(sweep_dir), "code": package_hash()}
    try:
        old = json.loads(stamp.read_text()) if (out_dir / "extrapolation.json").is_file() else None
    except (OSError, ValueError):
        old = None
    if old and old.get("inputs") == inputs:
        print(
            f"  up to date: {out_dir} (evaluated in {old['seconds']:.0f}s; delete {stamp} to redo)",
            flush=True,
        )
        return float(old["seconds"])
    stamp.unlink(missing_ok=True)  # a failed evaluation below leaves no stamp of an older one
    seconds = run(args, out_dir.parent / log_name, core=core)
    atomic_write_json(stamp, {"inputs": inputs, "seconds": seconds}, indent=1)
    return seconds


def finished_runs(sweep_dir: Path) -> dict[str, int]:
    """Run name -> modification time (ns) of its ``results.json``, for every finished run of the sweep."""
    return {p.parent.name: p.stat().st_mtime_ns for p in sorted(sweep_dir.glob("*/results.json"))}


def package_hash() -> str:
    """SHA-256 over the source files of the ``posformer`` package (paths and contents)."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(pkg.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".yaml"):
            h.update(str(path.relative_to(pkg)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()
