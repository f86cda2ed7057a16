"""One memory meter for evaluation and benchmarks: the peak memory of a block of code."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def _read_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field_name}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MemoryMeter:
    """Peak memory of a block of code, in MiB.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset. CPU: the process's peak resident set size,
    reset at entry by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) and read from ``VmHWM``;
    where that is not possible a thread samples the RSS every few milliseconds. ``peak_mb`` is the
    whole process's peak; ``delta_mb`` is the peak minus the usage at entry.

    ``settle=True`` (benchmarks): at entry, collect garbage and hand cached memory back first (CUDA
    ``empty_cache``, CPU ``malloc_trim``), so that ``delta_mb`` starts from an honest baseline.
    """

    def __init__(self, device: torch.device, *, settle: bool = False):
        self.device = device
        self.settle = settle
        self.peak_mb: float | None = None
        self.delta_mb: float | None = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled = 0

    def __enter__(self) -> MemoryMeter:
        if self.settle:
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self.settle:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        if self.settle:
            malloc_trim()
        self._start = (_read_status_kb("VmRSS") or 0) * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._mode = "hwm"
        except OSError:
            self._mode = "sample"
            self._sampled = self._start
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            rss = (_read_status_kb("VmRSS") or 0) * 1024
            self._sampled = max(self._sampled, rss)

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._mode == "hwm":
            peak = (_read_status_kb("VmHWM") or 0) * 1024
        else:
            self._stop.set()
            self._sampler.join()
            peak = self._sampled
        self.peak_mb = round(peak / 2**20, 1)
        self.delta_mb = round(max(peak - self._start, 0) / 2**20, 1)


#: the compute rate the refusal's time estimate assumes (a few CPU cores; a GPU is 10-100x faster)
NOMINAL_FLOPS = 1e11


def window_cost(length: int, model: Mapping[str, Any]) -> tuple[float, float]:
    """``(bytes, FLOPs)`` of one forward window of ``length`` tokens through ``model`` (its saved
    config): fp32 logits and their cross-entropy plus one layer's activations; the projections and
    MLP of every layer plus causal attention (q·k and the weighted sum, half the square)."""
    d = int(model.get("d_model") or 512)
    ff = int(model.get("d_ff") or 4 * d)
    layers = int(model.get("n_layers") or model.get("n_decoder_layers") or 6)
    vocab = int(model.get("vocab_size") or 32000)
    memory = length * (8.0 * vocab + 4.0 * (ff + 4 * d))
    flops = 2.0 * length * layers * (4 * d * d + 2 * d * ff) + 2.0 * layers * float(length) ** 2 * d
    return memory, flops


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def window_cost_words(length: int, models: Iterable[Mapping[str, Any]]) -> str:
    """What one window of ``length`` tokens costs through the largest of ``models`` (saved model
    configs), in words: "one window of N tokens needs ~X GiB (...) and ~Y FLOPs (~T at R GFLOP/s)"."""
    memory, flops = max((window_cost(length, m) for m in models), key=lambda c: c[1])
    return (
        f"one window of {length} tokens needs ~{memory / 2**30:.1f} GiB (logits and activations) and "
        f"~{flops:.1e} FLOPs (~{_duration(flops / NOMINAL_FLOPS)} at {NOMINAL_FLOPS / 1e9:.0f} GFLOP/s)"
    )
