"""The studies' resumable job queue (:mod:`posformer.studies.jobs`): what a run dir's files make of a job
(new / resume / done), the resume command (``ckpt_path``; ``train=false`` for a checkpoint already at
``max_steps``), and real tiny runs: a queue interrupted by SIGTERM keeps its runs' checkpoints, and
running it again resumes them and then skips everything."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from posformer.studies import jobs as study_jobs
from posformer.studies.common import StudyError
from posformer.studies.jobs import Job, job_command, job_state, parse_cores, run_jobs
from tests.cli_cases import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]


def test_job_state_from_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "r"
    assert job_state(run) == "new"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 3}, run / "checkpoints" / "last.ckpt")
    assert job_state(run) == "resume"
    (run / "results.json").write_text("{}")
    assert job_state(run) == "done"


@pytest.mark.parametrize(("step", "evaluate_only"), [(3, False), (10, True)])
def test_resume_command(tmp_path: Path, step: int, evaluate_only: bool) -> None:
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": step}, run / "checkpoints" / "last.ckpt")
    cmd = job_command(Job("r", ["pe=rope"]), run, ["trainer.max_steps=10"])
    assert cmd[-2 if evaluate_only else -1] == f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    assert ("train=false" in cmd) is evaluate_only
    assert f"hydra.run.dir={run}" in cmd and "pe=rope" in cmd
    assert not any(c.startswith("ckpt_path") for c in job_command(Job("n", []), tmp_path / "n", []))


def test_duplicate_names_and_bad_cores_refused(tmp_path: Path) -> None:
    with pytest.raises(StudyError, match="duplicate job names"):
        run_jobs([Job("a", []), Job("a", [])], tmp_path, [])
    with pytest.raises(StudyError, match="not available"):
        parse_cores("0,4096")
    assert parse_cores("none") == [None]


@pytest.mark.slow
def test_interrupted_queue_resumes_then_skips(tmp_path: Path) -> None:
    """SIGTERM to a queue of two real runs: each saves ``last.ckpt`` mid-training; the same call again
    resumes both to ``results.json`` (their logs keep both invocations); a third call runs nothing."""
    sweep = tmp_path / "sweep"
    long = [o for o in TINY_RUN if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    common = [*long, "trainer.max_steps=1000000", "trainer.val_check_interval=1000000", "evaluate=false"]
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from posformer.studies.jobs import Job, run_jobs
        run_jobs([Job("a", ["seed=0"]), Job("b", ["seed=1"])], Path({str(sweep)!r}), {common!r}, [None, None])
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.time() + 120
    logs = [sweep / "logs" / f"{n}.log" for n in "ab"]
    while time.time() < deadline and not all(p.is_file() and "parameters" in p.read_text() for p in logs):
        time.sleep(0.5)
    time.sleep(2)  # into the training loop
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    for n in "ab":
        assert job_state(sweep / n) == "resume", (sweep / "logs" / f"{n}.log").read_text()[-2000:]
    steps = [study_jobs.checkpoint_step(sweep / n / "checkpoints" / "last.ckpt") for n in "ab"]
    assert all(s > 0 for s in steps), steps
    # the same runs, finishing a few steps after the later checkpoint (a shorter schedule, allowed)
    common = [*long, f"trainer.max_steps={max(steps) + 5}", "evaluate=false"]
    assert run_jobs([Job("a", ["seed=0"]), Job("b", ["seed=1"])], sweep, common, [None, None]) > 0
    for n in "ab":
        assert job_state(sweep / n) == "done"
        assert (sweep / "logs" / f"{n}.log").read_text().count("$ ") == 2  # both invocations kept
    assert run_jobs([Job("a", ["seed=0"]), Job("b", ["seed=1"])], sweep, common) == 0.0


@pytest.mark.parametrize(
    ("env", "message"),
    [({"STUDIES": "reverse bogus"}, "STUDIES contains 'bogus'"), ({"LAUNCH_FOR": "1.5"}, "LAUNCH_FOR=1.5")],
)
def test_run_studies_refuses_bad_input_before_any_work(env: dict[str, str], message: str) -> None:
    import os

    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_studies.sh")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr
    assert done.stdout == ""  # no study was started
