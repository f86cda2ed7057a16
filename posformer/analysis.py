"""What a positional encoding encodes, as numbers and figures (used by ``posformer-inspect``).

* :func:`embedding_matrix`, :func:`cosine_matrix`: the rows ``PE(0) … PE(T-1)`` of an embedding PE and
  their position × position cosine similarity;
* :func:`mean_diagonal`: the mean of one diagonal (an offset ``k``) of such a matrix or of the
  position-only attention logits (:func:`~posformer.pe.probe.position_logits`);
* :func:`wavelengths`: ``2π/θ_i`` of a few dimension pairs of sinusoidal and rotary PEs;
* :func:`heatmap`, :func:`head_grid`: PNG figures (matplotlib, ``Agg``), colour scales symmetric around
  0, NaN cells (:func:`causal_masked`: keys a causal query never sees) in grey.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posformer.devices import module_device
from posformer.model.positions import arange_positions
from posformer.pe.base import PositionalEncoding

__all__ = [
    "causal_masked",
    "cosine_matrix",
    "embedding_matrix",
    "head_grid",
    "heatmap",
    "mean_diagonal",
    "wavelengths",
]


# ---------------------------------------------------------------------------- measurements
def embedding_matrix(pe: PositionalEncoding, length: int) -> Tensor:
    """The PE rows ``PE(0) … PE(length-1)`` of an embedding PE: (T, D) float32, on the CPU (computed on
    the PE's device)."""
    device = module_device(pe)
    pos = arange_positions(length, device=device)
    with torch.no_grad():
        zeros = torch.zeros(1, length, pe.d_model, device=device)
        return pe.embed(zeros, pos).squeeze(0).float().cpu()


def cosine_matrix(rows: Tensor) -> Tensor:
    """Cosine similarity of every pair of rows: (T, D) -> (T, T)."""
    unit = torch.nn.functional.normalize(rows.double(), dim=-1)
    return (unit @ unit.T).float()


def mean_diagonal(matrix: Tensor, k: int) -> float:
    """Mean of the k-th diagonal (``[..., i, i+k]``; ``k < 0``: below) of the last two dims, heads pooled."""
    return float(matrix.diagonal(offset=k, dim1=-2, dim2=-1).double().mean())


def wavelengths(pe: PositionalEncoding) -> tuple[list[int], list[float], int] | None:
    """``(pair indices, wavelengths 2π/θ_i, number of pairs)`` of sinusoidal/rotary PEs, else ``None``."""
    if "rotary" in pe.caps.hooks and hasattr(pe, "frequencies"):
        inv_freq = pe.frequencies(1, torch.device("cpu"))[0]
    elif "embed" in pe.caps.hooks and hasattr(pe, "base"):
        pairs = torch.arange(0, pe.d_model, 2, dtype=torch.float64, device="cpu")
        inv_freq = pe.base ** (-pairs / pe.d_model)
    else:
        return None
    n = inv_freq.numel()
    idx = sorted({round(x) for x in torch.linspace(0, n - 1, min(n, 8), device="cpu").tolist()})
    return idx, [float(2 * math.pi / inv_freq[i]) for i in idx], n


# ---------------------------------------------------------------------------- figures
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def causal_masked(logits: Tensor) -> Tensor:
    """``logits`` (..., T, T) with keys after the query (``j > i``: never attended causally) as NaN."""
    T = logits.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool, device=logits.device).triu(1)
    return logits.float().masked_fill(future, float("nan"))


def _limit(data: Any) -> float:
    """Symmetric colour limit: the largest finite absolute value (1.0 for an all-zero/NaN matrix)."""
    import numpy as np

    finite = np.abs(data[np.isfinite(data)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _cmap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="0.85")  # NaN cells: light grey, "never looked at"


def heatmap(
    matrix: Tensor,
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    cmap: str = "RdBu_r",
    *,
    colorbar: str = "",
    square: bool = False,
) -> Path:
    """One (rows, cols) matrix as a PNG with a symmetric colour scale; NaN cells drawn grey."""
    plt = _pyplot()

    data = matrix.detach().float().cpu().numpy()
    fig, ax = plt.subplots(figsize=(7, 6) if square else (8, 5.5), layout="constrained")
    lim = _limit(data)
    im = ax.imshow(
        data,
        aspect="equal" if square else "auto",
        cmap=_cmap(cmap),
        vmin=-lim,
        vmax=lim,
        interpolation="nearest",
    )
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(im, ax=ax, label=colorbar)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def head_grid(logits: Tensor, path: Path, title: str, max_heads: int = 8, colorbar: str = "") -> Path:
    """Per-head (T, T) heat maps of ``logits`` (H, T, T) on one colour scale, NaN cells grey.

    A PE whose logits are the same for every head (H = 1: embedding PEs, NoPE) is one full-size
    panel titled "all heads (shared)", not a thumbnail; more than ``max_heads`` heads: the first ones,
    said in the title.
    """
    plt = _pyplot()

    n_heads = int(logits.shape[0])
    heads = min(n_heads, max_heads)
    cols = min(heads, 4)
    rows = -(-heads // cols)
    panel = 5.5 if heads == 1 else 3.4
    fig, axes = plt.subplots(
        rows, cols, figsize=(panel * cols + 1.2, panel * rows + 0.6), squeeze=False, layout="constrained"
    )
    data = logits[:heads].detach().float().cpu().numpy()
    lim = _limit(data)  # one colour scale, so heads can be compared
    cmap = _cmap("RdBu_r")
    im = None
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        im = ax.imshow(data[h], cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title("all heads (shared)" if n_heads == 1 else f"head {h}", fontsize=10)
        if h // cols == rows - 1 or h + cols >= heads:
            ax.set_xlabel("key position")
        if h % cols == 0:
            ax.set_ylabel("query position")
    shown = f" (heads 0–{heads - 1} of {n_heads})" if heads < n_heads else ""
    fig.suptitle(title + shown)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label=colorbar)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
