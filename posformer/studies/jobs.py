"""A resumable job queue for the studies: one ``posformer-train`` process per run, pinned to a core.

A study is hours of CPU; a lost machine, a reboot or a Ctrl-C must not cost the runs already done. Every
training run is a :class:`Job` with its own run dir under the sweep dir. :func:`run_jobs` starts them
on ``cores`` (one process per core, ``taskset -c <core>``, ``OMP_NUM_THREADS=1``, niced) and decides
what each needs from what its run dir holds:

- ``results.json`` present: finished, skipped;
- ``checkpoints/last.ckpt`` present: resumed exactly (``ckpt_path=``; a checkpoint already at
  ``trainer.max_steps`` was killed during its final writes: ``train=false`` only evaluates it);
- otherwise: started from scratch.

SIGINT/SIGTERM to the queue is passed on to the running jobs, which save a resumable ``last.ckpt``
(:mod:`posformer.lit.lifecycle`) and exit; the queue then stops with
:class:`~posformer.errors.Interrupted` (exit status 128 + signal), and re-running the same study command
continues. Logs are appended (``<sweep>/logs/<job>.log``), so a resumed run's log keeps its history,
and every invocation's wall time and exit status go to ``<sweep>/logs/<job>.jsonl``
(:func:`wall_seconds`).

    jobs = [Job(f"{i}_{pe}_s{s}", [f"pe={pe}", f"seed={s}"]) for i, (pe, s) in enumerate(grid)]
    run_jobs(jobs, sweep_dir, common_overrides, cores=[0, 1])

:func:`train_sweep` builds the jobs of a grid of overrides (``{"pe": [...], "seed": [...]}``) and runs them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from posformer.checkpoints import checkpoint_step
from posformer.errors import Interrupted
from posformer.studies.common import QUIET, VENV_BIN, StudyError, project_root

__all__ = [
    "Job",
    "job_command",
    "job_state",
    "parse_cores",
    "record_invocation",
    "run_jobs",
    "sweep_jobs",
    "train_sweep",
    "train_wall",
    "wall_seconds",
]


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


def _max_steps(job: Job, common: list[str]) -> int | None:
    """The job's ``trainer.max_steps``: its own field, else the last such override."""
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


def _launch(
    cmd: list[str], core: int | None, log: Path, nice: int, cwd: Path
) -> tuple[subprocess.Popen, IO[str]]:
    """Start ``cmd`` pinned to ``core`` and niced, appending its output to ``log``; returns the process
    and the open log file (the caller closes it when the process ends)."""
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
        prefix + cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True
    )
    return proc, f


#: what :func:`run_jobs` calls when a job has finished training: ``on_done(job, core)``
OnDone = Callable[["Job", "int | None"], None]


class _Queue:
    """The running side of :func:`run_jobs`: free cores, running processes, failures, signals seen."""

    def __init__(
        self,
        sweep_dir: Path,
        common: list[str],
        cores: list[int | None],
        nice: int,
        cwd: Path,
        on_done: OnDone | None = None,
    ) -> None:
        self.sweep_dir, self.common, self.nice, self.cwd = sweep_dir, common, nice, cwd
        self.on_done = on_done
        self.free = list(cores)
        self.running: dict[subprocess.Popen, tuple[Job, int | None, float, IO[str]]] = {}
        self.failed: list[str] = []
        self.stopping: list[int] = []
        self.total = 0.0

    def forward(self, signum: int, _frame: object) -> None:
        """Signal handler: remember the signal and pass it on to every running job."""
        self.stopping.append(signum)
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signum)

    def accepting(self, launch_until: float | None) -> bool:
        """Whether a new job may start: no signal seen and the launch window not over."""
        return not self.stopping and not _past(launch_until)

    def start(self, job: Job) -> None:
        """Start (or resume, or finish) ``job`` on the first free core."""
        core = self.free.pop(0)
        run_dir = self.sweep_dir / job.name
        cmd = job_command(job, run_dir, self.common)
        print(f"[{time.strftime('%H:%M:%S')}] core {core}: {job.name} ({job_state(run_dir)})", flush=True)
        log = self.sweep_dir / "logs" / f"{job.name}.log"
        proc, log_file = _launch(cmd, core, log, self.nice, self.cwd)
        self.running[proc] = (job, core, time.perf_counter(), log_file)

    def reap(self) -> None:
        """Collect the jobs that ended: record their invocation, free their core, note failures."""
        for proc in [p for p in self.running if p.poll() is not None]:
            job, core, t0, log = self.running.pop(proc)
            log.close()
            job.seconds = time.perf_counter() - t0
            self.total += job.seconds
            record_invocation(self.sweep_dir, job.name, core, job.seconds, proc.returncode)
            status = "done" if proc.returncode == 0 else f"exit {proc.returncode}"
            print(
                f"[{time.strftime('%H:%M:%S')}] core {core}: {job.name} {status} in {job.seconds:.0f}s",
                flush=True,
            )
            if proc.returncode and not self.stopping:
                self.failed.append(job.name)
            elif self.on_done and job_state(self.sweep_dir / job.name) == "done" and not self.stopping:
                try:  # on the core the job freed, before another job takes it
                    self.on_done(job, core)
                except StudyError as e:
                    print(f"error: {job.name}: {e}", flush=True)
                    self.failed.append(job.name)
            self.free.append(core)


def run_jobs(
    jobs: list[Job],
    sweep_dir: Path,
    common: list[str],
    cores: list[int | None] | None = None,
    nice: int = 10,
    recorded: set[str] | frozenset[str] = frozenset(),
    launch_until: float | None = None,
    on_done: OnDone | None = None,
) -> float:
    """Run every unfinished job, ``len(cores)`` at a time; returns the summed training wall time of
    this call (seconds). Raises :class:`StudyError` naming the failed jobs and their logs after the
    others ran, :class:`~posformer.errors.Interrupted` after SIGINT/SIGTERM.

    ``recorded``: names of jobs finished elsewhere (a study's committed ledger,
    :mod:`posformer.studies.ledger`), skipped like a run dir with ``results.json``. ``launch_until``: a
    ``time.time()`` after which no job is started; the running ones finish and the call returns
    normally, the rest left for the next call. ``on_done(job, core)``: called when a job finishes
    training, on the core it ran on, before another job takes that core (a study evaluates and records
    the run there, so a finished run is recorded even if the queue is stopped later); a
    :class:`StudyError` from it counts the job as failed. The jobs run in
    :func:`~posformer.studies.common.project_root`.
    """
    cores = list(cores) if cores else [None]
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise StudyError(f"duplicate job names in the study: {twice}")
    todo = [j for j in jobs if j.name not in recorded and job_state(sweep_dir / j.name) != "done"]
    print(
        f"{len(jobs) - len(todo)} of {len(jobs)} runs already finished in {sweep_dir}; {len(todo)} to run "
        f"on cores {cores}",
        flush=True,
    )
    queue = _Queue(sweep_dir, common, cores, nice, project_root(), on_done)
    old = {s: signal.signal(s, queue.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (todo and queue.accepting(launch_until)) or queue.running:
            while todo and queue.free and queue.accepting(launch_until):
                queue.start(todo.pop(0))
            time.sleep(1.0)
            queue.reap()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if todo and _past(launch_until) and not queue.stopping:
        print(f"launch window over: {len(todo)} run(s) left for the next call", flush=True)
    if queue.stopping:
        signum = queue.stopping[0]
        raise Interrupted(
            signum,
            f"interrupted ({signal.Signals(signum).name}): the running jobs saved "
            "resumable checkpoints; run the same command again to continue",
        )
    if queue.failed:
        logs = ", ".join(str(sweep_dir / "logs" / f"{n}.log") for n in queue.failed)
        raise StudyError(f"{len(queue.failed)} run(s) failed: {', '.join(queue.failed)}; logs: {logs}")
    return queue.total


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


def train_wall(out: Path, tag: str = "train") -> str:
    """The summed wall time of every training invocation of the study in ``out`` (one core each)."""
    seconds, n = wall_seconds(out / tag)
    return f"{seconds:.0f} s summed over {n} process runs (one core each, run side by side)"


def parse_cores(text: str) -> list[int | None]:
    """``"0,1"`` -> ``[0, 1]``; ``"none"`` -> one unpinned worker; cores this process may not use are
    refused."""
    if text.lower() in ("none", ""):
        return [None]
    cores = [int(c) for c in text.split(",")]
    avail = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    bad = [c for c in cores if c not in avail]
    if bad:
        raise StudyError(
            f"--cores {text}: core(s) {bad} not available to this process (available: {sorted(avail)})"
        )
    return cores


def sweep_jobs(sweep: dict[str, list[Any]] | list[dict[str, Any]]) -> list[Job]:
    """The jobs of the product of ``sweep`` (or of each overrides dict of a list), named
    ``<i>_<pe>[_<flag>...]_s<seed>``: a flag is the last part of every other key, followed by its value
    (``positions.randomized=true`` -> ``randomized``; ``false`` values are left out)."""
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
    return jobs


def train_sweep(
    out: Path,
    common: list[str],
    sweep: dict[str, list[Any]] | list[dict[str, Any]],
    tag: str = "train",
    cores: list[int | None] | None = None,
    recorded: set[str] | frozenset[str] = frozenset(),
    launch_until: float | None = None,
    on_done: OnDone | None = None,
) -> float:
    """Train the jobs of ``sweep`` (:func:`sweep_jobs`; run dirs ``out/<tag>/<name>``) with the resumable
    queue: finished runs are skipped, interrupted ones resume; ``recorded``, ``launch_until`` and
    ``on_done``: see :func:`run_jobs`. Returns seconds."""
    fixed = [f"paths.log_dir={out}", "evaluate=false", *QUIET, *common]
    return run_jobs(
        sweep_jobs(sweep),
        out / tag,
        fixed,
        cores=cores,
        recorded=recorded,
        launch_until=launch_until,
        on_done=on_done,
    )
