"""Side-by-side speed benchmark: every positional encoding, posformer vs x-transformers.

``posformer-bench`` (or ``python scripts/bench.py``) measures, for each PE on one fixed decoder-only
configuration:

* training throughput (forward + backward + AdamW step, tokens/s) and peak memory; the same for
  x-transformers at the identical configuration where it has that PE, the two *alternating* in one
  process so that machine noise hits both; the ratio is taken per repetition, then the median;
  ``--before denormals,<backend>`` alternates a fourth run, the same posformer model with those
  changes undone (denormals kept, attention backends switched off): the *vs before* ratio;
* model FLOPs utilisation: model FLOPs/s (``6N + 12·L·d·T`` per trained token) divided by the fp32
  (or, on CUDA, bf16) matmul rate measured in the same run at the same thread count;
* evaluation of one long sequence (default 1k/4k/16k tokens, ``no_grad``): tokens/s and peak memory;
* generation with and without the KV cache (tokens/s).

Every step runs with float32 denormals flushed (:func:`posformer.cpu.configure_cpu`, as training
does; ``--keep-denormals`` turns it off), for both libraries.

Memory (:class:`posformer.utils.memory.MemoryMeter`, the meter evaluation uses too): the peak above the
usage at entry; on CUDA ``torch.cuda.max_memory_allocated``, on CPU the process's resident-set
high-water mark (``VmHWM`` after a reset; a sampling thread where that reset is impossible). Garbage
is collected and freed memory handed back (``empty_cache`` / ``malloc_trim``) before each measurement
so that the baseline is honest.

Output: one rich table on the console, ``bench.json`` (every repetition and the medians) and
``bench.md`` (the table) in ``--out``. Timings are medians over ``--reps`` repetitions.

Modules: :mod:`~posformer.bench.config` (what runs), :mod:`~posformer.bench.models` (both libraries'
models, FLOPs), :mod:`~posformer.bench.measure` (the timed units), :mod:`~posformer.bench.sections`
(train/mfu/eval/gen), :mod:`~posformer.bench.report` (tables), :mod:`~posformer.bench.run`; the
command line is :mod:`posformer.cli.bench`.
"""

from posformer.bench.config import BASELINE_PE, BenchConfig, apply_quick, default_pes
from posformer.bench.models import XT_PE, posformer_model, xt_model
from posformer.bench.report import render_markdown, table_rows
from posformer.bench.run import run

__all__ = [
    "BASELINE_PE",
    "XT_PE",
    "BenchConfig",
    "apply_quick",
    "default_pes",
    "posformer_model",
    "render_markdown",
    "run",
    "table_rows",
    "xt_model",
]
