"""The studies of ``docs/leaderboard.md`` and ``docs/results.md``: many training runs per PE and seed,
their evaluation, committed per-run records and the tables built from them (``posformer-study``).

Reusable parts, each readable on its own:

- :mod:`~posformer.studies.jobs`: the resumable queue of ``posformer-train`` runs, one per core;
- :mod:`~posformer.studies.commands`: a logged subprocess and a skippable sweep evaluation;
- :mod:`~posformer.studies.ledger`: the committed per-run records (``docs/studies/<study>/``);
- :mod:`~posformer.studies.aggregate`: evaluation rows -> cells of mean ± std over seeds -> Markdown;
- :mod:`~posformer.studies.figures`: the studies' own figures;
- :mod:`~posformer.studies.leaderboard` (with :mod:`~posformer.studies.context_use`): the leaderboard's
  tables and figures.

The studies, each with ``add_arguments(parser)`` and ``run_study(args)``:
:mod:`~posformer.studies.lm` (LM length extrapolation, with :mod:`~posformer.studies.memory`),
:mod:`~posformer.studies.algorithmic` (with :mod:`~posformer.studies.algorithmic_summary`),
:mod:`~posformer.studies.multi30k`, :mod:`~posformer.studies.rope_extension`,
:mod:`~posformer.studies.hybrid` (per-layer PE stacks: char-LM perplexity and the passkey needle grid).
:mod:`posformer.cli.study` is their command line; ``scripts/study_*.py`` and ``scripts/leaderboard.py``
call it. A study's user-facing errors are :class:`~posformer.studies.common.StudyError`.
"""

from posformer.studies.common import StudyError

__all__ = ["StudyError"]
