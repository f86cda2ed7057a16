"""Run files written in place (the run dir's lock and owner record, an evaluation's lock) through the
real mains, in-process: a symlink planted there is refused without touching what it points to, a FIFO
there is refused instead of hanging, and a lock held by a stopped evaluation is refused after a bounded
wait with a line naming its holder (pid, host, command, since when).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_cases import assert_clean_failure, eval_cli, train_cli

OUTSIDE = b"a file outside the run: must never be truncated\n"


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body runs longer than ``seconds``."""

    def expired(*_: object) -> None:
        raise AssertionError(f"still running after {seconds} s: the command hangs")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(OUTSIDE)
    return target


def test_symlink_at_the_run_lock_is_refused_and_its_target_kept(
    tmp_path, outside, cache_dir, monkeypatch, capsys
):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".posformer.lock").symlink_to(outside)
    code, text = train_cli([], run, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, ".posformer.lock", "is a symlink")
    (line,) = [ln for ln in text.splitlines() if "is a symlink" in ln]
    assert str(outside) in line and "hydra.run.dir=" in line
    assert outside.read_bytes() == OUTSIDE
    assert not (run / "checkpoints").exists() and not (run / "results.json").exists()


def test_symlink_at_the_owner_record_is_refused(tmp_path, outside, cache_dir, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".posformer.run.json").symlink_to(outside)
    code, text = train_cli([], run, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, ".posformer.run.json", "is a symlink")
    assert outside.read_bytes() == OUTSIDE
    assert not (run / "checkpoints").exists()


def test_fifo_at_the_owner_record_is_refused_not_waited_on(tmp_path, cache_dir, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / ".posformer.run.json")
    with deadline(120):
        code, text = train_cli([], run, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, ".posformer.run.json", "is a special file (FIFO")
    assert not (run / "checkpoints").exists()


def test_fifo_at_the_run_lock_is_refused_not_waited_on(tmp_path, cache_dir, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / ".posformer.lock")
    with deadline(120):
        code, text = train_cli([], run, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, ".posformer.lock", "is a special file (FIFO")


def test_symlink_at_the_eval_lock_is_refused(tiny_checkpoint, tmp_path, outside, monkeypatch, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    (out / ".posformer-eval.lock").symlink_to(outside)
    code, text = eval_cli(
        [f"eval.checkpoints=[{tiny_checkpoint}]", "eval.lengths=[4]"], out, monkeypatch, capsys
    )
    assert_clean_failure(code, text, ".posformer-eval.lock", "is a symlink")
    assert outside.read_bytes() == OUTSIDE


HOLD_AND_STOP = """
import os, signal, sys
from pathlib import Path
from posformer.eval.store import locked
with locked(Path(sys.argv[1])):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.slow
def test_lock_of_a_stopped_evaluation_times_out_naming_its_holder(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    from posformer.eval import store

    out = tmp_path / "eval"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(store.__file__).parents[2])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_STOP, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # then it stops itself, still holding the lock
        monkeypatch.setattr(store, "LOCK_WAIT", 0.5)
        with deadline(120):
            code, text = eval_cli(
                [f"eval.checkpoints=[{tiny_checkpoint}]", "eval.lengths=[4]"], out, monkeypatch, capsys
            )
    finally:
        holder.kill()
        holder.wait()
    assert_clean_failure(
        code, text, "is locked by another evaluation", f"pid {holder.pid}", "for over 0.5 s", "kill -CONT"
    )
    assert "command " in text and "since " in text and "eval.output_dir" in text
    assert not (out / "extrapolation.json").exists()


def test_run_lock_names_its_holder(tmp_path):
    from posformer.lit.lifecycle import RunLock

    with RunLock(tmp_path):
        record = (tmp_path / ".posformer.lock").read_text()
        assert f"pid {os.getpid()}" in record and "command " in record and "since " in record
        with pytest.raises(Exception, match=r"in use by a running posformer-train \(pid \d+ on .*command"):
            RunLock(tmp_path).__enter__()
    assert (tmp_path / ".posformer.lock").read_text() == ""
