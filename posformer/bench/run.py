"""One benchmark run: every section for every PE, then ``bench.json`` and ``bench.md`` in ``cfg.out``."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from posformer.bench.config import BenchConfig, resolve_device
from posformer.bench.models import xt_version
from posformer.bench.report import render_markdown, table_rows
from posformer.bench.sections import bench_eval, bench_gen, bench_mfu, bench_train
from posformer.cpu import configure_cpu
from posformer.io import atomic_write_text


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run ``cfg.sections`` for ``cfg.pes``; returns the results (also written to ``cfg.out``)."""
    device, dtype = resolve_device(cfg)
    configure_cpu(cfg.threads or None, cfg.flush_denormal)
    if cfg.compare and xt_version() is None:
        log(
            "x-transformers is not installed: its columns stay empty (pip install -e '.[bench]' to "
            "compare; --no-compare to say so)"
        )
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
            "x_transformers": xt_version(),
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
    atomic_write_text(out / "bench.json", json.dumps(results, indent=1, default=str))
    atomic_write_text(out / "bench.md", render_markdown(results))
    return results
