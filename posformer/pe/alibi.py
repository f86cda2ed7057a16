"""ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long").

Head ``h`` adds ``-m_h · (i - j)`` to the score of query ``i`` and key ``j`` (causal form; future
keys are masked anyway), or ``-m_h · |i - j|`` in bidirectional attention (the symmetric form used
for encoders). The slopes ``m_h`` are the geometric sequence ``2^(-8h/H)`` for ``H`` a power of
two; for other head counts the reference algorithm takes the slopes of the closest smaller power
of two and fills up with every other slope of the next larger one (:func:`alibi_slopes`).

Head subset (``biased_heads=n``, x-transformers' ``alibi_num_heads``): the first ``n`` heads get the
slopes of an ``n``-head model, the other ``H - n`` heads slope 0 (no positions).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posformer.pe import register
from posformer.pe.base import BiasAt, PositionalEncoding, option_error
from posformer.pe.forms import Offsets


def alibi_slopes(n_heads: int) -> list[float]:
    """The reference slopes of Press et al. for ``n_heads`` heads."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n_heads - closest]


@register("alibi")
class ALiBi(PositionalEncoding):
    #: a bias of ``i - j``, elementwise (``bias_fn``), and in causal attention ``r(i) + m_h·j``
    bias_form = Offsets(score_mod=True, key_columns=True)
    paper = "Press et al. 2022"
    extrapolates = "yes"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        biased_heads: int | None = None,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if biased_heads is not None and not 1 <= biased_heads <= n_heads:
            rule = f"must be in [1, {n_heads}] (n_heads) or null"
            raise option_error(self.name or "alibi", "biased_heads", biased_heads, rule)
        self.biased_heads = n_heads if biased_heads is None else int(biased_heads)
        self.register_buffer("slopes", self.reference_slopes(), persistent=False)
        self._exact: dict[str, Tensor] = {}  # device -> fp32 slopes, when the buffer was cast to 16 bits

    def reference_slopes(self, device: torch.device | None = None) -> Tensor:
        """float32 (H,): the reference slopes of the first ``biased_heads`` heads, 0 for the others."""
        slopes = alibi_slopes(self.biased_heads) + [0.0] * (self.n_heads - self.biased_heads)
        return torch.tensor(slopes, dtype=torch.float32, device=device)

    def _float_slopes(self) -> Tensor:
        """float32 (H,): the slopes buffer, or where the module was cast to half precision the exact
        slopes, made once per device (no host-to-device copy per call)."""
        slopes = self.slopes
        if slopes.dtype != torch.float32:
            key = str(slopes.device)
            slopes = self._exact.get(key)
            if slopes is None:
                slopes = self._exact[key] = self.reference_slopes(self.slopes.device)
        return slopes

    def key_position_bias(self, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        """Causal ALiBi ``-m_h·(i - j) = -m_h·i + m_h·j``: the key's part ``m_h·j``, (B|1, H, Tk) float32."""
        return self._float_slopes().view(-1, 1) * k_pos.float().unsqueeze(1)

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """``-m_h · |i - j|`` (causal: ``i - j`` where visible)."""
        slopes = self._float_slopes()

        def alibi(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
            return -slopes[h] * (q_pos - k_pos).abs().float()

        return alibi
