"""Polar coordinate position embedding, PoPE (Gopalakrishnan et al. 2025, "Decoupling the 'What' and
'Where' With Polar Coordinate Positional Embeddings", arXiv:2509.10534).

RoPE rotates pairs of dimensions, so a pair's phase mixes content ("what") and position ("where").
PoPE keeps them apart: each of the ``Dh`` dimensions of a query or key becomes one complex number whose
magnitude is the content, ``μ_c = softplus(x_c)``, and whose phase is the position alone,
``t·θ_c`` with ``θ_c = base^(-c/Dh)``, ``c = 0 … Dh-1`` (``Dh`` frequencies, not RoPE's ``Dh/2``).
Keys add a learned per-head phase bias ``δ_{h,c}``, clamped to ``[-2π, 0]``. The real part of
``q·conj(k)`` is

    s(t, s) = Σ_c μ^q_c μ^k_c cos((t - s)·θ_c - δ_{h,c})

which depends on the positions through ``t - s`` only. It is one real dot product of the width-``2Dh``
vectors ``(μ cos φ, μ sin φ)`` (x-transformers' layout, ``apply_polar_pos_emb``), so attention stays
the fused SDPA path: :meth:`PolarEncoding.apply_rotary` maps q and k (B, H, T, Dh) to (B, H, T, 2Dh)
and the values keep ``Dh``. Attention scales a dot product by ``1/√(width)``; the query's tables carry
a factor ``√2`` so the scores are the paper's (and x-transformers') ``s / √Dh``.

Angles are computed in float64 from the positions (and the bias), and stored as float32 cos/sin; the
magnitudes are the softplus of the float32 input, cast back to the input's dtype at the end, so a
bf16 run sees the positions of a float32 run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error

#: the phase bias lives in ``[-2π, 0]`` (clamped at use, as in the reference)
BIAS_RANGE = (-2.0 * math.pi, 0.0)
#: ways to initialise the phase bias: zeros (the reference's default) or uniform over its range
BIAS_INITS = ("zero", "uniform")


@register("pope")
class PolarEncoding(PositionalEncoding):
    """PoPE: softplus magnitudes at positional phases, a learned per-head phase bias on the keys.

    Args:
        base: frequency base, ``θ_c = base^(-c/Dh)``.
        bias_init: ``zero`` (x-transformers' default) or ``uniform`` (``U(-2π, 0)``, x-transformers'
            ``polar_bias_uniform_init``).
    """

    paper = "Gopalakrishnan et al. 2025"
    extrapolates = "yes (paper: zero-shot to 10x)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        base: float = 10000.0,
        bias_init: str = "zero",
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        name = self.name or "pope"
        if not float(base) > 1:
            raise option_error(name, "base", base, "must be > 1")
        if bias_init not in BIAS_INITS:
            raise option_error(name, "bias_init", bias_init, f"use one of {', '.join(BIAS_INITS)}")
        self.base = float(base)
        self.bias_init = bias_init
        self.phase_bias = nn.Parameter(torch.zeros(n_heads, self.head_dim))  # δ (H, Dh)
        if bias_init == "uniform":
            with torch.no_grad():
                self.phase_bias.uniform_(*BIAS_RANGE)

    def inv_freq(self, device: torch.device | None = None) -> Tensor:
        """θ_c = base^(-c/Dh), float64 (Dh,)."""
        c = torch.arange(self.head_dim, dtype=torch.float64, device=device)
        return self.base ** (-c / self.head_dim)

    def phases(self, positions: Tensor, *, is_query: bool) -> Tensor:
        """float64 phases (B|1, H|1, T, Dh) of ``positions`` (B|1, T): ``t·θ_c``, keys ``+ δ_{h,c}``."""
        angle = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq(positions.device)  # (B|1, T, Dh)
        angle = angle.unsqueeze(1)  # (B|1, 1, T, Dh)
        if is_query:
            return angle
        bias = self.phase_bias.to(torch.float64).clamp(*BIAS_RANGE)  # (H, Dh)
        return angle + bias[None, :, None, :]  # (B|1, H, T, Dh)

    def rotary_tables(self, positions: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor]:
        """float32 ``(cos φ, sin φ)`` of :meth:`phases`, (B|1, 1, T, Dh) for queries (times √2: attention
        divides by the square root of the doubled width) and (B|1, H, T, Dh) for keys."""
        phi = self.phases(positions, is_query=is_query)
        gain = math.sqrt(2.0) if is_query else 1.0
        return (phi.cos() * gain).float(), (phi.sin() * gain).float()

    def apply_rotary(self, x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        """``x`` (B, H, T, Dh) -> ``(μ cos φ, μ sin φ)`` (B, H, T, 2Dh) in x's dtype; ``μ = softplus(x)``."""
        cos, sin = tables
        mag = F.softplus(x.float())  # (B, H, T, Dh)
        return torch.cat((mag * cos, mag * sin), dim=-1).to(x.dtype)
