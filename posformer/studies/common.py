"""What every study shares: its one error class, where its default folders are, the executables it runs.

- :class:`StudyError`: a study cannot go on (a bad option value, missing data, a failed run, a ledger
  of other settings). ``posformer-study`` and the ``scripts/study_*.py`` wrappers report it as one
  ``error:`` line and exit status 1 (:mod:`posformer.cli.boundary`).
- :func:`project_root`: the folder the default ``--out``/``--figures``/``--records`` paths are relative
  to and the studies' commands run in. ``$POSFORMER_ROOT``, else the working directory, as for
  ``posformer-train``; the wrappers in ``scripts/`` set their repository instead
  (:func:`set_project_root`), so their defaults do not depend on where they are started.
- :data:`VENV_BIN`: ``posformer-train`` and ``posformer-eval`` of the running Python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from posformer.errors import PosformerError

__all__ = [
    "CHECKOUT",
    "QUIET",
    "VENV_BIN",
    "StudyError",
    "all_pes",
    "project_root",
    "set_project_root",
    "shared_data",
]

#: the folder of the running interpreter's executables (``posformer-train``, ``posformer-eval``, ``python``)
VENV_BIN = Path(sys.executable).parent
#: the source checkout holding this package (``git`` runs there to record the commit of a study's runs)
CHECKOUT = Path(__file__).resolve().parents[2]
#: the usual order of PEs in the studies' tables (absolute, rotary, biases); other PEs follow
TABLE_ORDER = ["nope", "sinusoidal", "learned", "rope", "xpos", "alibi", "t5", "kerple", "fire", "shaw"]
#: overrides that keep a study's training runs quiet: no logger, no heat map, no progress bar
QUIET = [
    "logger=none",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
]


class StudyError(PosformerError):
    """A study cannot go on; the message names the value, the file or the run, and the fix."""


_root: Path | None = None


def set_project_root(root: Path | None) -> None:
    """Fix :func:`project_root` for this process (``None``: back to the default rule)."""
    global _root
    _root = None if root is None else Path(root).resolve()


def project_root() -> Path:
    """The folder a study's default paths are relative to and its commands run in: the one set by
    :func:`set_project_root`, else ``$POSFORMER_ROOT``, else the working directory (the rule of
    ``posformer-train``'s ``paths.root_dir``)."""
    if _root is not None:
        return _root
    return Path(os.environ.get("POSFORMER_ROOT") or os.getcwd()).resolve()


def shared_data(root: Path, *parts: str) -> Path:
    """A data set in the ``shared/data`` folder next to ``root`` (the layout of the development machine:
    ``../shared/data/tinyshakespeare/input.txt``, ``../shared/data/multi30k``)."""
    return root.parent.joinpath("shared", "data", *parts)


def all_pes() -> list[str]:
    """Every registered PE: those of :data:`TABLE_ORDER` in that order, then the others in registry order."""
    from posformer.pe import list_encodings

    names = list_encodings()
    return [n for n in TABLE_ORDER if n in names] + [n for n in names if n not in TABLE_ORDER]
