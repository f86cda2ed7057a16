"""xPos: rotary embedding with an exponential decay (Sun et al. 2022, "A Length-Extrapolatable
Transformer").

On top of RoPE, query pair i is multiplied by ``ζ_i^(m/γ)`` and key pair i by ``ζ_i^(-n/γ)`` with
``ζ_i = (2i/R + 0.4) / 1.4`` and ``γ = scale_base`` (512), so the score between query m and key n
decays like ``ζ_i^((m-n)/γ)``. Defined for causal attention only (the decay is one-sided), so a
bidirectional use raises a clear error. The scale is computed in float32 from float64 positions;
in fp16 the key scale ``ζ_0^(-n/γ)`` (``ζ_0 = 0.4/1.4``) passes fp16's maximum 65504 past
``n ≈ 8.8 · scale_base`` (about 4 500 positions for the default 512), so use bf16/fp32 for long
contexts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posformer.pe import register
from posformer.pe.rope.rotary import RotaryEncoding


@register("xpos")
class XPosEncoding(RotaryEncoding):
    causal_only = True
    paper = "Sun et al. 2022"
    extrapolates = "somewhat"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
        layout: str = "half",
        scaling: dict[str, Any] | None = None,
        scale_base: float = 512.0,
        gamma: float = 0.4,
    ) -> None:
        super().__init__(
            d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers, base=base,
            rotary_fraction=rotary_fraction, layout=layout, scaling=scaling,
        )
        self.scale_base = float(scale_base)
        self.gamma = float(gamma)

    def decay(self, positions: Tensor, *, is_query: bool) -> Tensor:
        """float32 per-dimension scale (B|1, 1, T, R) for ``positions`` (B|1, T)."""
        r = self.rotary_dim
        zeta = (torch.arange(0, r, 2, dtype=torch.float64, device=positions.device) / r + self.gamma) / (
            1 + self.gamma
        )  # (R/2,)
        power = positions.to(torch.float64).unsqueeze(-1) / self.scale_base  # (B|1, T, 1)
        scale = zeta ** (power if is_query else -power)  # (B|1, T, R/2)
        scale = torch.cat((scale, scale), -1) if self.layout == "half" else scale.repeat_interleave(2, -1)
        return scale.float().unsqueeze(1)

    def rotary_tables(self, positions: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor]:
        """RoPE's ``(C, S)`` (B|1, 1, T, R) with xPos' decay folded in: ``x' = (x·C + swap(x)·S) · scale``."""
        c, s = super().rotary_tables(positions, is_query=is_query)
        scale = self.decay(positions, is_query=is_query)  # (B|1, 1, T, R)
        return c * scale, s * scale
