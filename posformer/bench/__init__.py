"""Side-by-side speed benchmark: every positional encoding, posformer vs x-transformers.

``posformer-bench`` (or ``python scripts/bench.py``) measures, for each PE on one fixed decoder-only
configuration:

* training throughput (forward + backward + AdamW step, tokens/s) and peak memory; the same for
  x-transformers at the identical configuration where it has that PE, the two *alternating* in one
  process so that machine noise hits both; the ratio is taken per repetition, then the median;
* model FLOPs utilisation: model FLOPs/s (``6N + 12·L·d·T`` per trained token) divided by the fp32
  (or, on CUDA, bf16) matmul rate measured in the same run at the same thread count;
* evaluation of one long sequence (default 1k/4k/16k tokens, ``no_grad``): tokens/s and peak memory;
* generation with and without the KV cache (tokens/s).

Memory: on CUDA ``torch.cuda.max_memory_allocated``. On CPU the process RSS high-water mark above
the pre-measurement RSS, sampled every millisecond by a thread; freed heap memory is handed back to
the OS (``malloc_trim``) before each measurement so the baseline is honest. Short spikes between two
samples can be missed, so CPU figures are a slight under-estimate.

Output: one rich table on the console, ``bench.json`` (every repetition and the medians) and
``bench.md`` (the table) in ``--out``. Timings are medians over ``--reps`` repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posformer.model import ModelConfig, build_model
from posformer.pe import list_encodings

#: x-transformers keyword arguments giving the same PE (None: x-transformers has no such PE)
XT_PE: dict[str, dict[str, Any] | None] = {
    "nope": {"use_abs_pos_emb": False},
    "learned": {"use_abs_pos_emb": True},
    "sinusoidal": {"use_abs_pos_emb": True, "scaled_sinu_pos_emb": True},
    "rope": {"use_abs_pos_emb": False, "attn": {"rotary_pos_emb": True}},
    "alibi": {"use_abs_pos_emb": False, "attn": {"alibi_pos_bias": True}},
    "t5": {"use_abs_pos_emb": False, "attn": {"rel_pos_bias": True}, "no_flash": True},
    "xpos": {"use_abs_pos_emb": False, "attn": {"rotary_pos_emb": True, "rotary_xpos": True}},
}

DEFAULT_PES = ("nope", "learned", "sinusoidal", "rope", "xpos", "alibi", "t5", "fire", "kerple", "shaw")


@dataclass
class BenchConfig:
    pes: list[str] = field(default_factory=lambda: list(DEFAULT_PES))
    vocab: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 512
    batch: int = 8
    reps: int = 5
    warmup: int = 2
    eval_d_model: int = 128
    eval_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    eval_reps: int = 3
    gen_prompt: int = 16
    gen_tokens: int = 256
    mfu_d_models: list[int] = field(default_factory=lambda: [256, 512])
    compare: bool = True
    eval_pes: list[str] = field(default_factory=list)  # empty: every PE
    nope_reference: bool = True
    compile: bool = False
    fused_adam: bool = True
    matmul_seconds: float = 0.5  # time spent on each reference matmul measurement
    sections: list[str] = field(default_factory=lambda: ["train", "mfu", "eval", "gen"])
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    chunk_mb: int = 256
    out: str = "bench_out"


# ---------------------------------------------------------------------------------------------- memory
class PeakMemory:
    """Peak memory of the enclosed code, in bytes (CUDA allocator, or CPU RSS sampled by a thread)."""

    def __init__(self, device: torch.device, interval: float = 0.001):
        self.device, self.interval, self.peak = device, interval, 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._high = max(self._high, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            _malloc_trim()
            self._base = self._high = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self._stop.set()
            self._thread.join()
            self._high = max(self._high, self._rss())
            self.peak = self._high - self._base


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- models
def posformer_model(pe: str, cfg: BenchConfig, d_model: int, max_len: int) -> nn.Module:
    options = {"max_len": max_len} if pe == "learned" else {}
    mcfg = ModelConfig(
        kind="decoder",
        vocab_size=cfg.vocab,
        d_model=d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        dropout=0.0,
        attn_dropout=0.0,
        pe=pe,
        pe_options=options,
        tie_embeddings=True,
        attention_chunk_mb=cfg.chunk_mb,
    )
    return build_model(mcfg)


def xt_available() -> bool:
    try:
        import x_transformers  # noqa: F401
    except ImportError:
        return False
    return True


def xt_model(pe: str, cfg: BenchConfig, d_model: int, max_len: int, device: torch.device) -> nn.Module | None:
    """The x-transformers decoder with the same width/depth/heads/FFN/tied embeddings and this PE."""
    spec = XT_PE.get(pe)
    if spec is None or not xt_available():
        return None
    from x_transformers import Decoder, TransformerWrapper

    attn = dict(spec.get("attn", {}))
    if attn.get("rotary_pos_emb"):
        attn["rotary_emb_dim"] = d_model // cfg.n_heads  # posformer rotates the full head
    flash = not spec.get("no_flash", False)
    return TransformerWrapper(
        num_tokens=cfg.vocab,
        max_seq_len=max_len,
        tie_embedding=True,
        use_abs_pos_emb=spec["use_abs_pos_emb"],
        scaled_sinu_pos_emb=spec.get("scaled_sinu_pos_emb", False),
        attn_layers=Decoder(
            dim=d_model, depth=cfg.n_layers, heads=cfg.n_heads, attn_flash=flash, ff_mult=4, **attn
        ),
    )


def model_flops_per_token(model: nn.Module, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token, ``6N + 12·L·d·T`` (N: parameters taking part in matmuls)."""
    n = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or "pe." in name or name.startswith("pe") or "pos_emb" in name:
            continue  # position tables are lookups, not matmuls
        seen.add(id(p))
        n += p.numel()
    return 6 * n + 12 * n_layers * d_model * seq_len


def matmul_flops(
    device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 1.0
) -> float:
    """Measured FLOP/s of an (m, k) @ (k, n) matmul, the median of several timed batches."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    a @ b
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(seconds / 5 / one))
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(device)
        rates.append(2 * m * k * n * iters / (time.perf_counter() - t0))
    return statistics.median(rates)


# ---------------------------------------------------------------------------------------------- runners
class Trainer:
    """One training step (forward, cross-entropy, backward, AdamW) of a model on random tokens."""

    def __init__(
        self,
        model: nn.Module,
        cfg: BenchConfig,
        device: torch.device,
        dtype: torch.dtype,
        batch: int,
        seq_len: int,
    ):
        self.model = model.to(device).train()
        self.step_fn = torch.compile(model) if cfg.compile else model
        # fused AdamW (one kernel for all parameters) for both libraries: the optimiser is not under test
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg.fused_adam)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(4, cfg.vocab, (batch, seq_len + 1), generator=g).to(device)
        self.device, self.dtype = device, dtype
        self.tokens = batch * seq_len

    def step(self) -> None:
        x, y = self.ids[:, :-1], self.ids[:, 1:]
        ac = (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.dtype != torch.float32
            else contextlib.nullcontext()
        )
        with ac:
            logits = self.step_fn(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self) -> tuple[float, int]:
        """(tokens/s, peak bytes) of one step."""
        with PeakMemory(self.device) as mem:
            _sync(self.device)
            t0 = time.perf_counter()
            self.step()
            _sync(self.device)
            dt = time.perf_counter() - t0
        return self.tokens / dt, mem.peak


def eval_once(
    model: nn.Module, length: int, cfg: BenchConfig, device: torch.device, dtype: torch.dtype
) -> tuple[float, int]:
    """(tokens/s, peak bytes) of one no-grad forward over one sequence of ``length`` tokens."""
    ids = torch.randint(4, cfg.vocab, (1, length), device=device)
    ac = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with torch.no_grad(), ac, PeakMemory(device) as mem:
        _sync(device)
        t0 = time.perf_counter()
        model(ids)
        _sync(device)
        dt = time.perf_counter() - t0
    return length / dt, mem.peak


def generate(
    model: nn.Module, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, cached: bool
) -> float:
    """Greedy generation of ``gen_tokens`` after a ``gen_prompt`` prompt; returns new tokens/s."""
    ids = torch.randint(4, cfg.vocab, (1, cfg.gen_prompt), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    ac = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with torch.no_grad(), ac:
        _sync(device)
        t0 = time.perf_counter()
        if cached:
            cache = model.new_cache()
            logits = model(ids, cache=cache)
            for _ in range(cfg.gen_tokens):
                nxt = logits[:, -1:].argmax(-1)
                ids = torch.cat((ids, nxt), 1)
                logits = model(nxt, cache=cache)
        else:
            for _ in range(cfg.gen_tokens):
                nxt = model(ids)[:, -1:].argmax(-1)
                ids = torch.cat((ids, nxt), 1)
        _sync(device)
        return cfg.gen_tokens / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- sections
def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def bench_train(pe: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Callable) -> dict:
    torch.manual_seed(0)
    runs = {
        "posformer": Trainer(
            posformer_model(pe, cfg, cfg.d_model, cfg.seq_len), cfg, device, dtype, cfg.batch, cfg.seq_len
        )
    }
    xt = xt_model(pe, cfg, cfg.d_model, cfg.seq_len, device) if cfg.compare else None
    if xt is not None:
        runs["x-transformers"] = Trainer(xt, cfg, device, dtype, cfg.batch, cfg.seq_len)
    if pe != "nope" and cfg.nope_reference:  # posformer's own nope, alternated too: the "vs nope" ratio
        runs["nope"] = Trainer(
            posformer_model("nope", cfg, cfg.d_model, cfg.seq_len), cfg, device, dtype, cfg.batch, cfg.seq_len
        )
    for t in runs.values():
        for _ in range(cfg.warmup):
            t.step()
    rec: dict[str, list] = {f"{k}_{m}": [] for k in runs for m in ("tok_s", "peak")}
    for _ in range(cfg.reps):
        for name, t in runs.items():  # alternate: the same noise hits both
            tok_s, peak = t.timed()
            rec[f"{name}_tok_s"].append(tok_s)
            rec[f"{name}_peak"].append(peak)
    out: dict[str, Any] = {"reps": rec}
    out["tok_s"] = _median(rec["posformer_tok_s"])
    out["peak_mb"] = max(rec["posformer_peak"]) / 2**20
    if "x-transformers" in runs:
        out["xt_tok_s"] = _median(rec["x-transformers_tok_s"])
        out["xt_peak_mb"] = max(rec["x-transformers_peak"]) / 2**20
        out["ratio"] = _median([a / b for a, b in zip(rec["posformer_tok_s"], rec["x-transformers_tok_s"])])
    if "nope" in runs:
        out["nope_tok_s"] = _median(rec["nope_tok_s"])
        out["ratio_nope"] = _median([a / b for a, b in zip(rec["posformer_tok_s"], rec["nope_tok_s"])])
    out["flops_per_token"] = model_flops_per_token(
        runs["posformer"].model, cfg.n_layers, cfg.d_model, cfg.seq_len
    )
    log(
        f"train {pe}: {out['tok_s']:.0f} tok/s"
        + (f", x-transformers {out['xt_tok_s']:.0f} (x{out['ratio']:.2f})" if "ratio" in out else "")
    )
    return out


def bench_mfu(cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Callable) -> dict:
    """MFU of the ``nope`` model at each width in ``mfu_d_models`` against the measured matmul rate."""
    res = {}
    for d in cfg.mfu_d_models:
        torch.manual_seed(0)
        t = Trainer(posformer_model("nope", cfg, d, cfg.seq_len), cfg, device, dtype, cfg.batch, cfg.seq_len)
        for _ in range(cfg.warmup):
            t.step()
        rates, mm = [], []
        for _ in range(cfg.reps):  # alternate model steps and the reference matmul
            rates.append(t.timed()[0])
            mm.append(
                matmul_flops(device, dtype, cfg.batch * cfg.seq_len, d, 4 * d, seconds=cfg.matmul_seconds)
            )
        fpt = model_flops_per_token(t.model, cfg.n_layers, d, cfg.seq_len)
        model_flops = _median(rates) * fpt
        res[str(d)] = {
            "tok_s": _median(rates),
            "model_gflops": model_flops / 1e9,
            "matmul_gflops": _median(mm) / 1e9,
            "mfu": model_flops / _median(mm),
        }
        log(
            f"mfu d={d}: {model_flops / 1e9:.1f} GFLOP/s of {_median(mm) / 1e9:.1f}"
            f" = {res[str(d)]['mfu']:.0%}"
        )
        del t
    return res


def bench_eval(pe: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Callable) -> dict:
    torch.manual_seed(0)
    model = posformer_model(pe, cfg, cfg.eval_d_model, max(cfg.eval_lengths)).to(device).eval()
    if cfg.compile:
        model = torch.compile(model, dynamic=True)
    res = {}
    eval_once(model, min(256, *cfg.eval_lengths), cfg, device, dtype)  # warm-up
    for length in cfg.eval_lengths:
        reps = cfg.eval_reps if length <= 4096 else max(1, cfg.eval_reps - 1)
        try:
            runs = [eval_once(model, length, cfg, device, dtype) for _ in range(reps)]
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # report, do not abort the benchmark
            res[str(length)] = {"error": str(exc).splitlines()[0][:200]}
            continue
        tok_s = _median([r[0] for r in runs])
        res[str(length)] = {
            "tok_s": tok_s,
            "seconds": length / tok_s,
            "peak_mb": max(r[1] for r in runs) / 2**20,
        }
        log(f"eval {pe} {length}: {length / tok_s:.2f} s, {res[str(length)]['peak_mb']:.0f} MB")
    return res


def bench_gen(pe: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype, log: Callable) -> dict:
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


# ---------------------------------------------------------------------------------------------- report
def _length_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def columns(results: dict) -> list[tuple[str, str]]:
    """(row key, header) of the table; one time column per evaluation length, memory for the longest."""
    lengths = results["config"]["eval_lengths"]
    cols = [
        ("pe", "PE"),
        ("train_tok_s", "train tok/s"),
        ("train_peak_mb", "train MB"),
        ("xt_tok_s", "x-t tok/s"),
        ("ratio_xt", "vs x-t"),
        ("ratio_nope", "vs nope"),
    ]
    cols += [(f"eval_{_length_name(n)}_s", f"eval {_length_name(n)} s") for n in lengths]
    if lengths:
        cols.append((f"eval_{_length_name(max(lengths))}_mb", f"eval {_length_name(max(lengths))} MB"))
    cols += [
        ("gen_cached", "gen cached tok/s"),
        ("gen_uncached", "gen uncached tok/s"),
        ("gen_speedup", "cache x"),
    ]
    return cols


def table_rows(results: dict) -> list[dict[str, Any]]:
    rows = []
    for pe, r in results["pes"].items():
        tr, ev, gn = r.get("train", {}), r.get("eval", {}), r.get("gen", {})
        row: dict[str, Any] = {
            "pe": pe,
            "train_tok_s": tr.get("tok_s"),
            "train_peak_mb": tr.get("peak_mb"),
            "xt_tok_s": tr.get("xt_tok_s"),
            "ratio_xt": tr.get("ratio"),
            "ratio_nope": 1.0 if pe == "nope" and tr else tr.get("ratio_nope"),
        }
        for length, e in ev.items():
            name = _length_name(int(length))
            row[f"eval_{name}_s"] = e.get("seconds", "OOM" if "error" in e else None)
            row[f"eval_{name}_mb"] = e.get("peak_mb")
        row["gen_cached"], row["gen_uncached"] = gn.get("cached_tok_s"), gn.get("uncached_tok_s")
        row["gen_speedup"] = gn.get("speedup")
        rows.append(row)
    return rows


def _fmt(v: Any, key: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if key.startswith("ratio") or key == "gen_speedup":
        return f"{v:.2f}"
    if key.endswith("_s") and key.startswith("eval"):
        return f"{v:.2f}"
    return f"{v:,.0f}"


def render_markdown(results: dict) -> str:
    lines = [f"posformer-bench, {results['meta']['date']}, {results['meta']['machine']}", ""]
    cols = columns(results)
    lines.append("| " + " | ".join(h for _, h in cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for row in table_rows(results):
        lines.append("| " + " | ".join(_fmt(row.get(k), k) for k, _ in cols) + " |")
    if results.get("mfu"):
        lines += ["", "| d_model | tok/s | model GFLOP/s | matmul GFLOP/s | MFU |", "|---|---|---|---|---|"]
        for d, m in results["mfu"].items():
            lines.append(
                f"| {d} | {m['tok_s']:,.0f} | {m['model_gflops']:.1f} | {m['matmul_gflops']:.1f} | "
                f"{m['mfu']:.0%} |"
            )
    return "\n".join(lines) + "\n"


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"posformer-bench ({results['meta']['machine']})")
    cols = columns(results)
    for _, h in cols:
        table.add_column(h, justify="right")
    for row in table_rows(results):
        table.add_row(*(_fmt(row.get(k), k) for k, _ in cols))
    console = Console()
    console.print(table)
    if results.get("mfu"):
        mt = Table(title="model FLOPs utilisation (nope)")
        for h in ("d_model", "tok/s", "model GFLOP/s", "matmul GFLOP/s", "MFU"):
            mt.add_column(h, justify="right")
        for d, m in results["mfu"].items():
            mt.add_row(
                d,
                f"{m['tok_s']:,.0f}",
                f"{m['model_gflops']:.1f}",
                f"{m['matmul_gflops']:.1f}",
                f"{m['mfu']:.0%}",
            )
        console.print(mt)


# ---------------------------------------------------------------------------------------------- main
#: BenchConfig fields exposed as integer command-line flags (--d-model, --seq-len, ...)
_INT_FLAGS = (
    "vocab", "d_model", "n_layers", "n_heads", "seq_len", "batch", "reps", "warmup",
    "eval_d_model", "eval_reps", "gen_prompt", "gen_tokens", "threads", "chunk_mb",
)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(prog="posformer-bench", description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    p.add_argument("--pes", default=",".join(d.pes), help=f"comma list (all: {','.join(list_encodings())})")
    for key in _INT_FLAGS:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=getattr(d, key))
    p.add_argument("--eval-lengths", default=",".join(map(str, d.eval_lengths)))
    p.add_argument("--eval-pes", default="", help="comma list of PEs to evaluate (default: all of --pes)")
    p.add_argument("--mfu-d-models", default=",".join(map(str, d.mfu_d_models)))
    p.add_argument("--sections", default=",".join(d.sections), help="any of train,mfu,eval,gen")
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip x-transformers")
    p.add_argument("--compile", action="store_true", help="torch.compile the models (posformer and x-t)")
    p.add_argument(
        "--no-nope-reference",
        dest="nope_reference",
        action="store_false",
        help="do not alternate each PE with posformer's nope (vs-nope ratio from separate runs)",
    )
    p.add_argument("--foreach-adam", dest="fused_adam", action="store_false", help="AdamW(foreach) not fused")
    p.add_argument("--device", default=d.device, help="auto|cpu|cuda")
    p.add_argument("--dtype", default=d.dtype, help="auto (bf16 on CUDA, fp32 on CPU)|fp32|bf16")
    p.add_argument("--out", default=d.out, help="folder for bench.json and bench.md")
    p.add_argument("--quick", action="store_true", help="tiny smoke-test configuration")
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    cfg = BenchConfig(
        pes=[x for x in a.pes.split(",") if x],
        eval_lengths=ints(a.eval_lengths),
        mfu_d_models=ints(a.mfu_d_models),
        sections=[x for x in a.sections.split(",") if x],
        nope_reference=a.nope_reference,
        eval_pes=[x for x in a.eval_pes.split(",") if x],
        fused_adam=a.fused_adam,
        compare=a.compare,
        compile=a.compile,
        device=a.device,
        dtype=a.dtype,
        out=a.out,
        **{
            k: getattr(a, k)
            for k in _INT_FLAGS
        },
    )
    if a.quick:
        cfg.d_model, cfg.eval_d_model, cfg.n_layers, cfg.n_heads = 32, 32, 2, 2
        cfg.seq_len, cfg.batch, cfg.reps, cfg.warmup, cfg.eval_reps = 32, 2, 2, 1, 1
        cfg.eval_lengths, cfg.mfu_d_models, cfg.gen_prompt, cfg.gen_tokens = [64, 128], [32], 4, 8
        cfg.matmul_seconds = 0.05
    unknown = set(cfg.pes) - set(list_encodings())
    if unknown:
        p.error(f"unknown PE(s) {sorted(unknown)}; valid: {', '.join(list_encodings())}")
    return cfg


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    device = torch.device(
        "cuda"
        if cfg.device == "auto" and torch.cuda.is_available()
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        cfg.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    results: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine,
            "torch": torch.__version__,
            "device": device.type,
            "dtype": str(dtype).replace("torch.", ""),
            "x_transformers": _xt_version(),
        },
        "config": asdict(cfg),
        "pes": {pe: {} for pe in cfg.pes},
    }
    for pe in cfg.pes:
        if "train" in cfg.sections:
            results["pes"][pe]["train"] = bench_train(pe, cfg, device, dtype, log)
        if "eval" in cfg.sections and (not cfg.eval_pes or pe in cfg.eval_pes):
            results["pes"][pe]["eval"] = bench_eval(pe, cfg, device, dtype, log)
        if "gen" in cfg.sections:
            results["pes"][pe]["gen"] = bench_gen(pe, cfg, device, dtype, log)
    if "mfu" in cfg.sections:
        results["mfu"] = bench_mfu(cfg, device, dtype, log)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results["rows"] = table_rows(results)
    (out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "bench.md").write_text(render_markdown(results))
    return results


def _xt_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("x-transformers")
    except Exception:  # noqa: BLE001 - not installed
        return None


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    results = run(cfg)
    print_table(results)
    print(f"wrote {Path(cfg.out) / 'bench.json'} and {Path(cfg.out) / 'bench.md'}")


if __name__ == "__main__":
    main()
