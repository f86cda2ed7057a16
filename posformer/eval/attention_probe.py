"""Attention probe: where a decoder-only model's attention goes, per layer and head.

Two measures over a batch of token sequences, from the attention probabilities every self-attention
layer computes (the explicit softmax records them: :class:`~posformer.model.context.AttentionContext`'s
``probe``; sinks take their share, so a head that parks mass in a sink shows less on every key):

* **first-token mass** ``m[l, h]``: the mean over batch rows and queries ``i >= 1`` of the probability
  query ``i`` gives token 0 (the "attention sink"; Xiao et al. 2023, Qiu et al. 2025 report it for
  gated and ungated attention);
* **entropy against distance**: the entropy ``-Σ_j p_ij log p_ij`` (nats) of query ``i``'s attention,
  head mean, binned by the query's distance from the first token ``i`` in powers of two
  (``[1, 2), [2, 4), …``), next to ``log(i + 1)``, the entropy of uniform attention over the ``i + 1``
  keys a causal query sees.

:func:`write_probe` writes ``attention_probe.json``, ``attention_first_token.csv``,
``attention_entropy.csv``, ``attention_probe.md`` and ``attention_probe.png`` (+ ``.svg``).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError
from posformer.io import atomic_write_json, atomic_write_text


def attention_probabilities(model: nn.Module, ids: Tensor) -> Tensor:
    """Every decoder self-attention layer's probabilities for ``ids`` (B, T): float32 (L, B, H, T, T)."""
    cfg = model.cfg
    if cfg.kind != "decoder":
        raise ConfigError(
            f"the attention probe reads decoder-only models; this one is model.kind={cfg.kind!r}: "
            "probe a decoder-only run (model=decoder_tiny, decoder_small, ...)."
        )
    record: dict[int, list[tuple[int, int, Tensor]]] = {}
    model.__dict__["_attention_probe"] = record
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.__dict__.pop("_attention_probe", None)
    b, t = ids.shape
    out = torch.zeros(cfg.n_layers, b, cfg.n_heads, t, t, device=ids.device)
    for layer, blocks in record.items():
        for start, first, probs in blocks:
            rows, keys = probs.shape[-2:]
            out[layer, :, :, start : start + rows, first : first + keys] = probs.float()
    return out


def distance_bins(length: int) -> list[tuple[int, int]]:
    """Query distances from the first token ``1 … length-1`` in powers of two: ``[(1, 2), (2, 4), …]``."""
    edges, lo = [], 1
    while lo < length:
        edges.append((lo, min(2 * lo, length)))
        lo *= 2
    return edges


def probe_stats(probs: Tensor) -> dict[str, Any]:
    """The probe's numbers from probabilities (L, B, H, T, T) (module docstring)."""
    n_layers, _, n_heads, t, _ = probs.shape
    if t < 2:
        raise ConfigError(f"the attention probe needs sequences of at least 2 tokens, got {t}.")
    first = probs[..., 1:, 0].mean(dim=(1, 3))  # (L, H)
    logs = torch.where(probs > 0, probs.clamp_min(1e-30).log(), torch.zeros_like(probs))
    entropy = -(probs * logs).sum(-1).mean(dim=(1, 2))  # (L, T): mean over batch rows and heads
    bins = distance_bins(t)
    by_bin = [[float(entropy[layer, lo:hi].mean()) for lo, hi in bins] for layer in range(n_layers)]
    uniform = [sum(math.log(i + 1) for i in range(lo, hi)) / (hi - lo) for lo, hi in bins]
    return {
        "layers": n_layers,
        "heads": n_heads,
        "length": t,
        "first_token_mass": first.tolist(),
        "first_token_mass_mean": float(first.mean()),
        "first_token_mass_by_layer": first.mean(1).tolist(),
        "distance_bins": [list(b) for b in bins],
        "entropy": by_bin,
        "uniform_entropy": uniform,
    }


def _csv(rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def markdown(stats: dict[str, Any], title: str) -> str:
    """The probe's two tables as Markdown."""
    heads = stats["heads"]
    lines = [f"# Attention probe: {title}", "", "## First-token attention mass (queries i >= 1)", ""]
    lines.append("| layer | mean | " + " | ".join(f"h{h}" for h in range(heads)) + " |")
    lines.append("|---:|---:|" + "---:|" * heads)
    for layer, row in enumerate(stats["first_token_mass"]):
        cells = " | ".join(f"{v:.3f}" for v in row)
        lines.append(f"| {layer} | {stats['first_token_mass_by_layer'][layer]:.3f} | {cells} |")
    lines.append(f"\nAll layers and heads: **{stats['first_token_mass_mean']:.3f}**.\n")
    lines += ["## Attention entropy (nats, head mean) against the query's distance from token 0", ""]
    bins = [f"[{lo}, {hi})" for lo, hi in stats["distance_bins"]]
    lines.append("| layer | " + " | ".join(bins) + " |")
    lines.append("|---:|" + "---:|" * len(bins))
    for layer, row in enumerate(stats["entropy"]):
        lines.append(f"| {layer} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    lines.append("| uniform | " + " | ".join(f"{v:.3f}" for v in stats["uniform_entropy"]) + " |")
    return "\n".join(lines) + "\n"


def figure(stats: dict[str, Any], path: Path, title: str) -> Path:
    """First-token mass (layer x head) beside entropy against distance: ``path`` (.png) and its .svg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posformer.utils.figures import write_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    mass = stats["first_token_mass"]
    image = left.imshow(mass, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    left.set(xlabel="head", ylabel="layer", title="attention mass on the first token")
    left.set_xticks(range(stats["heads"]))
    left.set_yticks(range(stats["layers"]))
    fig.colorbar(image, ax=left, label="mean probability (queries i >= 1)")
    centres = [math.sqrt(lo * max(hi - 1, lo)) for lo, hi in stats["distance_bins"]]
    for layer, row in enumerate(stats["entropy"]):
        right.plot(centres, row, marker="o", label=f"layer {layer}")
    right.plot(centres, stats["uniform_entropy"], color="0.5", linestyle="--", label="uniform")
    right.set(xscale="log", xlabel="query distance from the first token", ylabel="entropy (nats)")
    right.set_title("attention entropy against distance")
    right.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    out = write_figure(fig, path)
    plt.close(fig)
    return out


def write_probe(stats: dict[str, Any], out_dir: Path, title: str, meta: dict[str, Any]) -> list[Path]:
    """The probe's JSON, two CSVs, Markdown and figure in ``out_dir``; returns the written paths."""
    out_dir = Path(out_dir)
    paths = [atomic_write_json(out_dir / "attention_probe.json", {**meta, **stats}, indent=2)]
    first = [["layer", "head", "first_token_mass"]]
    first += [
        [layer, h, f"{v:.6f}"]
        for layer, row in enumerate(stats["first_token_mass"])
        for h, v in enumerate(row)
    ]
    paths.append(atomic_write_text(out_dir / "attention_first_token.csv", _csv(first)))
    ent = [["layer", "distance_lo", "distance_hi", "entropy", "uniform_entropy"]]
    for layer, row in enumerate(stats["entropy"]):
        for (lo, hi), v, u in zip(stats["distance_bins"], row, stats["uniform_entropy"], strict=True):
            ent.append([layer, lo, hi, f"{v:.6f}", f"{u:.6f}"])
    paths.append(atomic_write_text(out_dir / "attention_entropy.csv", _csv(ent)))
    paths.append(atomic_write_text(out_dir / "attention_probe.md", markdown(stats, title)))
    png = figure(stats, out_dir / "attention_probe.png", title)
    return [*paths, png, png.with_suffix(".svg")]
