"""Backend: fused SDPA without any mask (no bias, no value hook, no padding, no packed documents).

Bidirectional attention and single-query decoding steps need no mask at all; causal attention of
``T`` queries over the same ``T`` keys uses SDPA's ``is_causal``. (Causal attention of fewer queries
than keys without a bias, i.e. a cached multi-token step, needs a boolean mask: ``masked``.) Packed
documents (``ctx.segment_ids``) need the block-diagonal boolean mask, so ``masked`` takes them: SDPA
with a boolean mask still runs a fused kernel, one query block at a time.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from posformer.model.context import AttentionContext


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""
    if not ctx.causal or q.shape[2] == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
