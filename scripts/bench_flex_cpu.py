"""CPU, no-grad attention: the compiled FlexAttention forward against today's path (SDPA backends).

One causal attention call ``attend(q, k, v, ctx)`` of a d_model/heads model at each length, batch 1,
under ``torch.inference_mode``, for each PE: ``model.attention_backend=flex`` against ``sdpa``, in
alternating repetitions (after one warm-up each, which for Flex includes the compilation, reported
separately). PEs without ``caps.elementwise_bias`` (Shaw reads the queries) have no Flex path and are
reported as such. The decision in ``posformer.model.backends.flex`` (``auto`` on the CPU) follows
these numbers (``docs/performance.md``).

    OMP_NUM_THREADS=2 python scripts/bench_flex_cpu.py --lengths 4096 16384 --pes fire shaw rope
    python scripts/bench_flex_cpu.py --out bench_flex_cpu.json   # also write the numbers as JSON
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch

from posformer.io import atomic_write_json
from posformer.model.attention import attend
from posformer.model.backends import flex
from posformer.model.context import AttentionContext
from posformer.pe import build_encoding


def one_call(pe_name: str, length: int, backend: str, d_model: int, heads: int) -> tuple[float, float]:
    """(first call's seconds, a later call's seconds) of causal attention over ``length`` tokens."""
    torch.manual_seed(0)
    pe = build_encoding(pe_name, d_model=d_model, n_heads=heads, causal=True) if pe_name != "nope" else None
    if pe is not None and not pe.caps.in_attention:
        pe = None
    q, k, v = (torch.randn(1, heads, length, d_model // heads) for _ in range(3))
    pos = torch.arange(length)[None]
    times = []
    with torch.inference_mode():
        for _ in range(2):
            if pe is not None and "rotary" in pe.caps.hooks:
                qr, kr = pe.rotate(q, pos, is_query=True), pe.rotate(k, pos, is_query=False)
            else:
                qr, kr = q, k
            ctx = AttentionContext(pe, pos, pos, causal=True, attention_backend=backend)
            start = time.perf_counter()
            attend(qr, kr, v, ctx)
            times.append(time.perf_counter() - start)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--pes", nargs="+", default=["fire", "shaw", "rope"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--out", default="", help="write the results as JSON to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    rows = []
    for name in args.pes:
        probe = build_encoding(name, d_model=args.d_model, n_heads=args.heads, causal=True)
        has_flex = "value" not in probe.caps.hooks and (
            "bias" not in probe.caps.hooks or probe.caps.elementwise_bias
        )
        for length in args.lengths:
            backends = ("sdpa", "flex") if has_flex else ("sdpa",)
            reps: dict[str, list[float]] = {b: [] for b in backends}
            first: dict[str, float] = {}
            for r in range(args.reps):  # alternating repetitions
                for b in backends if r % 2 == 0 else backends[::-1]:
                    t0, t1 = one_call(name, length, b, args.d_model, args.heads)
                    first.setdefault(b, t0)
                    reps[b].append(t1)
            row = {"pe": name, "length": length, "flex_path": has_flex, "first_call_s": first, "reps_s": reps}
            med = {b: statistics.median(ts) for b, ts in reps.items()}
            row["median_s"] = med
            if has_flex:
                row["flex_speedup"] = med["sdpa"] / med["flex"]
            rows.append(row)
            speed = (
                f"flex {med['flex']:.3f}s  speed-up {row['flex_speedup']:.2f}x"
                if has_flex
                else "no Flex path"
            )
            print(f"{name:>8} T={length:>6}  sdpa {med['sdpa']:.3f}s  {speed}", flush=True)
    if args.out:
        meta = {
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "d_model": args.d_model,
            "heads": args.heads,
            "flex_available": flex.available(),
        }
        atomic_write_json(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
