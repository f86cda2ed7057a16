"""SIGTERM and SIGINT for the life of a command: defer them to a safe point, or stop with one line.

:class:`Interrupts` installs the handlers for a command's life (``posformer-train``, ``posformer-eval``,
the API): while ``deferring`` (a training step in progress: :class:`posformer.lit.lifecycle.SignalCheckpoint`)
a first signal is only recorded; otherwise it raises :class:`~posformer.errors.Interrupted` at once,
with the line the current stage gives (what was kept, how to continue). A floor below ``lit/`` and
``eval/``: both use it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from posformer.errors import Interrupted

__all__ = ["SIGNALS", "Interrupts", "describe_before_start", "signal_name"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def describe_before_start(signum: int) -> str:
    """The line for a signal before training started."""
    return (
        f"interrupted by {signal_name(signum)} before training started; nothing was written. "
        "Re-run the same command to start again."
    )


class Interrupts:
    """SIGTERM/SIGINT handlers for the run's life (``with Interrupts() as it: ...``).

    ``deferring`` (set by :class:`SignalCheckpoint` while training): a first signal is only recorded
    (:attr:`signum`); otherwise it raises :class:`~posformer.errors.Interrupted` at once, with the
    line :attr:`describe` gives for the current stage. Installs nothing outside the main thread.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = False
        self.describe: Callable[[int], str] = describe_before_start
        self._old: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for ``ddp_spawn`` workers: the stage text and the saved handlers stay here."""
        return {**self.__dict__, "describe": describe_before_start, "_old": {}}

    def install(self) -> None:
        """(Re-)install the handlers (training start: replaces the one Lightning's ``fit`` registered)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self.deferring and first:
            print(
                f"[posformer] received {signal_name(signum)}: saving a resumable checkpoint after this step "
                "(send it again to stop at once)",
                flush=True,
            )
            return
        if self.deferring:  # a second signal while training: stop now
            raise Interrupted(
                signum,
                f"interrupted by a second {signal_name(signum)} during a training step: stopped at once "
                "without a new checkpoint; resume from the last one saved (checkpoints/last.ckpt) with "
                "ckpt_path=<it>.",
            )
        raise Interrupted(signum, self.describe(signum))

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.getsignal(s) for s in SIGNALS}
            self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._old = {}
