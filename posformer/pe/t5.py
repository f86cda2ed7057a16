"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning").

The key-minus-query offset ``j - i`` is mapped to one of ``num_buckets`` buckets: half of them for
exact small offsets, the rest logarithmically spaced up to ``max_distance`` (offsets beyond share
the last bucket). Bidirectional attention (encoders) gives half the buckets to each sign;
unidirectional attention (decoders) only looks back. Each bucket has one learned scalar per head,
shared across all layers (built once per forward).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import BiasAt, Capabilities, PositionalEncoding, option_error


def t5_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Bucket index of each ``relative_position = key_pos - query_pos`` (the reference bucketing)."""
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    log_ratio = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n.long(), large)


@register("t5")
class T5Bias(PositionalEncoding):
    capabilities = Capabilities(hooks=frozenset({"bias"}), bias_offset_only=True, elementwise_bias=True)
    paper = "Raffel et al. 2020"
    extrapolates = "to ~2x"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        num_buckets: int = 32,
        max_distance: int = 128,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if num_buckets < 4 or num_buckets % 2:
            raise option_error("t5", "num_buckets", num_buckets, "must be an even number >= 4")
        if max_distance <= num_buckets // 2:
            half = num_buckets // 2
            raise option_error("t5", "max_distance", max_distance, f"must exceed num_buckets/2 = {half}")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.table = nn.Embedding(num_buckets, n_heads)
        nn.init.normal_(self.table.weight, std=0.02)

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """The learned scalar of head ``h`` for the bucket of ``j - i`` (positions rounded)."""
        weight, bidirectional = self.table.weight, not self.causal  # (num_buckets, H)

        def t5(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
            rel = k_pos - q_pos  # key - query
            if rel.is_floating_point():
                rel = rel.round().long()
            return weight[t5_bucket(rel, bidirectional, self.num_buckets, self.max_distance), h].float()

        return t5
