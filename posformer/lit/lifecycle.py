"""The life of one training run: its run-dir lock, SIGTERM/SIGINT, and the checks before a resume.

:class:`RunLock`
    ``fcntl.flock`` on ``<run dir>/.posformer.lock``, held from just after config validation until the
    run ends. A second ``posformer-train`` on the same run dir refuses at once with one line naming
    the holder (pid, host, command, since when). The kernel drops the lock when its process dies (even by
    SIGKILL), so a lock left by a dead run never blocks the next one. Only the launching process
    takes it (:func:`primary_process`): DDP ranks > 0 share the run dir of rank 0.

:class:`~posformer.signals.Interrupts` + :class:`SignalCheckpoint`
    SIGTERM (what SLURM and Kubernetes send before preemption) and SIGINT (Ctrl+C). During training
    the signal is *deferred* to the end of the current step (of the next one when the current one
    is the last of an epoch, which does not resume exactly from there); the callback saves a resumable
    ``last.ckpt`` through ``trainer.save_checkpoint`` (the same call and the same hook as
    ``ModelCheckpoint``'s step checkpoints, so loop counters, RNG streams and the data position resume
    exactly) and raises :class:`~posformer.errors.Interrupted`: the error boundary prints one line with
    the resume command and the process exits ``128 + signal`` (143 for SIGTERM, 130 for SIGINT).
    Outside training (data set-up, final evaluation) the signal stops the run at once with a line
    saying what was kept. A second signal during training stops at once, without a new checkpoint.
    Lightning's own SIGTERM handler (which ends ``fit`` with ``SystemExit(None)``, i.e. exit status 0,
    and can stop mid-validation without a checkpoint) is replaced while training runs; under DDP the
    ranks agree on stopping with one boolean all-reduce per step.

:func:`check_resumable`
    Before anything is written: a resume checkpoint that is already at ``trainer.max_steps`` says so
    (the run's results are left as they are) instead of rewriting ``results.json`` with empty metrics.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from posformer.errors import ConfigError, Interrupted
from posformer.io import atomic_write_text, hold_lock, read_regular, release_lock
from posformer.signals import Interrupts, signal_name

__all__ = [
    "LOCK_NAME",
    "OWNER_NAME",
    "RunLock",
    "SignalCheckpoint",
    "batch_shape",
    "check_resumable",
    "check_run_dir_owner",
    "primary_process",
    "read_owner",
    "resume_command",
    "write_owner",
]

LOCK_NAME = ".posformer.lock"


# ------------------------------------------------------------------------------------------ process role
def primary_process() -> bool:
    """False in DDP ranks > 0 (``RANK``/``LOCAL_RANK``/``NODE_RANK``/``SLURM_PROCID`` > 0): they run in
    rank 0's run dir, which rank 0 locks and cleans."""
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "0")
        if value.isdigit() and int(value) > 0:
            return False
    return True


# ------------------------------------------------------------------------------------------ the lock
class RunLock:
    """Exclusive lock on a run dir for the run's life (``with RunLock(run_dir): ...``).

    Raises :class:`~posformer.errors.ConfigError` at once when another live process holds it.
    ``enabled=False`` (DDP ranks > 0): a no-op.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, enabled: bool = True) -> None:
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        if not self.enabled:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = hold_lock(
            self.path,
            wait=0,
            what="the run dir's lock file",
            busy=lambda holder: (
                f"run dir {str(self.run_dir)!r} is in use by a running posformer-train ({holder}); two runs "
                "in one directory would overwrite each other's checkpoints and results. Wait for it to "
                "finish, or give this run its own directory: leave hydra.run.dir unset (a new timestamped "
                f"dir) or set hydra.run.dir={self.run_dir}_2."
            ),
            fix=f"give this run its own directory (hydra.run.dir={self.run_dir}_2)",
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            release_lock(self._fd)
            self._fd = None


def batch_shape(batch: Any) -> str:
    """``input_ids 16x4`` / ``src_ids 16x12, tgt_ids 16x13``: the token tensors of a batch."""
    if not isinstance(batch, Mapping):
        return "?"
    keys = [k for k in ("input_ids", "src_ids", "tgt_ids") if hasattr(batch.get(k), "shape")]
    return ", ".join(f"{k} {'x'.join(map(str, batch[k].shape))}" for k in keys) or "?"


class SignalCheckpoint(Callback):
    """Saves a resumable checkpoint at the end of the step during which a signal arrived, then stops.

    Args:
        interrupts: the run's :class:`Interrupts`.
        resume: ``resume(checkpoint_path, train=True) -> str``, the command line that resumes from it
            (``train=False``: that evaluates it).
        fallback_dir: where ``last.ckpt`` goes when there is no ``ModelCheckpoint``.

    Also records the shape of the batch in training (:attr:`last_batch`) for out-of-memory messages.
    """

    def __init__(self, interrupts: Interrupts, resume: Callable[..., str], fallback_dir: Path) -> None:
        self.interrupts, self.resume, self.fallback_dir = interrupts, resume, Path(fallback_dir)
        self.last_batch = "?"

    def checkpoint_path(self, trainer: Any) -> Path:
        cb = trainer.checkpoint_callback
        if cb is not None and getattr(cb, "dirpath", None):
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
        return self.fallback_dir / "checkpoints" / "last.ckpt"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.interrupts.install()
        self.interrupts.deferring = True

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.last_batch = batch_shape(batch)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signum = self.interrupts.signum
        stop = signum is not None
        if trainer.world_size > 1:  # every rank saves (a collective) and stops at the same step
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        last_of_epoch = batch_idx + 1 >= trainer.num_training_batches
        finished = 0 < trainer.max_steps <= trainer.global_step
        if not stop or (last_of_epoch and not finished):
            # the last batch of an epoch does not resume exactly from on_train_batch_end (the epoch's
            # end hooks have not run): save at the end of the next epoch's first step instead
            return
        signum = signum or signal.SIGTERM
        path = self.checkpoint_path(trainer)
        cb = trainer.checkpoint_callback
        if cb is not None and hasattr(cb, "last_model_path"):  # ModelCheckpoint's own last.ckpt from now on
            cb.last_model_path = str(path)  # (else a run resumed in this dir would write last-v1.ckpt)
        trainer.save_checkpoint(str(path), weights_only=False)  # the full, resumable state
        self.interrupts.deferring = False
        step, max_steps = trainer.global_step, trainer.max_steps
        if max_steps and 0 < max_steps <= step:  # the last step: nothing left to resume
            raise Interrupted(
                signum,
                f"interrupted by {signal_name(signum)} at the last step ({step} of {max_steps}): training is "
                f"complete, checkpoint {path}; evaluate it with: {self.resume(str(path), train=False)}",
            )
        raise Interrupted(
            signum,
            f"interrupted by {signal_name(signum)} at step {step} of {max_steps if max_steps > 0 else '?'}: "
            f"saved a resumable checkpoint {path}; resume with: {self.resume(str(path))}",
        )


# ------------------------------------------------------------------------------------------ resuming
def resume_command(run_dir: Path, ckpt_path: str, *, train: bool = True) -> str:
    """``posformer-train <this job's overrides> hydra.run.dir=<run dir> ckpt_path=<ckpt>`` (shell-quoted).

    The overrides are Hydra's record of this job (a multirun job gets its own, single-run command);
    outside Hydra: ``posformer-train ... ckpt_path=<ckpt>``.
    """
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001 - not under Hydra
        overrides = None
    if overrides is None:
        parts = ["..."]
    else:
        drop = ("ckpt_path=", "hydra.run.dir=", "train=", "+ckpt_path=")
        parts = [o for o in overrides if not o.startswith(drop)] + [
            f"hydra.run.dir={hydra_value(str(run_dir))}"
        ]
    if not train:
        parts.append("train=false")
    command = ["posformer-train", *parts, f"ckpt_path={hydra_value(str(ckpt_path))}"]
    return shlex.join(command).replace("'...'", "...")


def hydra_value(value: str) -> str:
    """``value`` written so that Hydra's override parser reads it back unchanged: as it is when it
    does (``/runs/a``), else single-quoted with Hydra's escapes (a quote as ``\\'``, backslashes before a
    quote or the end doubled): a path with non-ASCII letters, quotes, commas or brackets, which Hydra
    refuses ("token recognition error") or reads as a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()

    def reads_back(text: str) -> bool:
        try:
            return parser.parse_override(f"k={text}").value() == value
        except Exception:  # noqa: BLE001 - Hydra's grammar errors
            return False

    if reads_back(value):
        return value
    return "'" + re.sub(r"(\\*)('|$)", lambda m: 2 * m.group(1) + ("\\'" if m.group(2) else ""), value) + "'"


def check_resumable(checkpoint: Mapping[str, Any], path: str, max_steps: int, run_dir: Path) -> None:
    """A resume from a checkpoint already at ``max_steps`` (> 0) is refused: there is nothing to train,
    and the finished run's ``results.json`` must stay as it is."""
    step = int(checkpoint.get("global_step", 0) or 0)
    if max_steps > 0 and step >= max_steps:
        raise ConfigError(
            f"ckpt_path={path!r} is at step {step} and trainer.max_steps={max_steps}: that run has finished, "
            f"there is nothing to resume (its results are left as they are; nothing was written to "
            f"{run_dir}). "
            f"To train longer, raise trainer.max_steps (e.g. trainer.max_steps={2 * step}); to evaluate it, "
            "add train=false or use posformer-eval."
        )


# ------------------------------------------------------------------------------------------ ownership
def _inside(path: Path, directory: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(directory)))


#: the run dir's record of the run that owns it (written with its first write, posformer.training.start)
OWNER_NAME = ".posformer.run.json"


def write_owner(run_dir: Path, identity: Mapping[str, Any]) -> None:
    """Record the run that owns ``run_dir`` (kept by resumes: the first owner's record stays)."""
    path = run_dir / OWNER_NAME
    if path.is_symlink() or (path.exists() and not path.is_file()):
        read_owner(run_dir)  # refuses a link or a special file in one line
    if not path.is_file():
        atomic_write_text(run_dir / OWNER_NAME, json.dumps(dict(identity), sort_keys=True) + "\n")


def read_owner(run_dir: Path) -> dict[str, Any] | None:
    """The owner record of ``run_dir``; ``None`` when there is none (or it is unreadable). A symlink or a
    special file (a FIFO would hang the read) in its place is a :class:`ConfigError`."""
    try:
        data = json.loads(read_regular(run_dir / OWNER_NAME, what="the run dir's owner record"))
    except ConfigError:
        raise
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def finished_work(run_dir: Path) -> list[str]:
    """What a posformer run dir holds that a new run would replace: ``results.json``, checkpoints."""
    found = [name for name in ("results.json",) if (run_dir / name).is_file()]
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir():
        ckpts = sorted(p.name for p in ckpt_dir.glob("*.ckpt"))
        more = f" (+{len(ckpts) - 1} more)" if len(ckpts) > 1 else ""
        found += [f"checkpoints/{ckpts[0]}{more}"] if ckpts else []
    return found


def check_run_dir_owner(run_dir: Path, *, train: bool, ckpt_path: str | None) -> None:
    """A run dir belongs to the run that wrote it (its owner record, or posformer's ``config.yaml`` for
    runs older than the record): a *new* training run into one that holds that run's results or
    checkpoints is refused before anything is written. The ways back in are a resume from one of its
    own checkpoints (``ckpt_path=<run dir>/checkpoints/...``) or an evaluation (``train=false``)."""
    if not train or (ckpt_path and _inside(Path(str(ckpt_path)), run_dir)):
        return
    owner = read_owner(run_dir)
    if owner is None and not (run_dir / "config.yaml").is_file():
        return  # not a posformer run's dir
    held = finished_work(run_dir)
    if not held:
        return  # nothing finished: a run stopped before its first checkpoint may be started again
    whose = "another run"
    if owner:
        whose = f"the run started {owner.get('created', '?')} (seed {owner.get('seed', '?')})"
    last = run_dir / "checkpoints" / "last.ckpt"
    resume = f"ckpt_path={last}" if last.exists() else "ckpt_path=<one of its checkpoints>"
    raise ConfigError(
        f"run dir {str(run_dir)!r} belongs to {whose}: it holds {', '.join(held)}, which a new run would "
        f"replace (limit: one run per run dir; resume is the way back in). Resume that run with "
        f"{resume}, evaluate it with train=false {resume}, or give this run its own directory: leave "
        f"hydra.run.dir unset (a new timestamped dir) or set hydra.run.dir={run_dir}_2."
    )
