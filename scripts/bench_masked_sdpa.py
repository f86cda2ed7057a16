"""Why bias PEs trained slower than `nope` on CPU: one attention layer, forward + backward, seven ways.

    python scripts/bench_masked_sdpa.py [--threads N] [--batch 8 --heads 4 --length 512 --head-dim 64]

`is_causal=True` (what nope and rotary PEs use), one full float mask (ALiBi bias + causal -inf), and the
float mask in causal query blocks as posformer runs it (4 and 8 blocks; keys after a block's last query
dropped); the two float-mask variants again with float32 denormals flushed to 0 (`torch.set_flush_denormal`,
what posformer's entry points do: posformer/cpu.py), and `is_causal` flushed. Prints the median
milliseconds of 5 runs and each variant's speed relative to `is_causal` with denormals kept.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    B, H, T, D = a.batch, a.heads, a.length, a.head_dim
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
    i = torch.arange(T)
    bias = -(i[:, None] - i[None, :]).abs().float() * slopes[:, None, None]  # (H, T, T) ALiBi
    mask = bias.masked_fill(i[None, :] > i[:, None], float("-inf")).unsqueeze(0)  # (1, H, T, T)

    def causal() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def full_mask() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    def blocks(n: int) -> Callable[[], None]:
        def run() -> None:
            rows, outs = T // n, []
            for c in range(n):
                s, e = c * rows, (c + 1) * rows
                qc, kc, vc = q[:, :, s:e], k[:, :, :e], v[:, :, :e]
                outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask[:, :, s:e, :e]))
            torch.cat(outs, 2).sum().backward()

        return run

    variants = {  # name: (function, flush denormals)
        "is_causal": (causal, False),
        "float mask": (full_mask, False),
        "mask, 4 causal blocks": (blocks(4), False),
        "mask, 8 causal blocks": (blocks(8), False),
        "is_causal, flushed": (causal, True),
        "float mask, flushed": (full_mask, True),
        "mask, 4 blocks, flushed": (blocks(4), True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn, flush in variants.values():  # warm-up
        torch.set_flush_denormal(flush)
        fn()
    for _ in range(5):  # alternate the variants so machine noise hits all of them
        for name, (fn, flush) in variants.items():
            torch.set_flush_denormal(flush)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["is_causal"])
    print(f"(B, H, T, Dh) = ({B}, {H}, {T}, {D}), {torch.get_num_threads()} threads, forward + backward")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:>24}: {t * 1000:7.1f} ms   speed vs is_causal {ref / t:.2f}")


if __name__ == "__main__":
    main()
