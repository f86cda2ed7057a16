"""A quiet console for the command-line mains: known third-party tips and deprecations filtered,
one line per fact.

Applied by the mains only (``posformer-train``, ``posformer-eval``), never on import of the library:

- Hydra's ``job_logging`` (``configs/hydra/default.yaml``) formats the console handler with
  :class:`ConsoleFormatter` (``message`` for INFO, ``warning: message`` above) and filters it with
  :class:`ConsoleFilter` (drops :data:`NOISE` and records marked :data:`FILE_ONLY`, which go to the
  run's ``<task>.log`` only). The log file keeps everything.
- :func:`quiet_console`, called first thing in the Hydra task function, ignores the warnings in
  :data:`WARNINGS` and sends Lightning's log records through those handlers (Lightning installs its
  own stderr handlers, which printed every fact twice).
"""

from __future__ import annotations

import logging
import re
import warnings

from posformer.utils.format import FILE_ONLY

#: log messages (regular expressions, matched at the start) that carry no information for a user
NOISE = (
    r"💡 Tip:",  # Lightning's litlogger advertisement
    r"(GPU|TPU|HPU|IPU) available:",
    r"Restoring states from the checkpoint path",
    r"Loaded model weights from the checkpoint",
    r"`Trainer.fit` stopped: `max_steps=\d+` reached",
    r"Seed set to \d+",  # the run's model line names the seed
    r"LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES",
    r"You are using a CUDA device .* that has Tensor Cores",
    r"Initializing distributed: GLOBAL_RANK",
    r"-{20,}\s*distributed_backend=",  # DDP's banner
)
#: warnings (regular expressions of the message) that the mains ignore
WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",  # torch 2.13 vs Lightning's _pytree
    r".*sync_dist=True",  # posformer reduces its own epoch statistics across ranks (modules.py)
    r"The `srun` command is available on your system but is not used",
    r"The number of training batches \(\d+\) is smaller than the logging interval",
)
_NOISE = re.compile("|".join(f"(?:{p})" for p in NOISE))


class ConsoleFilter(logging.Filter):
    """Drops :data:`NOISE` and :data:`FILE_ONLY` records (for console handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if all(getattr(record, k, None) == v for k, v in FILE_ONLY.items()):
            return False
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: let the handler report it
            return True
        return _NOISE.match(message.lstrip()) is None


class ConsoleFormatter(logging.Formatter):
    """``message`` for INFO and below; ``warning: message`` / ``error: message`` above."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            level = "warning" if record.levelno < logging.ERROR else "error"
            return f"{level}: {text}"
        return text


def quiet_console() -> None:
    """Ignore :data:`WARNINGS`; route Lightning's loggers through the root (Hydra-configured) handlers."""
    for pattern in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    import lightning  # noqa: F401  (it installs its handlers on import: import first, then undo)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
