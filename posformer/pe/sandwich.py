"""Sandwich: the parameter-free bias from inner products of sinusoidal embeddings (Chi et al. 2023,
"Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis").

With ``p_m`` the sinusoidal embedding of position ``m`` in ``d'`` = ``dim`` dimensions, the score
bias of head ``h`` is the inner product ``p_i·p_j`` (a function of ``i - j`` only), shifted so that it
is 0 at distance 0 and negative elsewhere:

    b_h(i, j) = scale · ( Σ_{k=1}^{d'/2} cos( (i - j) / (r_h · base^(2k/d')) ) - d'/2 )

``r_h = 8h/H`` (``h = 1 … H``) with ``compress=True`` spreads the heads' receptive fields like ALiBi's
slopes (head 1 the most local); ``compress=False`` gives every head ``r_h = 1``. ``cos`` is even, so
the bias is symmetric and serves bidirectional attention unchanged. Computed in float64, returned
float32. No parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error, relative_distance
from posformer.pe.forms import Offsets


@register("sandwich")
class Sandwich(PositionalEncoding):
    bias_form = Offsets()  # a bias of i - j alone
    paper = "Chi et al. 2023"
    extrapolates = "yes"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        dim: int = 128,
        base: float = 10000.0,
        scale: float = 1.0,
        compress: bool = True,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if dim < 2 or dim % 2:
            raise option_error("sandwich", "dim", dim, "must be an even number >= 2 (sin/cos pairs)")
        if base <= 1:
            raise option_error("sandwich", "base", base, "must be > 1")
        if scale <= 0:
            raise option_error("sandwich", "scale", scale, "must be > 0")
        self.dim, self.base, self.scale, self.compress = int(dim), float(base), float(scale), bool(compress)

    def frequencies(self, device: torch.device | None = None) -> Tensor:
        """float64 (H, d'/2) on ``device``: ``1 / (r_h · base^(2k/d'))`` for ``k = 1 … d'/2``."""
        k = torch.arange(1, self.dim // 2 + 1, dtype=torch.float64, device=device)
        inv = self.base ** (-2 * k / self.dim)  # (d'/2,)
        h = torch.arange(1, self.n_heads + 1, dtype=torch.float64, device=device)
        ratio = 8 * h / self.n_heads if self.compress else torch.ones_like(h)  # (H,)
        return inv.unsqueeze(0) / ratio.unsqueeze(1)

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        dist = relative_distance(q_pos, k_pos).to(torch.float64)  # (B|1, Tq, Tk)
        freq = self.frequencies(dist.device)  # (H, d'/2), made where it is used (no copy per call)
        if dist.numel() * freq.numel() <= 2**24:  # small: one broadcast
            total = torch.cos(dist[:, None, ..., None] * freq[None, :, None, None, :]).sum(-1)
        else:  # long inputs: one frequency at a time, (B|1, H, Tq, Tk) at most
            cols = range(freq.shape[1])
            total = sum(torch.cos(dist.unsqueeze(1) * freq[None, :, i, None, None]) for i in cols)
        return (self.scale * (total - self.dim / 2)).float()  # (B|1, H, Tq, Tk)
