"""Where the PEs' own attentions pay: one layer's attention at each length, the shortcut against the
path it replaces, side by side (the measurement behind ``ShawRelative.min_shortcut_len`` and
``cope.SATURATION_MIN_LEN``; ``docs/performance.md``, "Where the shortcuts pay").

Rows (each at ``--tokens`` tokens per call, B = tokens / T; H 4, Dh 64; alternating repetitions after
one warm-up each; the median ratio of per-repetition times):
- ``shaw`` (k 16), causal and bidirectional, with and without gradients: ``shortcut`` against the
  ``explicit`` softmax, both through their backends (``backends.BACKENDS``);
- ``cope`` without gradients: its exact function (``cope._CopeTraining``'s forward) against the
  saturation shortcut and the ``masked`` path;
- ``--model-lengths``: a whole training step (forward and backward) of the Multi30k model
  (``experiment=multi30k_de_en`` sizes: 3+3 layers, d 256, vocabulary 8 000, Shaw in the encoder and
  decoder) on a padded batch of 2 048 source tokens, with Shaw's shortcut forced on
  (``shortcut_min_len=0``) against the explicit softmax.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/bench_shortcut_length.py --out outputs/perf/shortcut_length
    python scripts/bench_shortcut_length.py --lengths 64 256 1024 --reps 3      # fewer points

Writes ``results.json`` (every repetition) and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posformer.io import atomic_write_json, atomic_write_text
from posformer.model.backends import BACKENDS, shortcut
from posformer.model.context import AttentionContext
from posformer.pe import build_encoding, cope
from posformer.utils.format import markdown_table


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _compare(variants: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Seconds of each variant per repetition, alternated (one untimed warm-up each)."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(_timed(fn))
    return times


def shaw_row(t: int, causal: bool, grad: bool, tokens: int, reps: int) -> dict[str, object]:
    """Shaw's shortcut against the explicit softmax at ``t`` tokens: times and explicit / shortcut."""
    pe = build_encoding("shaw", d_model=256, n_heads=4, causal=causal, shortcut_min_len=0)
    b, pos = max(1, tokens // t), torch.arange(t)[None]
    q, k, v = (torch.randn(b, 4, t, 64, requires_grad=grad) for _ in range(3))

    def run(name: str) -> Callable[[], object]:
        def step() -> None:
            ctx = AttentionContext(pe, pos, pos, causal=causal, from_zero=True)
            with torch.set_grad_enabled(grad):
                out = BACKENDS[name](q, k, v, ctx, 0, 0.0)
                if grad:
                    out.sum().backward()

        return step

    times = _compare({"shortcut": run("shortcut"), "explicit": run("explicit")}, reps)
    ratio = statistics.median(e / s for s, e in zip(times["shortcut"], times["explicit"], strict=True))
    return {
        "pe": "shaw",
        "attention": "causal" if causal else "bidirectional",
        "grad": grad,
        "T": t,
        "B": b,
        "times": times,
        "ratio": ratio,
    }


def cope_row(t: int, tokens: int, reps: int) -> dict[str, object]:
    """CoPE without gradients at ``t`` tokens: its exact function, the saturation shortcut, the masked
    path; the ratio is shortcut / function (> 1: the function is faster)."""
    pe = build_encoding("cope", d_model=256, n_heads=4, causal=True)
    b, pos = max(1, tokens // t), torch.arange(t)[None]
    q, k, v = (torch.randn(b, 4, t, 64) for _ in range(3))
    ctx = lambda: AttentionContext(pe, pos, pos, causal=True, from_zero=True)  # noqa: E731
    variants = {
        "function": lambda: cope._CopeTraining.apply(q, k, v, pe.pos_emb[0], pe.max_pos - 1, None),
        "saturation": lambda: pe.attention(q, k, v, causal=True, causal_lse=shortcut.cpu_causal_lse),
        "masked": lambda: BACKENDS["masked"](q, k, v, ctx(), 0, 0.0),
    }
    saved = cope.SATURATION_MIN_LEN
    cope.SATURATION_MIN_LEN = 0  # pe.attention: the saturation shortcut at every length
    try:
        with torch.no_grad():
            times = _compare(variants, reps)
    finally:
        cope.SATURATION_MIN_LEN = saved
    ratio = statistics.median(s / f for f, s in zip(times["function"], times["saturation"], strict=True))
    return {
        "pe": "cope",
        "attention": "causal",
        "grad": False,
        "T": t,
        "B": b,
        "times": times,
        "ratio": ratio,
    }


def translation_row(s: int, reps: int) -> dict[str, object]:
    """The Multi30k-sized model's training step on a padded batch of ``s`` tokens a side: Shaw's
    shortcut at every length against the explicit softmax (explicit / shortcut time)."""
    from posformer.model import ModelConfig, build_model
    from posformer.model.context import BackendPolicy

    cfg = ModelConfig(
        kind="encoder_decoder",
        d_model=256,
        n_heads=4,
        n_encoder_layers=3,
        n_decoder_layers=3,
        d_ff=1024,
        dropout=0.0,
        vocab_size=8000,
        pe="shaw",
        pe_options={"shortcut_min_len": 0},
        pe_apply={"encoder": True, "decoder": True, "cross": False},
    )
    model = build_model(cfg).train()
    b = max(1, 2048 // s)
    gen = torch.Generator().manual_seed(0)
    src, tgt = (torch.randint(4, 8000, (b, s), generator=gen) for _ in range(2))
    lengths = [torch.randint(s // 3, s + 1, (b,), generator=gen) for _ in range(2)]
    src_mask, tgt_mask = (torch.arange(s)[None] < n[:, None] for n in lengths)  # (B, S) padded rows

    def step(policy: BackendPolicy) -> Callable[[], object]:
        def run() -> None:
            model.attention_policy = policy
            model(src, tgt, src_mask, tgt_mask).float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    off = BackendPolicy(off=frozenset({"shortcut"}))
    times = _compare({"shortcut": step(BackendPolicy()), "explicit": step(off)}, reps)
    ratio = statistics.median(e / s_ for s_, e in zip(times["shortcut"], times["explicit"], strict=True))
    return {
        "pe": "shaw (Multi30k model)",
        "attention": "encoder-decoder",
        "grad": True,
        "T": s,
        "B": b,
        "times": times,
        "ratio": ratio,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192, 256, 320, 384, 512, 1024])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per call (B = tokens / T)")
    p.add_argument("--model-lengths", type=int, nargs="*", default=[32, 128, 512], help="[] to skip")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="outputs/perf/shortcut_length")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rows = []
    for t in a.lengths:
        for causal in (True, False):
            for grad in (True, False):
                rows.append(shaw_row(t, causal, grad, a.tokens, a.reps))
                print(f"shaw {rows[-1]['attention']} grad={grad} T {t}: x{rows[-1]['ratio']:.2f}", flush=True)
        rows.append(cope_row(t, a.tokens, a.reps))
        print(f"cope no grad T {t}: function x{rows[-1]['ratio']:.2f} vs saturation", flush=True)
    for s in a.model_lengths:
        rows.append(translation_row(s, a.reps))
        print(f"Multi30k model T {s}: x{rows[-1]['ratio']:.2f}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", {"args": vars(a), "rows": rows})
    table = [
        {
            "PE": r["pe"],
            "attention": r["attention"],
            "grad": r["grad"],
            "T": r["T"],
            "B": r["B"],
            **{f"{n} ms": round(statistics.median(x) * 1e3, 1) for n, x in r["times"].items()},
            "ratio": round(r["ratio"], 2),
        }
        for r in rows
    ]
    columns = [(key, key) for key in dict.fromkeys(key for row in table for key in row)]  # every row's keys
    atomic_write_text(out / "results.md", markdown_table(table, columns, digits={"ratio": 2}) + "\n")
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
