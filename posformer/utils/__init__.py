"""Shared utilities of training, evaluation, the CLI, the benchmark and the studies: number and table
formatting (:mod:`~posformer.utils.format`), memory measurement (:mod:`~posformer.utils.memory`),
figures (:mod:`~posformer.utils.figures`) and float32 regions under autocast
(:mod:`~posformer.utils.precision`). They import nothing of posformer above ``io`` and ``pe``.
"""
