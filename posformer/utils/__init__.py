"""Shared utilities of training, evaluation, the CLI, the benchmark and the studies: number and table
formatting (:mod:`~posformer.utils.format`), memory measurement (:mod:`~posformer.utils.memory`) and
figures (:mod:`~posformer.utils.figures`). Float32 regions under autocast, which the PEs use, are a
floor module of their own (:mod:`posformer.precision`), so ``pe`` imports nothing from here.
"""
