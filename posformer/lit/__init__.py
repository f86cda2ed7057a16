"""Lightning glue: the training modules, callbacks, optimisers/schedules and resumable loaders.

Also :mod:`posformer.lit.checkpoint` (loading a module; the CheckpointIO plugin; resumed callback paths),
:mod:`posformer.lit.trainer` (the Trainer's arguments, output-dir probes, the final evaluation),
:mod:`posformer.lit.results` (results files and report) and :mod:`posformer.lit.loggers` (hparams,
objective) — the pieces of the training flow, :mod:`posformer.training`.
"""

from posformer.lit.data import ResumableLoader, ShardedLoader
from posformer.lit.modules import LanguageModelModule, PosformerModule, Seq2SeqModule, module_class
from posformer.lit.optim import build_optimizer, build_schedule, parameter_groups

__all__ = [
    "LanguageModelModule",
    "PosformerModule",
    "ResumableLoader",
    "Seq2SeqModule",
    "ShardedLoader",
    "build_optimizer",
    "build_schedule",
    "module_class",
    "parameter_groups",
]
