"""What every ``posformer-*`` main shares: one error boundary and the Hydra command-line precheck.

Error boundary
    :class:`ErrorBoundary` (``with ErrorBoundary(...)`` or ``@error_boundary(...)``) turns a
    :class:`~posformer.errors.PosformerError`, or running out of memory
    (:func:`~posformer.errors.is_out_of_memory`: the line names what to lower for that ``prog``,
    :data:`OOM_FIXES`), into one ``[<prog>: ]error: <message>`` line on
    stderr and ``SystemExit(exit_code)``, with no traceback. Every other exception is a bug and
    propagates unchanged. ``exit_on_error=False`` records the line in :attr:`ErrorBoundary.message`
    and carries on instead (a Hydra multirun job that fails keeps the sweep going). A run stopped by
    a signal (:class:`~posformer.errors.Interrupted`: SIGTERM/SIGINT) prints its one line (what was
    saved, the resume command) and always exits ``128 + signum``, a multirun included: the sweep stops.

Run-dir precheck
    Hydra creates the run directory before any posformer code runs and fails with a traceback when
    it cannot; :func:`precheck_run_dir` reads the overrides from ``argv`` first and raises a
    :class:`~posformer.errors.ConfigError` naming the override and the fix.
"""

from __future__ import annotations

import os
import sys
from contextlib import ContextDecorator
from pathlib import Path
from types import TracebackType

from posformer.errors import (
    ConfigError,
    Interrupted,
    PosformerError,
    is_kernel_out_of_resources,
    is_out_of_memory,
)

__all__ = [
    "KERNEL_FIXES",
    "OOM_FIXES",
    "ErrorBoundary",
    "check_sweep_dir_free",
    "error_boundary",
    "error_line",
    "precheck_run_dir",
    "run_dir_from_argv",
]


# ------------------------------------------------------------------------------------------ error boundary
#: what to lower when a main runs out of memory, by ``prog`` (``""``: posformer-train's boundary); each
#: names the settings of that command that decide how much memory one step takes
OOM_FIXES: dict[str, str] = {
    "": (
        "lower data.batch_size (raise trainer.accumulate_grad_batches to keep the effective batch), the "
        "sequence lengths or model.attention_chunk_mb, or use a device with more memory"
    ),
    "posformer-eval": (
        "lower eval.batch_tokens, set eval.attention_chunk_mb (e.g. 64) or evaluate shorter eval.lengths, "
        "or use a device with more memory"
    ),
    "posformer-inspect": (
        "lower max_len (the position x position tables and figures grow with max_len squared) or "
        "max_heads, or use device=cpu"
    ),
    "posformer-generate": "lower max_new_tokens or samples, or use device=cpu",
    "posformer-bench": "lower --batch, --seq-len or --d-model (or --eval-lengths), or use --quick",
}


#: what to change when a compiled kernel needs more GPU shared memory than the device has, by ``prog``
KERNEL_FIXES: dict[str, str] = {
    "": "model.attention_backend=sdpa (no FlexAttention kernel: slower bias PEs) or compile.enabled=false",
    "posformer-eval": "eval.attention_backend=sdpa (no FlexAttention kernel; slower for bias PEs)",
    "posformer-bench": "--attention-backend sdpa (no FlexAttention kernel), without --compile",
}


def error_line(exc: BaseException, prog: str = "") -> str | None:
    """The one-line report of a user-facing error (``None``: not one, i.e. a bug to show in full)."""
    prefix = f"{prog}: error: " if prog else "error: "
    if isinstance(exc, PosformerError):
        return f"{prefix}{exc}"
    found = os_error_in(exc)
    if found is not None:  # the file system: the path, what is wrong with it, the fix
        from posformer.io import os_error_message

        return f"{prefix}{os_error_message(found)}"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if is_kernel_out_of_resources(exc):  # before memory: inductor may word it "OutOfMemoryError"
        return (
            f"{prefix}a compiled GPU kernel needs more shared memory or registers than this GPU has "
            f"({first}); use {KERNEL_FIXES.get(prog, KERNEL_FIXES[''])}."
        )
    if is_out_of_memory(exc):
        return f"{prefix}out of memory ({first}); {OOM_FIXES.get(prog, OOM_FIXES[''])}."
    return None


def os_error_in(exc: BaseException) -> OSError | None:
    """The operating-system error on a path behind ``exc`` (itself, or its cause / context, as when
    Hydra's logging set-up fails on a ``train.log`` that is a directory); ``None`` if there is none."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return None
        if isinstance(seen, OSError) and not is_out_of_memory(seen) and (seen.filename or seen.errno):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class ErrorBoundary(ContextDecorator):
    """Report user-facing errors as one stderr line and exit non-zero (see the module docstring).

    Args:
        prog: prefix of the line (``"posformer-eval"`` -> ``posformer-eval: error: ...``); empty:
            ``error: ...``.
        exit_code: the exit status of a reported error.
        exit_on_error: ``False``: print the line, keep it in :attr:`message` and suppress the error.
    """

    def __init__(self, prog: str = "", exit_code: int = 1, *, exit_on_error: bool = True) -> None:
        self.prog, self.exit_code, self.exit_on_error = prog, exit_code, exit_on_error
        self.message: str | None = None

    def __enter__(self) -> ErrorBoundary:
        self.message = None
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if isinstance(exc, Interrupted):  # a signal: report it, keep its exit status (128 + signum)
            print(f"{self.prog}: {exc.message}" if self.prog else exc.message, file=sys.stderr, flush=True)
            self.message = exc.message
            return False
        if exc is None or not isinstance(exc, Exception):
            return False  # success, or SystemExit/KeyboardInterrupt: not ours
        line = error_line(exc, self.prog)
        if line is None:
            return False
        print(line, file=sys.stderr)
        self.message = line
        if self.exit_on_error:
            raise SystemExit(self.exit_code) from None
        return True


def error_boundary(prog: str = "", exit_code: int = 1) -> ErrorBoundary:
    """``@error_boundary("posformer-x")`` on a main, or ``with error_boundary(...):`` around a call."""
    return ErrorBoundary(prog, exit_code)


# ------------------------------------------------------------------------------------------ run-dir precheck
def _static_prefix(value: str) -> str:
    """The part of a (possibly interpolated) path before its first ``${...}``."""
    value = value.strip().strip("'\"")
    return value.split("${", 1)[0] if "${" in value else value


def run_dir_from_argv(argv: list[str]) -> tuple[str, Path] | None:
    """The Hydra override that decides where a run writes, and the fixed part of its path.

    ``hydra.run.dir`` (``hydra.sweep.dir`` with ``-m``), else ``paths.log_dir``/``paths.root_dir``, else
    ``$POSFORMER_ROOT`` or the working directory + ``outputs``. Values with interpolations are cut at
    the first ``${``.
    """
    values = {}
    for arg in argv:
        if "=" in arg and not arg.startswith(("-", "~")):
            key, value = arg.split("=", 1)
            values[key.lstrip("+")] = value
    multirun = any(a in ("-m", "--multirun") for a in argv)
    for key in ("hydra.sweep.dir" if multirun else "hydra.run.dir", "paths.log_dir", "paths.root_dir"):
        if key in values and _static_prefix(values[key]):
            return key, Path(_static_prefix(values[key])).expanduser()
    if "hydra.run.dir" in values or "hydra.sweep.dir" in values:
        return None
    root = os.environ.get("POSFORMER_ROOT") or os.getcwd()
    return "paths.root_dir", Path(root) / "outputs"


def precheck_run_dir(argv: list[str]) -> None:
    """Fail before Hydra starts when the run directory cannot be created (Hydra itself would fail
    with a traceback): the nearest existing ancestor must be a writable directory. Creates nothing."""
    found = run_dir_from_argv(argv)
    if found is None:
        return
    key, path = found
    probe = path.absolute()
    problem = ""
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():  # a loop or a link to nowhere: Hydra's mkdir would fail with a traceback
            problem = f"{probe} is a symlink that leads nowhere (a loop or a missing target)"
            break
        probe = probe.parent
    if problem:
        pass
    elif not probe.is_dir():
        problem = f"{probe} is a file, not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{probe} is not writable"
    if problem:
        raise ConfigError(
            f"{key}={str(path)!r}: the run directory cannot be created ({problem}); choose a writable "
            "location, e.g. hydra.run.dir=outputs/my_run or paths.log_dir=/writable/dir."
        )


def check_sweep_dir_free(argv: list[str]) -> None:
    """``-m hydra.sweep.dir=<dir>`` into a dir that already holds a sweep (``multirun.yaml`` or job dirs
    with a ``.hydra/`` record): refused before Hydra starts, since the new job 0, 1, ... would replace
    the earlier sweep's."""
    if not any(a in ("-m", "--multirun") for a in argv):
        return
    values = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    raw = values.get("hydra.sweep.dir", "").strip().strip("'\"")
    if not raw or "${" in raw:
        return
    sweep = Path(raw).expanduser()
    if not sweep.is_dir():
        return
    jobs = sorted(p.parent.name for p in sweep.glob("*/.hydra"))
    if not jobs and not (sweep / "multirun.yaml").exists():
        return
    held = f"job dirs {', '.join(jobs[:4])}{' ...' if len(jobs) > 4 else ''}" if jobs else "multirun.yaml"
    raise ConfigError(
        f"hydra.sweep.dir={str(sweep)!r} already holds a sweep ({held}); a second sweep there would replace "
        f"its jobs (limit: one sweep per sweep dir). Choose a new one (hydra.sweep.dir={sweep}_2, or leave "
        "it unset for a timestamped dir); to continue one job, resume it: posformer-train "
        "hydra.run.dir=<job dir> ckpt_path=<job dir>/checkpoints/last.ckpt."
    )
