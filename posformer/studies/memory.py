"""Peak memory of one long evaluation window for every PE (part of the LM study, or on its own with
``--memory-only``): a small untrained decoder, one ``length``-token window, batch 1, fp32 on the CPU,
measured by the evaluation harness (process peak RSS and its increase during the forward).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["measure_memory", "memory_table", "write_memory"]

#: the window of the measurement
LENGTH = 16384


def _model(pe: str, length: int) -> Any:
    """The measured model: d_model 128, 4 heads, 2 layers, vocabulary 64, seeded, in eval mode."""
    import torch

    from posformer.model import ModelConfig, build_model
    from posformer.pe import encoding_options, get_encoding_class

    torch.manual_seed(0)
    # a PE with a table of positions (its max_len option) gets one as long as the measured length
    opts = {"max_len": length} if "max_len" in encoding_options(get_encoding_class(pe)) else {}
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=64,
        d_model=128,
        n_heads=4,
        n_layers=2,
        d_ff=512,
        dropout=0.0,
        pe=pe,
        pe_options=opts,
    )
    return build_model(cfg).eval()


def measure_memory(out: Path, pes: list[str], length: int = LENGTH) -> list[dict[str, Any]]:
    """Peak memory of evaluating one ``length``-token window with a small model of every PE (CPU fp32);
    one row per PE (``peak_mem_mb``, ``peak_mem_delta_mb``, ``seconds``, ``status``)."""
    import torch

    from posformer.eval.harness import evaluate_subjects
    from posformer.eval.settings import EvalSettings, Subject

    rows = []
    stream = torch.randint(0, 64, (length + 1,), generator=torch.Generator().manual_seed(0))
    for pe in pes:
        model = _model(pe, length)
        settings = EvalSettings(
            lengths=[length],
            modes=("nonoverlap",),
            n_tokens=length,
            batch_tokens=length,
            position_curves=False,
            progress=False,
        )
        t0 = time.perf_counter()
        res = evaluate_subjects(
            [Subject(pe, model, "lm", stream, pe=pe)],
            settings,
            out / "memory" / pe,
            plots=False,
            tensorboard=False,
        )
        r = res.rows[0]
        rows.append(
            {
                "pe": pe,
                "length": length,
                "peak_mem_mb": r.get("peak_mem_mb"),
                "peak_mem_delta_mb": r.get("peak_mem_delta_mb"),
                "seconds": round(time.perf_counter() - t0, 1),
                "status": r["status"],
            }
        )
        print(
            f"  memory {pe}: peak {r.get('peak_mem_mb')} MiB (+{r.get('peak_mem_delta_mb')}) "
            f"in {rows[-1]['seconds']}s",
            flush=True,
        )
    return rows


def memory_table(mem: list[dict[str, Any]]) -> list[str]:
    """The Markdown section of :func:`measure_memory`'s rows."""
    lines = [
        "## Peak memory at 16 384 tokens (one window, batch 1, fp32 CPU)",
        "",
        "Model d_model=128, 4 heads, 2 layers, untrained; process peak RSS and its increase during the "
        "forward (attention_chunk_mb=256, the default).",
        "",
        "| PE | peak MiB | increase MiB | seconds |",
        "|---|---|---|---|",
    ]
    lines += [f"| {m['pe']} | {m['peak_mem_mb']} | {m['peak_mem_delta_mb']} | {m['seconds']} |" for m in mem]
    return lines


def write_memory(out: Path, pes: list[str]) -> list[str]:
    """Measure every PE of ``pes``, write ``out/memory.json`` and return the Markdown section."""
    mem = measure_memory(out, pes)
    (out / "memory.json").write_text(json.dumps(mem, indent=1))
    return memory_table(mem)
