"""The timed units of work: a training step, one long no-grad forward, greedy generation, a matmul.

Each returns tokens (or FLOPs) per second; the ones that measure memory use
:class:`posformer.utils.memory.MemoryMeter` (``settle=True``: garbage collected and cached memory handed
back first) and report the peak above the usage at entry, in MiB.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from posformer.bench.config import BenchConfig
from posformer.eval.decoding import generate as generate_tokens
from posformer.utils.memory import MemoryMeter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _autocast(device: torch.device, dtype: torch.dtype) -> Any:
    """Mixed precision in ``dtype``; fp32: none."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def matmul_flops(
    device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 1.0
) -> float:
    """Measured FLOP/s of an (m, k) @ (k, n) matmul, the median of several timed batches."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    a @ b
    sync(device)
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(seconds / 5 / one))
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync(device)
        rates.append(2 * m * k * n * iters / (time.perf_counter() - t0))
    return statistics.median(rates)


class Trainer:
    """One training step (forward, cross-entropy, backward, AdamW) of a model on random tokens.

    ``cfg.documents`` > 1 packs that many equal documents into each sequence: the model (posformer's)
    gets their ``segment_ids`` (B, T), so attention is block-diagonal and positions restart.

    ``flush_denormal``: the denormal setting of the step (:func:`torch.set_flush_denormal`, set before
    each step, so runs alternated in one process can differ); ``backends_off``: posformer attention
    backends switched off during the step (``model.attention_policy``); ``switches``: its
    :class:`~posformer.model.policy.BackendPolicy` booleans by name (``flex_offsets``, ``flex_divisible``).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: BenchConfig,
        device: torch.device,
        dtype: torch.dtype,
        batch: int,
        seq_len: int,
        flush_denormal: bool = True,
        backends_off: tuple[str, ...] = (),
        switches: dict[str, bool] | None = None,
    ):
        self.model = model.to(device).train()
        self.flush_denormal = flush_denormal
        # posformer models: this trainer's backend switches, set on the model before each of its steps
        # (the same model may be timed by another trainer with other switches, alternating)
        base = getattr(model, "attention_policy", None)
        fields = {"off": frozenset(backends_off), **(switches or {})}
        self.policy = replace(base, **fields) if base is not None else None
        self.step_fn = torch.compile(model) if cfg.compile else model
        # fused AdamW (one kernel for all parameters) for both libraries: the optimiser is not under test
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg.fused_adam)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(4, cfg.vocab, (batch, seq_len + 1), generator=g).to(device)
        self.kwargs: dict[str, Tensor] = {}
        if cfg.documents > 1:  # document d holds tokens [d·T/n, (d+1)·T/n)
            docs = torch.arange(seq_len, device=device) * cfg.documents // seq_len  # (T,)
            self.kwargs["segment_ids"] = docs.expand(batch, seq_len)  # (B, T)
        self.device, self.dtype = device, dtype
        self.tokens = batch * seq_len

    def step(self) -> None:
        x, y = self.ids[:, :-1], self.ids[:, 1:]
        torch.set_flush_denormal(self.flush_denormal)
        if self.policy is not None:
            self.model.attention_policy = self.policy
        with _autocast(self.device, self.dtype):
            logits = self.step_fn(x, **self.kwargs)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, steps: int = 1) -> tuple[float, float]:
        """(tokens/s, peak MiB) of ``steps`` consecutive steps, timed from one device sync to the next
        (nothing syncs between them: on a GPU each step's kernels queue behind the last one's, as in
        training)."""
        with MemoryMeter(self.device, settle=True) as mem:
            sync(self.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                self.step()
            sync(self.device)
            dt = time.perf_counter() - t0
        return self.tokens * steps / dt, mem.delta_mb


def eval_once(
    model: nn.Module, length: int, cfg: BenchConfig, device: torch.device, dtype: torch.dtype
) -> tuple[float, float]:
    """(tokens/s, peak MiB) of one no-grad forward over one sequence of ``length`` tokens."""
    ids = torch.randint(4, cfg.vocab, (1, length), device=device)
    with torch.no_grad(), _autocast(device, dtype), MemoryMeter(device, settle=True) as mem:
        sync(device)
        t0 = time.perf_counter()
        model(ids)
        sync(device)
        dt = time.perf_counter() - t0
    return length / dt, mem.delta_mb


def generate(
    model: nn.Module, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, cached: bool
) -> float:
    """Greedy generation (:func:`posformer.eval.decoding.generate`, the project's one generator) of
    ``gen_tokens`` after a ``gen_prompt`` prompt, with or without the KV cache; returns new tokens/s."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, cfg.vocab, (1, cfg.gen_prompt), generator=g).to(device)
    with torch.no_grad(), _autocast(device, dtype):
        sync(device)
        t0 = time.perf_counter()
        generate_tokens(model, ids, cfg.gen_tokens, use_cache=cached)
        sync(device)
        return cfg.gen_tokens / (time.perf_counter() - t0)
