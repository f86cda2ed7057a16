"""A resumable job queue for the study scripts: one ``posformer-train`` process per run, pinned to a core.

A study is hours of CPU; a session, a reboot or a Ctrl-C must not cost the runs already done. Every
training run is a :class:`Job` with its own run dir under the sweep dir. :func:`run_jobs` starts them
on ``cores`` (one process per core, ``taskset -c <core>``, ``OMP_NUM_THREADS=1``, niced) and decides
what each needs from what its run dir holds:

- ``results.json`` present: finished, skipped;
- ``checkpoints/last.ckpt`` present: resumed exactly (``ckpt_path=``; a checkpoint already at
  ``trainer.max_steps`` was killed during its final writes: ``train=false`` only evaluates it);
- otherwise: started from scratch.

SIGINT/SIGTERM to the queue is passed on to the running jobs, which save a resumable ``last.ckpt``
(:mod:`posformer.lit.lifecycle`) and exit; re-running the same study command continues. Logs are
appended (``<sweep>/logs/<job>.log``), so a resumed run's log keeps its history, and every
invocation's wall time and exit status go to ``<sweep>/logs/<job>.jsonl`` (:func:`wall_seconds`).

    jobs = [Job(f"{i}_{pe}_s{s}", [f"pe={pe}", f"seed={s}"]) for i, (pe, s) in enumerate(grid)]
    run_jobs(jobs, sweep_dir, common_overrides, cores=[0, 1])
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from posformer.io import atomic_write_json

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@dataclass
class Job:
    """One training run: ``name`` is its run dir under the sweep dir; ``overrides``: its own overrides."""

    name: str
    overrides: list[str]
    max_steps: int | None = None  # trainer.max_steps of this job (None: read from the overrides)
    seconds: float = field(default=0.0, init=False)  # wall time of this invocation (0 when skipped)


def job_state(run_dir: Path) -> str:
    """``done`` | ``resume`` | ``new``, from what ``run_dir`` holds (see the module docstring)."""
    if (run_dir / "results.json").is_file():
        return "done"
    if (run_dir / "checkpoints" / "last.ckpt").is_file():
        return "resume"
    return "new"


def checkpoint_step(path: Path) -> int:
    """``global_step`` stored in a Lightning checkpoint."""
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return int(ckpt.get("global_step", 0) or 0)


def _max_steps(job: Job, common: list[str]) -> int | None:
    if job.max_steps is not None:
        return job.max_steps
    for o in reversed([*common, *job.overrides]):
        if o.startswith("trainer.max_steps="):
            return int(o.split("=", 1)[1])
    return None


def job_command(job: Job, run_dir: Path, common: list[str]) -> list[str]:
    """The ``posformer-train`` command that starts, resumes or finishes ``job`` in ``run_dir``."""
    cmd = [str(VENV_BIN / "posformer-train"), *common, *job.overrides, f"hydra.run.dir={run_dir}"]
    if job_state(run_dir) == "resume":
        last = run_dir / "checkpoints" / "last.ckpt"
        cmd.append(f"ckpt_path={last}")
        limit = _max_steps(job, common)
        if limit is not None and checkpoint_step(last) >= limit:
            cmd.append("train=false")  # trained to the end; killed while evaluating or writing results
    return cmd


def _launch(cmd: list[str], core: int | None, log: Path, nice: int) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    prefix: list[str] = []
    if core is not None and shutil.which("taskset"):
        prefix += ["taskset", "-c", str(core)]
    if nice:
        prefix += ["nice", "-n", str(nice)]
    f = open(log, "a")  # noqa: SIM115 - closed by the caller when the process ends
    f.write(f"\n$ {' '.join(cmd)}    # {time.strftime('%Y-%m-%d %H:%M:%S')} core {core}\n")
    f.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        prefix + cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
    )
    proc.log_file = f  # type: ignore[attr-defined]
    return proc


def run_jobs(
    jobs: list[Job],
    sweep_dir: Path,
    common: list[str],
    cores: list[int | None] | None = None,
    nice: int = 10,
    recorded: set[str] | frozenset[str] = frozenset(),
    launch_until: float | None = None,
) -> float:
    """Run every unfinished job, ``len(cores)`` at a time; returns the summed training wall time of
    this call (seconds). Raises ``SystemExit`` naming the failed jobs and their logs after the others ran.

    ``recorded``: names of jobs finished elsewhere (a study's committed ledger, :mod:`study_ledger`),
    skipped like a run dir with ``results.json``. ``launch_until``: a ``time.time()`` after which no job
    is started; the running ones finish and the call returns normally, the rest left for the next call.
    """
    cores = list(cores) if cores else [None]
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise SystemExit(
            f"duplicate job names in the study: {sorted({n for n in names if names.count(n) > 1})}"
        )
    todo = [j for j in jobs if j.name not in recorded and job_state(sweep_dir / j.name) != "done"]
    print(
        f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished in {sweep_dir}; {len(todo)} to run "
        f"on cores {cores}",
        flush=True,
    )
    free, running, failed = list(cores), {}, []
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    total = 0.0
    try:
        while (todo and not stopping and not _past(launch_until)) or running:
            while todo and free and not stopping and not _past(launch_until):
                job, core = todo.pop(0), free.pop(0)
                run_dir = sweep_dir / job.name
                cmd = job_command(job, run_dir, common)
                print(
                    f"[{time.strftime('%H:%M:%S')}] core {core}: {job.name} ({job_state(run_dir)})",
                    flush=True,
                )
                running[_launch(cmd, core, sweep_dir / "logs" / f"{job.name}.log", nice)] = (
                    job,
                    core,
                    time.perf_counter(),
                )
            time.sleep(1.0)
            for proc in [p for p in running if p.poll() is not None]:
                job, core, t0 = running.pop(proc)
                proc.log_file.close()  # type: ignore[attr-defined]
                job.seconds = time.perf_counter() - t0
                total += job.seconds
                record_invocation(sweep_dir, job.name, core, job.seconds, proc.returncode)
                free.append(core)
                status = "done" if proc.returncode == 0 else f"exit {proc.returncode}"
                print(
                    f"[{time.strftime('%H:%M:%S')}] core {core}: {job.name} {status} in {job.seconds:.0f}s",
                    flush=True,
                )
                if proc.returncode and not stopping:
                    failed.append(job.name)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if todo and _past(launch_until) and not stopping:
        print(f"launch window over: {len(todo)} run(s) left for the next call", flush=True)
    if stopping:
        raise SystemExit(
            f"interrupted ({signal.Signals(stopping[0]).name}): the running jobs saved resumable "
            "checkpoints; run the same command again to continue"
        )
    if failed:
        logs = ", ".join(str(sweep_dir / "logs" / f"{n}.log") for n in failed)
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}; logs: {logs}")
    return total


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def record_invocation(sweep_dir: Path, name: str, core: int | None, seconds: float, returncode: int) -> None:
    """Append one invocation of job ``name`` to ``<sweep>/logs/<name>.jsonl`` (wall seconds, exit
    status, core): a resumed run's training time is the sum of its invocations."""
    entry = {
        "ended": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": round(seconds, 1),
        "returncode": returncode,
        "core": core,
    }
    with open(sweep_dir / "logs" / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def wall_seconds(sweep_dir: Path) -> tuple[float, int]:
    """Summed wall seconds of every recorded invocation under ``sweep_dir`` and their count."""
    total, n = 0.0, 0
    for path in (sweep_dir / "logs").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            total += json.loads(line)["seconds"]
            n += 1
    return total, n


def parse_cores(text: str) -> list[int | None]:
    """``"0,1"`` -> ``[0, 1]``; ``"none"`` -> one unpinned worker; ``"2"``-style counts are not cores."""
    if text.lower() in ("none", ""):
        return [None]
    cores = [int(c) for c in text.split(",")]
    avail = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    bad = [c for c in cores if c not in avail]
    if bad:
        raise SystemExit(
            f"--cores {text}: core(s) {bad} not available to this process (available: {sorted(avail)})"
        )
    return cores


# ------------------------------------------------------------------------------------------ commands
def run(cmd: list[str], log: Path, nice: int = 10) -> float:
    """Run ``cmd`` (niced), output to ``log``; raise with the log's tail on failure. Returns seconds."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full = (["nice", "-n", str(nice)] if nice else []) + cmd
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(
            full,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            },
        )
    dt = time.perf_counter() - t0
    if proc.returncode:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(
            f"command failed ({proc.returncode}) after {dt:.0f}s, log {log}:\n" + "\n".join(tail)
        )
    print(f"  done in {dt:.0f}s (log: {log})", flush=True)
    return dt


def eval_sweep(sweep_dir: Path, out_dir: Path, extra: list[str], log_name: str = "eval.log") -> float:
    """Evaluate every run of ``sweep_dir`` with ``posformer-eval`` into ``out_dir``; returns seconds.

    Skipped when ``out_dir`` already holds the results of the same arguments over the same finished
    runs with the same package code (``eval_stamp.json``: the arguments, every run's ``results.json``
    modification time and a hash of ``posformer/``), so re-running a study after an interruption
    does not redo a finished evaluation. The seconds returned are then those of the recorded one."""
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
    seconds = run(args, out_dir.parent / log_name)
    atomic_write_json(stamp, {"inputs": inputs, "seconds": seconds}, indent=1)
    return seconds


def finished_runs(sweep_dir: Path) -> dict[str, int]:
    """Run name -> modification time (ns) of its ``results.json``, for every finished run of the sweep."""
    return {p.parent.name: p.stat().st_mtime_ns for p in sorted(sweep_dir.glob("*/results.json"))}


def package_hash() -> str:
    """SHA-256 over the source files of the ``posformer`` package (paths and contents)."""
    import hashlib

    import posformer

    pkg = Path(posformer.__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(pkg.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".yaml"):
            h.update(str(path.relative_to(pkg)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()
