"""Around a Hydra main: a composition error as one ``error:`` line (:mod:`posformer.configs.composition`'s
words) and a non-zero exit."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from posformer.cli.boundary import error_line, os_error_in
from posformer.configs.composition import composition_error, yaml_error

#: Hydra re-raises errors instead of printing them when this variable is "1"
_FULL_ERROR = "HYDRA_FULL_ERROR"


def _hydra_report(exc: BaseException) -> None:
    """What ``hydra.main`` prints for an error it reports itself (its compact errors: the message)."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, CompactHydraException):
        sys.stderr.write(str(exc) + os.linesep)
        if isinstance(exc.__cause__, OmegaConfBaseException):
            sys.stderr.write(str(exc.__cause__) + os.linesep)
    else:
        traceback.print_exception(exc)


@contextmanager
def composition_errors(argv: Sequence[str], prog: str = "", exit_code: int = 1) -> Iterator[None]:
    """Around a ``hydra.main`` call: a composition error becomes one ``[<prog>: ]error: ...`` line and
    ``SystemExit(exit_code)``; other errors keep Hydra's report and exit status 1. Hydra re-raises while
    ``HYDRA_FULL_ERROR=1`` (set here, then restored); a user who set it gets Hydra's full errors."""
    before = os.environ.get(_FULL_ERROR)
    if before == "1":
        yield
        return
    os.environ[_FULL_ERROR] = "1"
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - Hydra's job: report, exit non-zero
        error = composition_error(exc, [a for a in argv if not a.startswith("-")])
        if error is None:
            error = yaml_error(exc)  # a config file that is not YAML, or holds a !!python/ tag
        if error is None and os_error_in(exc) is not None:  # Hydra's own writes: .hydra/, train.log
            error = exc
        if error is None:
            _hydra_report(exc)
            raise SystemExit(1) from None
        print(error_line(error, prog), file=sys.stderr)
        raise SystemExit(exit_code) from None
    finally:
        os.environ.pop(_FULL_ERROR, None) if before is None else os.environ.update({_FULL_ERROR: before})
