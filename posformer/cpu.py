"""Process-wide CPU settings of posformer's entry points: intra-op threads, denormal floats.

Training, evaluation and the benchmark call :func:`configure_cpu` once, before any work, from their
configs (``torch_threads``, ``flush_denormal``); a library user's own loop can call it too.

**Why flush denormals.** A softmax over strongly biased scores (ALiBi, T5, KERPLE and FIRE biases
reach hundreds below the row maximum) yields probabilities and exponentials below float32's smallest
normal number, 1.2e-38. x86 CPUs handle such *denormal* operands in microcode, tens of times slower
than normal ones, so the fused attention kernels' forward and backward slow down in proportion to
how many entries fall there. One ALiBi attention layer runs its forward + backward at about 0.6×
the speed of unbiased causal attention with denormals, and at about the same speed without them
(``scripts/bench_masked_sdpa.py``, docs/performance.md). Flushing (FTZ/DAZ) turns those operands into
0. Each is below 1.2e-38, so it changes a result by less than that: added to any value above about
2e-31 it changes no float32 bit.
"""

from __future__ import annotations

import torch

from posformer.errors import ConfigError


def flush_denormal_problem(value: object) -> str | None:
    """The one-line error for a ``flush_denormal`` value that is not a boolean, else None."""
    if isinstance(value, bool):
        return None
    return (
        f"flush_denormal={value!r} must be true or false "
        "(true: treat float32 values below 1.2e-38 as 0 on the CPU, the fast setting)."
    )


def configure_cpu(threads: int | None = None, flush_denormal: bool = True) -> None:
    """Set torch's intra-op ``threads`` (``None``: keep torch's default) and denormal flushing.

    ``flush_denormal=False`` keeps IEEE denormals (the behaviour before this setting existed).
    """
    problem = flush_denormal_problem(flush_denormal)
    if problem:
        raise ConfigError(problem)
    if threads is not None:
        torch.set_num_threads(int(threads))
    torch.set_flush_denormal(flush_denormal)  # returns False (and does nothing) where unsupported
