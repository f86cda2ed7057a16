"""ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long").

Head ``h`` adds ``-m_h · (i - j)`` to the score of query ``i`` and key ``j`` (causal form; future
keys are masked anyway), or ``-m_h · |i - j|`` in bidirectional attention (the symmetric form used
for encoders). The slopes ``m_h`` are the geometric sequence ``2^(-8h/H)`` for ``H`` a power of
two; for other head counts the reference algorithm takes the slopes of the closest smaller power
of two and fills up with every other slope of the next larger one (:func:`alibi_slopes`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posformer.pe import register
from posformer.pe.base import Capabilities, PositionalEncoding, relative_distance


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
    capabilities = Capabilities(hooks=frozenset({"bias"}), bias_offset_only=True)
    paper = "Press et al. 2022"
    extrapolates = "yes"

    def __init__(self, *, d_model: int, n_heads: int, causal: bool = False, n_layers: int = 1) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        slopes = torch.tensor(alibi_slopes(n_heads), dtype=torch.float32)
        self.register_buffer("slopes", slopes, persistent=False)

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        slopes = self.slopes
        if slopes.dtype != torch.float32:  # the module was cast to half precision: restore exact slopes
            slopes = torch.tensor(alibi_slopes(self.n_heads), dtype=torch.float32, device=slopes.device)
        dist = relative_distance(q_pos, k_pos).abs().float()  # (B|1, Tq, Tk); causal: i-j where visible
        return -slopes.view(1, -1, 1, 1) * dist.unsqueeze(1)  # (B|1, H, Tq, Tk)
