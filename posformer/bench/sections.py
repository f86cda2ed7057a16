"""The benchmark's sections, one function each: ``train``, ``mfu``, ``eval`` and ``gen``.

Each builds its models (seeded), warms up, repeats the timed unit of :mod:`posformer.bench.measure`
and returns a JSON-able dict of every repetition and the medians; ``log`` gets one line per result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from posformer.bench.config import (
    BASELINE_PE,
    KEEP_DENORMALS,
    POLICY_SWITCHES,
    BenchConfig,
    matmul_reference_dtype,
    steps_per_rep,
)
from posformer.bench.measure import Trainer, eval_once, generate, matmul_flops
from posformer.bench.models import flops_per_token, model_flops_per_token, posformer_model, xt_model
from posformer.errors import PositionRangeError

Log = Callable[[str], None]
#: the run key of posformer with the changes of ``cfg.before`` undone
BEFORE = "posformer-before"


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def bench_train(pe: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Log) -> dict:
    """Training tokens/s and peak memory of posformer with ``pe``, alternated in one process with
    x-transformers (same PE), posformer's baseline PE and, with ``cfg.before``, the same posformer
    model with those changes undone; the ratios are taken per repetition."""

    def trainer(model: torch.nn.Module, before: tuple[str, ...] = ()) -> Trainer:
        flush = cfg.flush_denormal and KEEP_DENORMALS not in before
        off = tuple(b for b in before if b != KEEP_DENORMALS and b not in POLICY_SWITCHES)
        switches = {name: name not in before for name in POLICY_SWITCHES}
        batch, length = cfg.batch, cfg.seq_len
        return Trainer(
            model,
            cfg,
            device,
            dtype,
            batch,
            length,
            flush_denormal=flush,
            backends_off=off,
            switches=switches,
        )

    torch.manual_seed(0)
    runs = {"posformer": trainer(posformer_model(pe, cfg, cfg.d_model, cfg.seq_len))}
    packed = cfg.documents > 1  # x-transformers takes no segment ids: not compared
    xt = xt_model(pe, cfg, cfg.d_model, cfg.seq_len) if cfg.compare and not packed else None
    if xt is not None:
        runs["x-transformers"] = trainer(xt)
    if pe != BASELINE_PE and cfg.nope_reference:  # the baseline, alternated too: the "vs nope" ratio
        runs[BASELINE_PE] = trainer(posformer_model(BASELINE_PE, cfg, cfg.d_model, cfg.seq_len))
    if cfg.before:  # the same model (same seed) with the changes undone: the "vs before" ratio
        torch.manual_seed(0)
        runs[BEFORE] = trainer(posformer_model(pe, cfg, cfg.d_model, cfg.seq_len), tuple(cfg.before))
    for t in runs.values():
        for _ in range(cfg.warmup):
            t.step()
    rec: dict[str, list] = {f"{k}_{m}": [] for k in runs for m in ("tok_s", "peak_mb")}
    steps = steps_per_rep(cfg, device)
    for _ in range(cfg.reps):
        for name, t in runs.items():  # alternate: the same noise hits both
            tok_s, peak_mb = t.timed(steps)
            rec[f"{name}_tok_s"].append(tok_s)
            rec[f"{name}_peak_mb"].append(peak_mb)
    torch.set_flush_denormal(cfg.flush_denormal)  # the process setting, whichever run came last
    out: dict[str, Any] = {"reps": rec}
    out["tok_s"] = _median(rec["posformer_tok_s"])
    out["peak_mb"] = max(rec["posformer_peak_mb"])

    def ratio(other: str) -> float | None:
        return _median([a / b for a, b in zip(rec["posformer_tok_s"], rec[f"{other}_tok_s"])])

    if "x-transformers" in runs:
        out["xt_tok_s"] = _median(rec["x-transformers_tok_s"])
        out["xt_peak_mb"] = max(rec["x-transformers_peak_mb"])
        out["ratio"] = ratio("x-transformers")
    if BASELINE_PE in runs:
        out["nope_tok_s"] = _median(rec[f"{BASELINE_PE}_tok_s"])
        out["ratio_nope"] = ratio(BASELINE_PE)
    if BEFORE in runs:
        out["before_tok_s"] = _median(rec[f"{BEFORE}_tok_s"])
        out["ratio_before"] = ratio(BEFORE)
    out["flops_per_token"] = model_flops_per_token(
        runs["posformer"].model, cfg.n_layers, cfg.d_model, cfg.seq_len
    )
    line = f"train {pe}: {out['tok_s']:.0f} tok/s"
    if "ratio" in out:
        line += f", x-transformers {out['xt_tok_s']:.0f} (x{out['ratio']:.2f})"
    if "ratio_before" in out:
        line += f", before {out['before_tok_s']:.0f} (x{out['ratio_before']:.2f})"
    log(line)
    return out


def mfu_key(pe: str, d_model: int) -> str:
    """The MFU record's key: the width for the baseline PE, ``pe/width`` for the others."""
    return str(d_model) if pe == BASELINE_PE else f"{pe}/{d_model}"


def bench_mfu(cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Log) -> dict:
    """Model FLOPs utilisation of each PE in ``mfu_pes`` at each width in ``mfu_d_models``: the model's
    training FLOP/s (:func:`~posformer.bench.models.flops_per_token`, counted analytically) over the
    rate of a plain (B·T, d) @ (d, 4d) matmul measured in the same run, alternated with the steps
    (bf16 on CUDA: :func:`~posformer.bench.config.matmul_reference_dtype`)."""
    res = {}
    ref_dtype = matmul_reference_dtype(device, dtype)
    for pe in cfg.mfu_pes:
        for d in cfg.mfu_d_models:
            torch.manual_seed(0)
            t = Trainer(posformer_model(pe, cfg, d, cfg.seq_len), cfg, device, dtype, cfg.batch, cfg.seq_len)
            for _ in range(cfg.warmup):
                t.step()
            rates, mm = [], []
            for _ in range(cfg.reps):  # alternate model steps and the reference matmul
                rates.append(t.timed(steps_per_rep(cfg, device))[0])
                tokens = cfg.batch * cfg.seq_len
                mm.append(matmul_flops(device, ref_dtype, tokens, d, 4 * d, seconds=cfg.matmul_seconds))
            flops = flops_per_token(t.model, cfg.n_layers, d, cfg.seq_len)
            model_flops = _median(rates) * flops["total"]
            rec = res[mfu_key(pe, d)] = {
                "pe": pe,
                "d_model": d,
                "n_layers": cfg.n_layers,
                "seq_len": cfg.seq_len,
                "tok_s": _median(rates),
                "model_gflops": model_flops / 1e9,
                "matmul_gflops": _median(mm) / 1e9,
                "matmul_dtype": str(ref_dtype).replace("torch.", ""),
                "mfu": model_flops / _median(mm),
                "attention_share": flops["attention"] / flops["total"],
                "flops_per_token": flops,
                "reps": {"tok_s": rates, "matmul_flops": mm},
            }
            log(
                f"mfu {pe} d={d}: {model_flops / 1e9:.1f} GFLOP/s of {_median(mm) / 1e9:.1f}"
                f" ({rec['matmul_dtype']} matmul) = {rec['mfu']:.0%}"
            )
            del t
    return res


def bench_eval(pe: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Log) -> dict:
    """Seconds and peak memory of one no-grad forward at each of ``eval_lengths``; an error (out of
    memory, a length past the PE's range in the dtype) is recorded for that length and the benchmark
    goes on."""
    torch.manual_seed(0)
    model = posformer_model(pe, cfg, cfg.eval_d_model, max(cfg.eval_lengths)).to(device).eval()
    if cfg.compile:
        model = torch.compile(model, dynamic=True)
    res = {}
    eval_once(model, min(256, *cfg.eval_lengths), cfg, device, dtype)  # warm-up
    for length in cfg.eval_lengths:
        reps = cfg.eval_reps if length <= 4096 else max(1, cfg.eval_reps - 1)
        try:
            if device.type == "cuda":  # a new length may recompile (FlexAttention): not timed
                eval_once(model, length, cfg, device, dtype)
            runs = [eval_once(model, length, cfg, device, dtype) for _ in range(reps)]
        except (torch.OutOfMemoryError, RuntimeError, PositionRangeError) as exc:  # report, go on
            res[str(length)] = {"error": str(exc).splitlines()[0][:200]}
            continue
        tok_s = _median([r[0] for r in runs])
        res[str(length)] = {
            "tok_s": tok_s,
            "seconds": length / tok_s,
            "peak_mb": max(r[1] for r in runs),
        }
        log(f"eval {pe} {length}: {length / tok_s:.2f} s, {res[str(length)]['peak_mb']:.0f} MB")
    return res


def bench_gen(pe: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Log) -> dict:
    """Greedy generation tokens/s with and without the KV cache."""
    torch.manual_seed(0)
    model = posformer_model(pe, cfg, cfg.d_model, cfg.gen_prompt + cfg.gen_tokens).to(device).eval()
    cached, uncached = [], []
    for _ in range(max(1, cfg.eval_reps - 1)):
        cached.append(generate(model, cfg, device, dtype, cached=True))
        uncached.append(generate(model, cfg, device, dtype, cached=False))
    res = {"cached_tok_s": _median(cached), "uncached_tok_s": _median(uncached)}
    res["speedup"] = res["cached_tok_s"] / res["uncached_tok_s"]
    log(
        f"gen {pe}: cached {res['cached_tok_s']:.0f} tok/s, uncached {res['uncached_tok_s']:.0f}"
        f" (x{res['speedup']:.1f})"
    )
    return res
