"""No-grad attention: the compiled FlexAttention forward and the PEs' own shortcuts against the SDPA
backends without them.

One causal attention call ``attend(q, k, v, ctx)`` of a d_model/heads model at each length, batch 1,
under ``torch.inference_mode``, for each PE, in alternating repetitions (after one warm-up each, which
for Flex includes the compilation, reported separately):
- ``sdpa``: ``model.attention_backend=sdpa`` (today's CPU path; a PE's shortcut included);
- ``flex``: ``model.attention_backend=flex``, for PEs with an elementwise bias (a Flex ``score_mod``);
- ``no-shortcut``: ``sdpa`` with the ``shortcut`` backend switched off, for PEs with
  ``caps.attention_shortcut`` (Shaw, CoPE): their explicit or masked path.
The decision in ``posformer.model.backends`` follows these numbers (``docs/performance.md``).

    OMP_NUM_THREADS=2 python scripts/bench_attention.py --lengths 4096 16384 --pes fire shaw rope
    python scripts/bench_attention.py --pes cope alibi --out bench.json   # also write the numbers as JSON
    python scripts/bench_attention.py --device cuda --pes cope alibi --lengths 65536 --d-model 1024 --heads 16
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
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.pe import build_encoding

#: the variants timed, as backend policies (which ones apply to a PE: :func:`variants`)
POLICIES = {
    "sdpa": BackendPolicy(choice="sdpa"),
    "flex": BackendPolicy(choice="flex"),
    "no-shortcut": BackendPolicy(choice="sdpa", off=frozenset({"shortcut"})),
}


def variants(name: str, d_model: int, heads: int) -> tuple[str, ...]:
    """The :data:`POLICIES` that mean something for PE ``name``: ``sdpa`` always, ``flex`` for a Flex
    ``score_mod`` (no value term, no bias or an elementwise one), ``no-shortcut`` for a shortcut."""
    caps = build_encoding(name, d_model=d_model, n_heads=heads, causal=True).caps
    has_flex = "value" not in caps.hooks and (caps.bias is None or caps.bias.score_mod)
    return ("sdpa",) + ("flex",) * has_flex + ("no-shortcut",) * caps.attention_shortcut


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_call(
    pe_name: str, length: int, variant: str, d_model: int, heads: int, device: torch.device
) -> tuple[float, float]:
    """(first call's seconds, a later call's seconds) of causal attention over ``length`` tokens."""
    torch.manual_seed(0)
    pe = build_encoding(pe_name, d_model=d_model, n_heads=heads, causal=True) if pe_name != "nope" else None
    if pe is not None and not pe.caps.in_attention:
        pe = None
    if pe is not None:
        pe.to(device)
    q, k, v = (torch.randn(1, heads, length, d_model // heads, device=device) for _ in range(3))
    pos = torch.arange(length, device=device)[None]
    times = []
    with torch.inference_mode():
        for _ in range(2):
            if pe is not None and "rotary" in pe.caps.hooks:
                qr, kr = pe.rotate(q, pos, is_query=True), pe.rotate(k, pos, is_query=False)
            else:
                qr, kr = q, k
            ctx = AttentionContext(pe, pos, pos, causal=True, policy=POLICIES[variant])
            _sync(device)
            start = time.perf_counter()
            attend(qr, kr, v, ctx)
            _sync(device)
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default="", help="write the results as JSON to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    device = torch.device(args.device)
    rows = []
    for name in args.pes:
        names = variants(name, args.d_model, args.heads) if name != "nope" else ("sdpa",)
        for length in args.lengths:
            reps: dict[str, list[float]] = {b: [] for b in names}
            first: dict[str, float] = {}
            for r in range(args.reps):  # alternating repetitions
                for b in names if r % 2 == 0 else names[::-1]:
                    t0, t1 = one_call(name, length, b, args.d_model, args.heads, device)
                    first.setdefault(b, t0)
                    reps[b].append(t1)
            med = {b: statistics.median(ts) for b, ts in reps.items()}
            row = {
                "pe": name,
                "length": length,
                "flex_path": "flex" in names,
                "first_call_s": first,
                "reps_s": reps,
                "median_s": med,
            }
            # speed-up of sdpa (today's path) over the shortcut-less path; of flex over sdpa
            if "flex" in med:
                row["flex_speedup"] = med["sdpa"] / med["flex"]
            if "no-shortcut" in med:
                row["shortcut_speedup"] = med["no-shortcut"] / med["sdpa"]
            rows.append(row)
            times = "  ".join(f"{b} {t:.3f}s" for b, t in med.items())
            gains = "  ".join(
                f"{key} {row[key]:.2f}x" for key in ("flex_speedup", "shortcut_speedup") if key in row
            )
            print(f"{name:>8} T={length:>6}  {times}  {gains}", flush=True)
    if args.out:
        meta = {
            "machine": platform.processor() or platform.machine(),
            "device": str(device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "d_model": args.d_model,
            "heads": args.heads,
            "flex_available": flex.available(),
        }
        atomic_write_json(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
