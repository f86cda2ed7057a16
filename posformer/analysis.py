"""What a positional encoding encodes, as numbers and figures (used by ``posformer-inspect``).

* :func:`embedding_matrix`, :func:`cosine_matrix`: the rows ``PE(0) … PE(T-1)`` of an embedding PE and
  their position × position cosine similarity;
* :func:`mean_diagonal`: the mean of one diagonal (an offset ``k``) of such a matrix or of the
  position-only attention logits (:meth:`~posformer.pe.base.PositionalEncoding.position_logits`);
* :func:`wavelengths`: ``2π/θ_i`` of a few dimension pairs of sinusoidal and rotary PEs;
* :func:`heatmap`, :func:`head_grid`: PNG figures (matplotlib, ``Agg``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posformer.model.positions import arange_positions
from posformer.pe.base import PositionalEncoding

__all__ = ["cosine_matrix", "embedding_matrix", "head_grid", "heatmap", "mean_diagonal", "wavelengths"]


# ---------------------------------------------------------------------------- measurements
def embedding_matrix(pe: PositionalEncoding, length: int) -> Tensor:
    """The PE rows ``PE(0) … PE(length-1)`` of an embedding PE: (T, D) float32."""
    pos = arange_positions(length)
    with torch.no_grad():
        return pe.embed(torch.zeros(1, length, pe.d_model), pos).squeeze(0).float()


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
        inv_freq, _, _ = pe.frequencies(1)
    elif "embed" in pe.caps.hooks and hasattr(pe, "base"):
        inv_freq = pe.base ** (-torch.arange(0, pe.d_model, 2, dtype=torch.float64) / pe.d_model)
    else:
        return None
    n = inv_freq.numel()
    idx = sorted({round(x) for x in torch.linspace(0, n - 1, min(n, 8)).tolist()})
    return idx, [float(2 * math.pi / inv_freq[i]) for i in idx], n


# ---------------------------------------------------------------------------- figures
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(matrix: Tensor, path: Path, title: str, xlabel: str, ylabel: str, cmap: str = "RdBu_r") -> Path:
    plt = _pyplot()

    data = matrix.detach().float().numpy()
    fig, ax = plt.subplots(figsize=(7, 5.5))
    lim = float(abs(data).max()) or 1.0
    im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def head_grid(logits: Tensor, path: Path, title: str) -> Path:
    plt = _pyplot()

    heads = min(logits.shape[0], 8)
    cols = min(heads, 4)
    rows = -(-heads // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    lim = float(logits[:heads].abs().max()) or 1.0  # one colour scale, so heads can be compared
    im = None
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        im = ax.imshow(logits[h].float().numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
