"""xPos: rotary embedding with an exponential decay (Sun et al. 2022, "A Length-Extrapolatable
Transformer").

On top of RoPE, query pair i is multiplied by ``ζ_i^(m/γ)`` and key pair i by ``ζ_i^(-n/γ)`` with
``ζ_i = (2i/R + 0.4) / 1.4`` and ``γ = scale_base`` (512), so the score between query m and key n
decays like ``ζ_i^((m-n)/γ)``. Defined for causal attention only (the decay is one-sided), so a
bidirectional use raises a clear error.

The scale is computed in float64 from the positions and cast at use. Its factors leave a dtype's
range: the query scale ``ζ_0^(m/γ)`` (``ζ_0 = 0.4/1.4``) falls below the smallest normal number past
``m = γ·ln(1/tiny)/ln(1/ζ_0)``, where queries lose their digits, and soon after the key scale
``ζ_0^(-n/γ)`` overflows to inf (NaN scores). :meth:`XPosEncoding.max_positions_in` is that limit:
3,967 positions in float16 and 35,695 in bfloat16/float32 for the default ``scale_base`` 512 (it
grows with ``scale_base``).

The score depends on ``m - n`` only, so a forward over a whole sequence (no cache: evaluation,
scoring) may measure every position from a common origin ``o``: ``ζ^((m-o)/γ) · ζ^(-(n-o)/γ)`` is the
same decay. Past the limit the model centres its positions (:meth:`XPosEncoding.rotary_origin`,
``o = T // 2``, as torchscale and x-transformers always do). Centred, the score of a query and key
near each other at either end of the sequence is a product of one large and one small factor, so the
small one keeps a margin (:data:`CENTRED_MARGIN`: ``2^10`` times the smallest normal number, so the
elements it scales keep their digits where a kernel flushes subnormals): up to 65,723 positions in
bfloat16/float32 (the 64k evaluation fits); float16's range is too small for centring to gain, and
keeps 3,967. Below the limit the origin stays 0, so nothing changes there. Cached decoding keeps
origin 0 (its keys are stored rotated) and the uncentred limit; so do training, where positions may be
sparse, and packed rows, whose positions restart. A longer input is refused with one line
(``PositionRangeError``: ``posformer-eval`` reports the length as n/a with the reason, training refuses
before any work) instead of computing NaN or silently wrong scores.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from posformer.pe import register
from posformer.pe.base import option_error
from posformer.pe.rope.rotary import RotaryEncoding

#: centred, the smaller decay factor stays at least this many times the dtype's smallest normal number
CENTRED_MARGIN = 2.0**10


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
            d_model=d_model,
            n_heads=n_heads,
            causal=causal,
            n_layers=n_layers,
            base=base,
            rotary_fraction=rotary_fraction,
            layout=layout,
            scaling=scaling,
        )
        for key, value in (("scale_base", scale_base), ("gamma", gamma)):
            if not float(value) > 0:
                raise option_error("xpos", key, value, "must be > 0 (every pair's scale must decay)")
        self.scale_base = float(scale_base)
        self.gamma = float(gamma)

    def max_positions_in(self, dtype: torch.dtype, *, centred: bool = False) -> int | None:
        """Positions ``0 … n-1`` whose query scale ``ζ_0^(m/γ)`` stays a normal number of ``dtype`` and of
        float32, the tables' own dtype (the key scale ``ζ_0^(-n/γ)`` overflows later: every IEEE type's
        max exceeds 1/tiny). ``centred``: a forward that centres its positions (:meth:`rotary_origin`),
        whose shifted positions stay within ``c`` of the origin, ``c`` the same bound for a factor of
        ``CENTRED_MARGIN·tiny`` (the other sign swaps the query's and the key's roles).
        """
        zeta0 = self.gamma / (1 + self.gamma)  # the fastest decay: pair 0
        tiny = max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny)
        n = int(self.scale_base * math.log(1 / tiny) / math.log(1 / zeta0)) + 1
        if not (centred and self._movable):
            return n
        # centred, both factors of a near-diagonal score are at the window's edge together: keep the small
        # one >= CENTRED_MARGIN·tiny so elements down to ~1/CENTRED_MARGIN survive a kernel that flushes
        # subnormals (posformer's CPU runs do); never fewer positions than uncentred
        c = int(self.scale_base * math.log(1 / (tiny * CENTRED_MARGIN)) / math.log(1 / zeta0)) + 1
        return max(n, 2 * c - 1)

    @property
    def _movable(self) -> bool:
        """Whether moving the origin keeps the rotation: not under a scaling that reads the sequence
        length from the positions' largest value (dynamic NTK, LongRoPE)."""
        return not self.caps.rotary_depends_on_length

    def rotary_origin(self, length: int, dtype: torch.dtype) -> int:
        """0 within the uncentred limit (the paper's factors, unchanged); past it ``length // 2``: positions
        ``0 … length-1`` become ``-length//2 … length-1-length//2``, up to the centred limit."""
        return length // 2 if self._movable and length > self.max_positions_in(dtype) else 0

    def range_fix(self, dtype: torch.dtype | None, *, centred: bool = False) -> str:
        n = self.max_positions_in(torch.float32, centred=centred)
        wider = (
            f"compute in bfloat16 or float32 (trainer.precision=bf16-mixed or 32-true: {n:,} positions), "
            if dtype is not None and self.max_positions_in(dtype, centred=centred) < n
            else ""
        )
        return (
            f"raise model.pe_options.scale_base={self.scale_base:g} (the range grows with it), {wider}"
            "or shorten the input"
        )

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
