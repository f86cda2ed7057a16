"""``posformer-study``: the studies of ``docs/leaderboard.md`` and ``docs/results.md``, and the leaderboard.

    posformer-study lm --size tiny                                   # LM length extrapolation
    posformer-study algorithmic --size small --task reverse --seeds 0 1 2 --stop-at 0.98 \\
        --val-every 250 --ledger docs/studies/algorithmic_reverse_small --skip-train   # tables from records
    posformer-study multi30k --pes sinusoidal learned rope --steps 2500 --ledger docs/studies/multi30k \\
        --launch-for 0                                               # the table from the records
    posformer-study rope-extension --size tiny                       # RoPE context extension
    posformer-study hybrid --seeds 0 1 2 --cores 0,1 --ledger docs/studies/hybrid_corpus32  # per-layer stacks
    posformer-study leaderboard                                      # docs/figures + the leaderboard's tables
    posformer-study <study> --help                                   # a study's options

``scripts/study_lm_extrapolation.py``, ``study_algorithmic.py``, ``study_multi30k.py``,
``study_rope_extension.py`` and ``leaderboard.py`` are the same commands (:func:`script_main`), with
their defaults relative to the repository rather than the working directory. The studies live in
:mod:`posformer.studies`.

Errors: a bad argument is one ``<prog>: error: ...`` line and exit status 2; a study that cannot go on
(:class:`~posformer.studies.common.StudyError`: missing data, a failed run, a ledger of other settings)
one ``<prog>: error: ...`` line and status 1 (:mod:`posformer.cli.boundary`); a queue stopped by
SIGINT/SIGTERM says how to continue and exits with 128 + the signal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from posformer.cli.boundary import ErrorBoundary
from posformer.studies import algorithmic, hybrid, leaderboard, lm, multi30k, rope_extension
from posformer.studies.common import set_project_root

__all__ = ["STUDIES", "build_parser", "dispatch", "main", "script_main"]

PROG = "posformer-study"
#: subcommand -> the study module (``add_arguments(parser)``, ``run_study(args)``)
STUDIES: dict[str, ModuleType] = {
    "lm": lm,
    "algorithmic": algorithmic,
    "multi30k": multi30k,
    "rope-extension": rope_extension,
    "hybrid": hybrid,
    "leaderboard": leaderboard,
}


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _summary(module: ModuleType) -> str:
    """The first line of a study module's docstring."""
    return (module.__doc__ or "").strip().splitlines()[0]


def study_parser(study: str, prog: str) -> OneLineParser:
    """The parser of one study alone (a ``scripts/`` wrapper)."""
    module = STUDIES[study]
    ap = OneLineParser(
        prog=prog, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.add_arguments(ap)
    return ap


def build_parser() -> OneLineParser:
    """``posformer-study`` with one subcommand per study."""
    ap = OneLineParser(
        prog=PROG,
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="study", required=True, metavar="STUDY")
    for name, module in STUDIES.items():
        sp = sub.add_parser(
            name,
            help=_summary(module),
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sp)
    return ap


def dispatch(argv: list[str]) -> None:
    """Parse ``argv`` (``<study> [options]``) and run the study, without the error boundary: a
    :class:`~posformer.studies.common.StudyError` propagates (tests, callers of their own)."""
    args = build_parser().parse_args(argv)
    args.command = " ".join([PROG, *argv])  # the command line a summary shows
    STUDIES[args.study].run_study(args)


def main(argv: list[str] | None = None) -> int:
    """``posformer-study``: :func:`dispatch` inside the project's error boundary."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with ErrorBoundary(PROG):
        dispatch(argv)
    return 0


def script_main(study: str, script: str, argv: list[str] | None = None) -> int:
    """The main of a ``scripts/`` wrapper of ``study``: the study's options alone, its defaults relative
    to the repository holding ``script``, the summary's command line ``python scripts/<name> ...``."""
    path = Path(script).resolve()
    argv = sys.argv[1:] if argv is None else list(argv)
    set_project_root(path.parent.parent)
    args = study_parser(study, prog=path.name).parse_args(argv)
    args.command = " ".join([f"python scripts/{path.name}", *argv])
    with ErrorBoundary(path.name):
        STUDIES[study].run_study(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
