"""The run lifecycle: signals, the run-dir lock, nothing already written lost,
operating-system faults. Every case goes through ``posformer.cli.train.main`` (or
``posformer.cli.evaluate.main``) in-process with ``sys.argv`` patched, and checks the exit status, no
traceback, one line naming the value / limit / fix, and that the run dir's earlier files are
byte-identical afterwards. The SIGTERM -> resume bitwise test is
``tests/lit/test_reliability.py::test_kill_then_resume_equals_uninterrupted_run[SIGTERM]``.
docs/reliability.md ("Run lifecycle") maps each guarantee to its test.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.cli_cases import TINY_RUN, one_clear_line

#: conftest's tiny run (the ``tiny_run_dir`` fixture was trained with these): 4 steps, validation at 4
TINY = TINY_RUN


# ------------------------------------------------------------------------------------------ helpers
def _call(entry, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """Run a console-script entry point in-process; returns (exit code, stdout + stderr)."""
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code = 0
    try:
        entry()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def train(run: Path | None, cache: Path, args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``posformer-train`` + TINY + the run dir + ``args`` (``run=None``: ``args`` is the whole command)."""
    from posformer.cli.train import main

    if run is None:
        return _call(main, ["posformer-train", *args], monkeypatch, capsys)
    argv = ["posformer-train", *TINY, f"hydra.run.dir={run}", f"paths.root_dir={run.parent}"]
    return _call(main, [*argv, f"paths.cache_dir={cache}", "torch_threads=1", *args], monkeypatch, capsys)


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file under ``run`` and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def assert_kept(before: dict[str, bytes], run: Path, *, except_: tuple[str, ...] = ()) -> None:
    """Every file of ``before`` is still there, byte-identical (``except_``: files the run may rewrite)."""
    after = snapshot(run)
    for name, data in before.items():
        if name in except_:
            continue
        assert after.get(name) == data, f"{name} changed or vanished"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def earlier(tiny_run_dir, tmp_path) -> Path:
    """A copy of a finished tiny run (4 steps: config.yaml, results.*, checkpoints/last.ckpt)."""
    run = tmp_path / "earlier"
    shutil.copytree(tiny_run_dir, run)
    return run


class SendSignal(Callback):
    """Test-only: the process signals itself at the start of training step ``at``."""

    def __init__(self, at: int = 2, signum: int = int(signal.SIGTERM)):
        self.at, self.signum = at, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), self.signum)


class OOMAtStep(Callback):
    """Test-only: the forward pass of training step ``at`` runs out of memory."""

    def __init__(self, at: int = 5):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


# ------------------------------------------------------------------------------------------ 1. signals
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_resumable_checkpoint_and_prints_resume_command(
    signum, status, tmp_path, cache, monkeypatch, capsys
):
    """A signal in step 2 (of 4): last.ckpt at step 3 (the end of that step), one line with the resume
    command, exit 128 + signum; the printed command resumes the run to its end."""
    from posformer.checkpoints import safe_load_checkpoint

    # the handlers this process had (SIG_IGN for SIGINT when pytest runs as a background job)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    run = tmp_path / "run"
    sig = ["+callbacks.sig._target_=tests.lit.test_lifecycle.SendSignal", "+callbacks.sig.at=2"]
    code, text = train(run, cache, [*sig, f"+callbacks.sig.signum={int(signum)}"], monkeypatch, capsys)
    line = one_clear_line(code, text, status, f"interrupted by {signum.name} at step 3 of 4", "resume with:")
    ckpt = run / "checkpoints" / "last.ckpt"
    assert f"ckpt_path={ckpt}" in line and f"hydra.run.dir={run}" in line and "posformer-train" in line
    assert safe_load_checkpoint(ckpt)["global_step"] == 3
    assert not (run / "results.json").exists()  # the run did not finish: no results pretend it did
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored

    command = shlex.split(line.split("resume with: ", 1)[1])  # exactly as a shell would run it
    code, text = train(
        None, cache, [a for a in command[1:] if not a.startswith("+callbacks.sig")], monkeypatch, capsys
    )
    assert code == 0, text[-3000:]
    assert safe_load_checkpoint(ckpt)["global_step"] == 4
    assert (run / "results.json").is_file()


# ------------------------------------------------------------------------------------------ 2. nothing lost
_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, f"pid {os.getpid()} on testhost, started now".encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_second_run_on_a_locked_run_dir_refuses_then_a_dead_holder_is_no_obstacle(
    earlier, cache, monkeypatch, capsys
):
    """A live holder of the run dir's lock: the run refuses at once (nothing written). SIGKILL the
    holder: its lock is gone with it, and the same command runs."""
    from posformer.lit.lifecycle import LOCK_NAME

    before = snapshot(earlier)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(earlier / LOCK_NAME)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.perf_counter()
        code, text = train(earlier, cache, ["trainer.max_steps=6"], monkeypatch, capsys)
        line = one_clear_line(
            code, text, 1, f"run dir '{earlier}' is in use", f"pid {holder.pid} on testhost"
        )
        assert f"hydra.run.dir={earlier}_2" in line and "leave hydra.run.dir unset" in line
        assert time.perf_counter() - started < 30  # at once: no training, no waiting
        assert_kept(before, earlier, except_=(LOCK_NAME,))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    code, text = train(
        earlier,
        cache,
        [f"ckpt_path={earlier}/checkpoints/last.ckpt", "trainer.max_steps=6"],
        monkeypatch,
        capsys,
    )
    assert code == 0, text[-3000:]


def test_default_run_dir_names_differ_within_one_second():
    """Two runs composed in the same second get different default run dirs (microseconds in the name)."""
    from hydra import compose, initialize_config_module

    dirs = []
    with initialize_config_module("posformer.configs", version_base="1.3"):
        for _ in range(3):
            cfg = compose("train", return_hydra_config=True)
            dirs.append(str(cfg.hydra.run.dir))
    assert len(set(dirs)) == 3, dirs
    assert all(re.search(r"/runs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{6}$", d) for d in dirs), dirs


def test_failed_resume_check_writes_nothing_into_its_run_dir(earlier, cache, monkeypatch, capsys):
    """Resuming into its own run dir with another model (pe=alibi for a rope checkpoint): refused
    before config.yaml is rewritten, so the original config and checkpoint stay usable."""
    before = snapshot(earlier)
    ckpt = earlier / "checkpoints" / "last.ckpt"
    code, text = train(
        earlier, cache, ["pe=alibi", f"ckpt_path={ckpt}", "trainer.max_steps=8"], monkeypatch, capsys
    )
    one_clear_line(code, text, 1, "was trained with a different model", "model.pe: checkpoint='rope'")
    assert_kept(before, earlier)


def test_resuming_a_finished_run_says_so_and_keeps_its_results(earlier, cache, monkeypatch, capsys):
    before = snapshot(earlier)
    ckpt = earlier / "checkpoints" / "last.ckpt"
    code, text = train(earlier, cache, [f"ckpt_path={ckpt}"], monkeypatch, capsys)
    line = one_clear_line(code, text, 1, "is at step 4 and trainer.max_steps=4", "has finished")
    assert "trainer.max_steps=8" in line and "train=false" in line
    assert_kept(before, earlier)


def test_stale_tmp_files_are_removed_by_the_next_run(earlier, cache, monkeypatch, capsys):
    """``.<name>.XXXXXXXX.tmp`` files of writes killed half-way go; a user's own ``notes.tmp`` stays."""
    stale = [earlier / ".results.json.ab12cd34.tmp", earlier / "checkpoints" / ".last.ckpt.x_9yz8w7.tmp"]
    for p in stale:
        p.write_bytes(b"half a file")
    (earlier / "notes.tmp").write_text("mine")
    ckpt = earlier / "checkpoints" / "last.ckpt"
    code, text = train(earlier, cache, [f"ckpt_path={ckpt}", "trainer.max_steps=5"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert not any(p.exists() for p in stale)
    assert (earlier / "notes.tmp").read_text() == "mine"


# ------------------------------------------------------------------------------------------ 3. OS faults
def test_out_of_memory_in_training_names_the_batch_and_keeps_checkpoints(earlier, cache, monkeypatch, capsys):
    before = snapshot(earlier)
    ckpt = earlier / "checkpoints" / "last.ckpt"
    args = [
        f"ckpt_path={ckpt}",
        "trainer.max_steps=8",
        "+callbacks.oom._target_=tests.lit.test_lifecycle.OOMAtStep",
    ]
    code, text = train(earlier, cache, args, monkeypatch, capsys)
    line = one_clear_line(code, text, 1, "out of memory at training step 5", "with a batch of input_ids 16x")
    assert "lower data.batch_size=16 (e.g. data.batch_size=8 trainer.accumulate_grad_batches=2" in line
    assert "Earlier checkpoints are intact" in line
    assert_kept(before, earlier, except_=("config.yaml",))  # the resumed run had started: its config


def _fake_read_only(monkeypatch, root: Path) -> None:
    """Writes under ``root`` fail as on a read-only mount (root ignores chmod, so it is simulated)."""
    import posformer.io as pio

    real = pio.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # noqa: A002 - tempfile's name
        if dir is not None and Path(dir).resolve().is_relative_to(root.resolve()):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(pio.tempfile, "mkstemp", mkstemp)


def test_read_only_checkpoint_dir_is_found_before_any_work(earlier, cache, tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro_checkpoints"
    ro.mkdir()
    _fake_read_only(monkeypatch, ro)
    before = snapshot(earlier)
    ckpt = earlier / "checkpoints" / "last.ckpt"
    args = [f"ckpt_path={ckpt}", "trainer.max_steps=8", f"callbacks.model_checkpoint.dirpath={ro}"]
    code, text = train(earlier, cache, args, monkeypatch, capsys)
    line = one_clear_line(code, text, 1, f"checkpoint directory '{ro}' is not writable", "Read-only file")
    assert "callbacks.model_checkpoint.dirpath=" in line
    assert not (earlier / "checkpoints" / "step000008.ckpt").exists()
    assert_kept(before, earlier)  # config.yaml included: nothing was written


def test_read_only_eval_output_dir_is_found_before_any_work(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from posformer.cli.evaluate import main

    ro = tmp_path / "ro_eval"
    ro.mkdir()
    (ro / "extrapolation.json").write_text('{"earlier": true}\n')
    _fake_read_only(monkeypatch, ro)
    argv = [
        "posformer-eval",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        f"eval.output_dir={ro}",
        f"eval.checkpoints=[{tiny_checkpoint}]",
        "eval.lengths=[4,8]",
        "eval.progress=false",
    ]
    code, text = _call(main, argv, monkeypatch, capsys)
    line = one_clear_line(code, text, 2, f"evaluation output directory '{ro}' is not writable")
    assert "eval.output_dir=/writable/dir" in line and line.startswith("posformer-eval: error:")
    assert (ro / "extrapolation.json").read_text() == '{"earlier": true}\n'


def test_disk_full_names_the_file_and_free_space_and_keeps_earlier_files(earlier, cache, monkeypatch, capsys):
    """The disk fills up when the resumed run saves its next checkpoint (ENOSPC at fsync, as with
    delayed allocation): one line with the file and the free space; the earlier checkpoint and results
    are byte-identical, and no partial file is left."""
    import posformer.io as pio

    real_fsync = pio.os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".ckpt." in name and name.endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(pio.os, "fsync", fsync)
    before = snapshot(earlier)
    ckpt = earlier / "checkpoints" / "last.ckpt"
    code, text = train(earlier, cache, [f"ckpt_path={ckpt}", "trainer.max_steps=8"], monkeypatch, capsys)
    needles = ("cannot write", "No space left on device", "free on that file system")
    line = one_clear_line(code, text, 1, *needles)
    assert re.search(r"cannot write '[^']+\.ckpt'", line) and "paths.log_dir=" in line
    assert re.search(r"\(\d+\.\d (KiB|MiB) to write, [\d.]+ (bytes|KiB|MiB|GiB) free", line), line
    assert_kept(before, earlier, except_=("config.yaml",))
    assert [p.name for p in earlier.rglob("*.tmp")] == []


def _saved_kernel(run: Path) -> tuple[Any, int]:
    from posformer.checkpoints import safe_load_checkpoint

    ckpt = safe_load_checkpoint(run / "checkpoints" / "last.ckpt")
    return ckpt["optimizer_states"][0]["param_groups"][0]["fused"], ckpt["global_step"]


@pytest.mark.parametrize("before, after", [("null", "true"), ("true", "false")])
def test_a_resumed_run_steps_with_its_own_optimiser_kernel(
    before: str, after: str, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A checkpoint written with one kernel (``optim.fused=null``: ``foreach`` on the CPU, as a CPU run
    resumed on a GPU) resumes with another: the run steps with the one it asked for, not the saved one
    (torch restores every option of a saved group: ``null`` -> ``true`` crashed at the first resumed
    step, the NaN guard handing ``found_inf`` to a ``foreach`` step; ``true`` -> ``false`` went on fused)."""
    run = tmp_path / "run"
    code, text = train(run, cache, [f"optim.fused={before}"], monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert _saved_kernel(run) == (None if before == "null" else True, 4)
    ckpt = run / "checkpoints" / "last.ckpt"
    resume = [f"optim.fused={after}", f"ckpt_path={ckpt}", "trainer.max_steps=6"]
    code, text = train(run, cache, resume, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert _saved_kernel(run) == (True if after == "true" else None, 6)  # None: torch's default, foreach


def test_the_kernel_choice_leaves_torchs_checks_of_the_saved_state() -> None:
    """The pre-hook rewrites the saved groups' kernel options only: a state with another number of
    groups is still refused by torch, and the caller's state dict is not changed."""
    from posformer.lit.optim import keep_kernel_choice

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    two = torch.optim.AdamW([{"params": [a]}, {"params": [b]}])
    one = torch.optim.AdamW([a, b], fused=True)
    one.register_load_state_dict_pre_hook(keep_kernel_choice)
    state = two.state_dict()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        one.load_state_dict(state)
    assert [g["fused"] for g in state["param_groups"]] == [None, None]
