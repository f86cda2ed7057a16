"""Sinusoidal absolute positions (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

    PE(pos, 2i)   = sin(pos / base^(2i/d))
    PE(pos, 2i+1) = cos(pos / base^(2i/d))

``layout="interleaved"`` (the paper, default) puts the sine of frequency i in dimension 2i and its
cosine in 2i+1. ``layout="concatenated"`` puts all sines first, then all cosines:
``[sin_0 … sin_{d/2-1}, cos_0 … cos_{d/2-1}]`` (the layout of tensor2tensor's
``get_timing_signal_1d`` and fairseq's ``SinusoidalPositionalEmbedding``; both of those space the
frequencies as ``base^(-i/(d/2-1))`` rather than the paper's ``base^(-2i/d)``, which both layouts use
here). To tell them apart, look at position 0: interleaved gives ``[0, 1, 0, 1, …]``, concatenated
``[0, …, 0, 1, …, 1]``. The two are the same features in another order, so they train alike, but a
checkpoint trained with one does not run with the other.

The table is a non-persistent buffer (never a parameter, not saved in checkpoints), computed in
float64 and stored in float32, so values at position 100 000 are exact to ~1e-7; it is cast to the
activation dtype when added and grows (to the next power of two) when a longer sequence arrives.
Fractional positions are computed directly. ``scale`` multiplies the table; ``learnable_scale``
makes it a learned scalar (the "scaled sinusoidal" variant, Hua et al. 2022).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error


def sinusoid_table(positions: Tensor, dim: int, base: float = 10000.0, layout: str = "interleaved") -> Tensor:
    """Sinusoid values for ``positions`` (any shape ``S``) -> float32 ``S + (dim,)``, computed in float64."""
    pos = positions.to(torch.float64).unsqueeze(-1)  # S + (1,)
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)  # (dim/2,) holds 2i
    inv_freq = torch.exp(-math.log(base) * i / dim)  # base^(-2i/d)
    angle = pos * inv_freq  # S + (dim/2,)
    sin, cos = angle.sin(), angle.cos()
    if layout == "interleaved":
        out = torch.stack((sin, cos), dim=-1).flatten(-2)  # [s0, c0, s1, c1, ...]
    else:
        out = torch.cat((sin, cos), dim=-1)  # [s0 ... , c0 ...]
    return out.to(torch.float32)


@register("sinusoidal")
class SinusoidalEncoding(PositionalEncoding):
    paper = "Vaswani et al. 2017"
    extrapolates = "poorly"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        base: float = 10000.0,
        layout: str = "interleaved",
        scale: float = 1.0,
        learnable_scale: bool = False,
        init_len: int = 1024,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if d_model % 2:
            raise option_error(
                "sinusoidal",
                "d_model",
                d_model,
                "sinusoidal PE pairs sin/cos dimensions and needs an even "
                f"d_model (use {d_model + 1} or {d_model - 1})",
            )
        if layout not in ("interleaved", "concatenated"):
            raise option_error("sinusoidal", "layout", layout, "use 'interleaved' or 'concatenated'")
        if base <= 1:
            raise option_error("sinusoidal", "base", base, "must be > 1")
        self.base = float(base)
        self.layout = layout
        if learnable_scale:
            self.scale = nn.Parameter(torch.tensor(float(scale)))
        else:
            self.register_buffer("scale", torch.tensor(float(scale)), persistent=False)
        # ``init_len`` sized a cached table in checkpoints written before 2026-12; the rows are now computed
        # from the positions (nothing to size), and the option is accepted so those checkpoints load.
        del init_len

    def encodings(self, positions: Tensor) -> Tensor:
        """float32 PE rows for ``positions`` (B|1, T) -> (B|1, T, D), computed in float64 on their device.

        Computed from the positions themselves, integer or fractional: no table sized by the largest
        position, so a training step reads nothing back to the host.
        """
        return sinusoid_table(positions, self.d_model, self.base, self.layout)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        pe = self.encodings(positions) * self.scale  # (B|1, T, D) fp32
        return x + pe.to(x.dtype)
