"""Shared utilities of training, evaluation, the CLI, the benchmark and the studies: number and table
formatting (:mod:`~posformer.utils.format`), memory measurement (:mod:`~posformer.utils.memory`) and
figures (:mod:`~posformer.utils.figures`). They import nothing of posformer above ``io`` and ``pe``.
"""
