"""Dynamic position bias: a small MLP over the relative distance (CrossFormer, Wang et al. 2021;
x-transformers' ``DynamicPositionBias``).

    b(i, j) = MLP(δ) ∈ R^H,   δ = i - j,   or δ = sign(i - j) · log(1 + |i - j|) with ``log_distance``

The MLP is ``Linear(1, hidden)`` [+ LayerNorm] + SiLU, ``depth - 1`` times ``Linear(hidden, hidden)``
[+ LayerNorm] + SiLU, then ``Linear(hidden, H)``: the layout of x-transformers, so its weights load
one to one. The bias depends on ``i - j`` only: for integer positions the MLP runs once per distinct
distance and is gathered, never over a (Tq, Tk) grid. Shared across layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error, relative_distance
from posformer.pe.forms import Offsets
from posformer.precision import float32_call


@register("dpb")
class DynamicPositionBias(PositionalEncoding):
    bias_form = Offsets()  # a bias of i - j alone
    paper = "Wang et al. 2021"
    extrapolates = "somewhat (the MLP sees unseen distances)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        hidden: int = 32,
        depth: int = 2,
        log_distance: bool = False,
        norm: bool = False,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if hidden < 1:
            raise option_error("dpb", "hidden", hidden, "must be >= 1")
        if depth < 1:
            raise option_error("dpb", "depth", depth, "must be >= 1 (hidden layers of the MLP)")
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(1 if i == 0 else hidden, hidden))
            if norm:
                layers.append(nn.LayerNorm(hidden))
            layers.append(nn.SiLU())
        layers.append(nn.Linear(hidden, n_heads))
        self.mlp = nn.Sequential(*layers)
        self.log_distance = bool(log_distance)

    def mlp_input(self, dist: Tensor) -> Tensor:
        """The MLP's input from signed distances ``i - j`` (float)."""
        if self.log_distance:
            return torch.sign(dist) * torch.log1p(dist.abs())
        return dist

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        dist = relative_distance(q_pos, k_pos)  # (B|1, Tq, Tk)
        # the MLP in float32 under any autocast or weight dtype: bf16 keeps distances exactly only to 256
        if dist.is_floating_point() or dist.numel() == 0 or dist.shape[-2] == 1:
            # fractional positions; or one query row (the offset vector, a decoding step), whose distances
            # are distinct already: the MLP on them directly, without reading their range on the host
            out = float32_call(self.mlp, self.mlp_input(dist.float()).unsqueeze(-1))  # (B|1, Tq, Tk, H)
        else:  # one MLP row per distinct distance, then a gather
            lo, hi = int(dist.min()), int(dist.max())
            grid = torch.arange(lo, hi + 1, device=dist.device, dtype=torch.float32)
            table = float32_call(self.mlp, self.mlp_input(grid).unsqueeze(-1))  # (hi - lo + 1, H)
            out = table[dist - lo]  # (B|1, Tq, Tk, H)
        return out.permute(0, 3, 1, 2)  # (B|1, H, Tq, Tk)
