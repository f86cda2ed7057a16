"""Errors raised by posformer.

Every error a user can trigger with bad input is one of these, with a message that names the
offending value, the limit it broke and how to fix it.
"""

from __future__ import annotations


class PosformerError(Exception):
    """Base class of posformer's user-facing errors."""


class PosformerWarning(UserWarning):
    """Something was wrong but the work could go on (what was ignored is in the message)."""


class RunInterrupted(PosformerError):
    """The Python API's form of :class:`Interrupted`: a signal stopped the work; the message says what
    was kept and how to continue (``signum``: the signal)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = int(signum)


class ConfigError(PosformerError, ValueError):
    """A configuration value (or combination of values) is invalid."""


class PositionRangeError(PosformerError, ValueError):
    """A sequence asks for positions a positional encoding cannot represent."""


class DataError(PosformerError, ValueError):
    """Input data is missing, empty or malformed."""


class CheckpointError(PosformerError, ValueError):
    """A checkpoint is missing, unreadable or does not match the configuration."""


class ResourceError(PosformerError, RuntimeError):
    """The machine ran out of a resource (device or host memory) for the requested work."""


def is_kernel_out_of_resources(exc: BaseException) -> bool:
    """True when a compiled (Triton) kernel needs more of a GPU's shared memory or registers than it has
    (triton's ``OutOfResources``: "out of resource: shared memory, Required: …, Hardware limit: …";
    CUDA's "too many resources requested for launch"), also wrapped by inductor or dynamo (the cause or
    context of ``exc``)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        text = str(seen).lower()
        if type(seen).__name__ == "OutOfResources" or "out of resource" in text:
            return True
        if "too many resources requested for launch" in text:  # CUDA's words for registers
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and the ``RuntimeError("... out of memory ...")`` of other
    backends/allocators (CPU ``DefaultCPUAllocator: can't allocate memory`` / ``not enough memory``,
    MPS, XPU)."""
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        words in text for words in ("out of memory", "can't allocate memory", "not enough memory")
    )


class Interrupted(SystemExit):
    """The run was stopped by a signal (SIGTERM, SIGINT): exit status ``128 + signum`` (143, 130).

    ``message`` is the one line the error boundary prints: what was saved and how to resume. A
    ``SystemExit`` so that nothing on the way (``except Exception``) swallows it and, uncaught, it still
    exits with the right status and no traceback.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + int(signum))
        self.signum, self.message = int(signum), message

    def __str__(self) -> str:
        return self.message
