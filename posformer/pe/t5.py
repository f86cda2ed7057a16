"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning").

The key-minus-query offset ``j - i`` is mapped to one of ``num_buckets`` buckets: half of them for
exact small offsets, the rest logarithmically spaced up to ``max_distance`` (offsets beyond share
the last bucket). Bidirectional attention (encoders) gives half the buckets to each sign;
unidirectional attention (decoders) only looks back. Each bucket has one learned scalar per head,
shared across all layers (built once per forward).

The bias added to the scores is ``scale * w_h[bucket]``. ``scale`` changes the learning dynamics, not
the family of biases a model can express: under Adam a parameter moves about ``lr`` per step, so an
unscaled table (``scale=1``) needs ~1/lr steps to reach the biases of several nats that separate near
from far keys, and past the training length the barely-trained last bucket stays near its init (the
flat 16x loss is lost: docs/results.md, "Parity with x-transformers"). The default ``scale="auto"``
is ``sqrt(head_dim)``: the bias is measured in units of the unscaled ``q . k``, as x-transformers'
``RelativePositionBias(scale=dim_head ** 0.5)``. ``init_std`` is the table's N(0, std) init, in table
units (the bias starts with std ``scale * init_std``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import BiasAt, PositionalEncoding, option_error
from posformer.pe.forms import Offsets


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
    #: bias_fn reads the (num_buckets, H) table, indexed once
    bias_form = Offsets(score_mod=True, trainable=True)
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
        scale: float | str = "auto",
        init_std: float = 0.02,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if num_buckets < 4 or num_buckets % 2:
            raise option_error("t5", "num_buckets", num_buckets, "must be an even number >= 4")
        if max_distance <= num_buckets // 2:
            half = num_buckets // 2
            raise option_error("t5", "max_distance", max_distance, f"must exceed num_buckets/2 = {half}")
        if scale == "auto":
            scale = self.head_dim**0.5
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise option_error("t5", "scale", scale, "must be a positive number or 'auto' (sqrt(head_dim))")
        if isinstance(init_std, bool) or not isinstance(init_std, int | float) or not init_std >= 0:
            raise option_error("t5", "init_std", init_std, "must be a number >= 0")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.scale = float(scale)
        self.table = nn.Embedding(num_buckets, n_heads)  # (num_buckets, H), in units of 1/scale
        nn.init.normal_(self.table.weight, std=float(init_std))

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """``scale`` x the learned scalar of head ``h`` for the bucket of ``j - i`` (positions rounded)."""
        weight, bidirectional = self.table.weight * self.scale, not self.causal  # (num_buckets, H)

        def t5(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
            rel = k_pos - q_pos  # key - query
            if rel.is_floating_point():
                rel = rel.round().long()
            return weight[t5_bucket(rel, bidirectional, self.num_buckets, self.max_distance), h].float()

        return t5
