"""What the benchmark runs: :class:`BenchConfig`, the PEs it covers, the ``--quick`` preset, the device."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from posformer.devices import torch_device
from posformer.pe import ENCODINGS, list_encodings


def _baseline_pe() -> str:
    """The registered PE that declares no hook at all (no positions): the speed reference."""
    return next(name for name in list_encodings() if not ENCODINGS[name].capabilities.hooks)


#: the reference PE: every other PE's training speed is also reported relative to it ("vs nope")
BASELINE_PE = _baseline_pe()


def default_pes() -> list[str]:
    """Every registered PE, the baseline first."""
    return [BASELINE_PE, *(pe for pe in list_encodings() if pe != BASELINE_PE)]


@dataclass
class BenchConfig:
    pes: list[str] = field(default_factory=default_pes)
    vocab: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 512
    batch: int = 8
    documents: int = 1  # train: documents packed into each sequence (segment ids: block-diagonal attention)
    reps: int = 5
    # train, mfu: steps timed together in one repetition, between two device syncs (0: auto, see
    # steps_per_rep): on a GPU a step timed alone starts with an empty queue and ends with a sync, which
    # training (no host sync in its steps) never waits for
    steps_per_rep: int = 0
    warmup: int = 2
    eval_d_model: int = 128
    eval_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    eval_reps: int = 3
    gen_prompt: int = 16
    gen_tokens: int = 256
    mfu_d_models: list[int] = field(default_factory=lambda: [256, 512])
    mfu_pes: list[str] = field(default_factory=lambda: [BASELINE_PE])
    compare: bool = True
    eval_pes: list[str] = field(default_factory=list)  # empty: every PE
    nope_reference: bool = True  # alternate every PE with the BASELINE_PE model
    compile: bool = False
    fused_adam: bool = True
    matmul_seconds: float = 0.5  # time spent on each reference matmul measurement
    sections: list[str] = field(default_factory=lambda: ["train", "mfu", "eval", "gen"])
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    chunk_mb: int = 256
    attention_backend: str = "auto"  # ModelConfig.attention_backend of posformer's models
    flush_denormal: bool = True  # posformer.cpu.configure_cpu: float32 denormals count as 0 (both libraries)
    # training: also alternate posformer with these changes undone, in the same run (the "vs before"
    # ratio): "denormals" (keep denormal floats), "flex_offsets" (Flex computes offset-only biases per
    # score), "flex_divisible" (Flex checks every tile's bounds) and/or attention backend names (off)
    before: list[str] = field(default_factory=list)
    out: str = "bench_out"


#: the ``before`` item that keeps denormal floats (every other item but the next names an attention backend)
KEEP_DENORMALS = "denormals"
#: the ``before`` item that has FlexAttention compute an offset-only bias per score with the PE's
#: ``bias_fn`` instead of reading the captured offset vector (``BackendPolicy.flex_offsets``)
FLEX_OFFSETS = "flex_offsets"
#: the ``before`` item that keeps the dynamic-shape CUDA Flex kernel's bounds checks at lengths that are
#: multiples of 128 (``BackendPolicy.flex_divisible``)
FLEX_DIVISIBLE = "flex_divisible"
#: the ``before`` items that are :class:`~posformer.model.policy.BackendPolicy` switches, turned off
POLICY_SWITCHES = (FLEX_OFFSETS, FLEX_DIVISIBLE)


#: the ``--quick`` preset: a tiny model, few repetitions (a smoke test of every section)
QUICK: dict[str, Any] = {
    "d_model": 32,
    "eval_d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "seq_len": 32,
    "batch": 2,
    "reps": 2,
    "warmup": 1,
    "eval_reps": 1,
    "eval_lengths": [64, 128],
    "mfu_d_models": [32],
    "gen_prompt": 4,
    "gen_tokens": 8,
    "matmul_seconds": 0.05,
}


def apply_quick(cfg: BenchConfig, keep: Collection[str] = ()) -> None:
    """The ``--quick`` preset (:data:`QUICK`) onto ``cfg``, except the fields in ``keep`` (those given
    explicitly on the command line: ``--quick --d-model 64`` measures width 64, as asked)."""
    for key, value in QUICK.items():
        if key not in keep:
            setattr(cfg, key, list(value) if isinstance(value, list) else value)


#: the steps of one timed repetition on CUDA when ``steps_per_rep`` is 0 (the queue stays full, as in
#: training); elsewhere one (the CPU runs each kernel as it is called: nothing to overlap)
CUDA_STEPS_PER_REP = 4


def steps_per_rep(cfg: BenchConfig, device: torch.device) -> int:
    """Training steps timed together in one repetition: ``cfg.steps_per_rep``, or with 0
    :data:`CUDA_STEPS_PER_REP` on CUDA and 1 elsewhere."""
    if cfg.steps_per_rep > 0:
        return cfg.steps_per_rep
    return CUDA_STEPS_PER_REP if device.type == "cuda" else 1


def matmul_reference_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The MFU reference matmul's dtype: bf16 on CUDA (the GPU's peak rate, whatever the model runs
    in), the model's on the CPU (fp32: 16-bit matmuls are emulated and ~100x slower there)."""
    return torch.bfloat16 if device.type == "cuda" else dtype


def resolve_device(cfg: BenchConfig) -> tuple[torch.device, torch.dtype]:
    """``--device``/``--dtype`` (``auto``: CUDA if available; bf16 on CUDA, fp32 on CPU)."""
    device = torch_device(cfg.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        cfg.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    return device, dtype
