"""KERPLE, logarithmic variant (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding
for Length Extrapolation").

    b_h(i, j) = -r1_h · log(1 + r2_h · |i - j|)

with learnable ``r1_h, r2_h > 0`` per head (kept positive by a softplus). Shared across layers
unless ``per_layer=True`` (the paper's GPT-NeoX code keeps one pair per layer).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import BiasAt, Capabilities, PositionalEncoding
from posformer.pe.forms import Offsets


def _inv_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


@register("kerple")
class KERPLE(PositionalEncoding):
    #: bias_fn reads the per-head vectors r1, r2 (H,), each indexed once; per layer with per_layer=true,
    #: one bias shared by every layer otherwise (describe)
    bias_form = Offsets(score_mod=True, trainable=True, per_layer=True)
    paper = "Chi et al. 2022"
    extrapolates = "yes"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        per_layer: bool = False,
        init_r1: float = 1.0,
        init_r2: float = 1.0,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        sets = n_layers if per_layer else 1
        self.per_layer = per_layer
        # spread the heads' initial values over (0.5x, 1.5x) so they do not start identical
        spread = torch.linspace(0.5, 1.5, n_heads)
        self.r1_raw = nn.Parameter(_inv_softplus(init_r1 * spread).repeat(sets, 1))  # (sets, H)
        self.r2_raw = nn.Parameter(_inv_softplus(init_r2 * spread.flip(0)).repeat(sets, 1))
        self.refresh_capabilities()

    def describe(self) -> Capabilities:
        """One bias for every layer unless ``per_layer``."""
        caps = type(self).capabilities
        return replace(caps, bias=replace(caps.bias, per_layer=self.per_layer))

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """``-r1_h · log(1 + r2_h · |i - j|)`` with this layer's (or the shared) ``r1``, ``r2`` (H,)."""
        s = layer if self.per_layer else 0
        r1, r2 = F.softplus(self.r1_raw[s].float()), F.softplus(self.r2_raw[s].float())  # (H,) each, float32

        def kerple(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
            return -r1[h] * torch.log1p(r2[h] * (q_pos - k_pos).abs().float())

        return kerple
