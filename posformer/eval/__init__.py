"""Evaluation: the extrapolation harness, decoding, translation scoring, checkpoint averaging.

- :mod:`~posformer.eval.run`: ``posformer-eval`` as a library (config -> subjects -> results; dispatch).
- :mod:`~posformer.eval.harness`: :func:`~posformer.eval.harness.evaluate_subjects` (the run loop).
- :mod:`~posformer.eval.settings`: ``EvalSettings`` and ``Subject``.
- :mod:`~posformer.eval.windows` / :mod:`~posformer.eval.tasks`: LM window scoring / task scoring.
- :mod:`~posformer.eval.scaling`: rotary context extension at evaluation time.
- :mod:`~posformer.eval.store`: the output dir's results, locked and merged; :mod:`~posformer.eval.results` /
  :mod:`~posformer.eval.plots`: result files, report, plots.
- checkpoints are found and loaded by :mod:`posformer.checkpoints` (a floor below evaluation).
- :mod:`~posformer.utils.memory` / :mod:`~posformer.utils.format`: the memory meter and the formatter.
- :mod:`~posformer.eval.translate`, :mod:`~posformer.eval.decoding`, :mod:`~posformer.eval.averaging`:
  BLEU evaluation, greedy/beam search, checkpoint averaging.
"""
