"""Backend: a bias of the key alone as one more head-dim column of SDPA (``caps.key_bias``).

A bias ``b(i, j) = r(i) + g(j)`` needs no (Tq, Tk) float tensor: the softmax cancels ``r(i)``, a
constant of the row, and ``g(j)`` is a score term of the key alone, which one more dimension of the
dot product carries: ``q'_i = [q_i, √Dh]``, ``k'_j = [k_j, g(j)]``, ``v'_j = [v_j, 0]``, scale
``1/√Dh``, so ``q'_i·k'_j/√Dh = q_i·k_j/√Dh + g(j)``. Forward and backward are then SDPA's (the CPU
flash kernel), and ``g``'s gradient comes back through ``k'``'s extra column. Forgetting ALiBi's
``c_i - c_j`` is the case (``g = -c``).

Which keys a query sees stays SDPA's business: nothing but causality of as many queries as keys is
``is_causal``; anything else — padding, packed documents, windows and chunks, a cached multi-token
step — is the boolean visibility mask of each query block (:meth:`AttentionContext.keep`, blocks as
in :mod:`~posformer.model.backends.blocks`), which the fused kernel takes as it is. Learned sinks are
not taken: a sink's logit ``s_h`` competes with the scores themselves, not their differences, so it
would see the missing ``r(i)``.

The column is in the keys' dtype, so :func:`~posformer.model.backends.choose` picks this only for
float32 queries and keys (in bf16 the running sums would keep 8 bits; Flex and the materialised bias
keep them in float32).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model.backends.blocks import QueryBlock, mask_row_bytes, run_in_blocks
from posformer.model.context import AttentionContext


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""
    dh, tq, tk = q.shape[-1], q.shape[2], k.shape[2]
    _, k_feats = ctx.features(layer)  # (B, H, Tk, 1)
    g = ctx.pe.key_bias(k_feats[..., 0].float())  # (B, H, Tk) float32
    root = math.sqrt(dh)
    q_ext = torch.cat([q, q.new_full((*q.shape[:-1], 1), root)], -1)  # (B, H, Tq, Dh + 1)
    k_ext = torch.cat([k, g.unsqueeze(-1).to(k.dtype)], -1)  # (B, H, Tk, Dh + 1)
    v_ext = F.pad(v, (0, 1))  # (B, H, Tk, Dh + 1): the kernels want one head size
    only_causal = ctx.key_padding_mask is None and ctx.segment_ids is None and ctx.span.full
    if only_causal and (not ctx.causal or tq == 1 or tq == tk):
        causal = ctx.causal and tq > 1
        out = F.scaled_dot_product_attention(
            q_ext, k_ext, v_ext, dropout_p=dropout_p, is_causal=causal, scale=1 / root
        )
        return out[..., :dh]  # (B, H, Tq, Dh)

    def block(qc: Tensor, kc: Tensor, vc: Tensor, b: QueryBlock, memo: bool) -> Tensor:
        keep = ctx.keep(b.start, b.end, b.keys, qc.device, k0=b.first)  # (B|1, 1, rows, keys) bool | None
        return F.scaled_dot_product_attention(qc, kc, vc, attn_mask=keep, dropout_p=dropout_p, scale=1 / root)

    row_bytes = mask_row_bytes(ctx, q, tk, per_head=False)  # (B|1, 1, rows, keys) bool: a quarter of this
    return run_in_blocks(q_ext, k_ext, v_ext, ctx, row_bytes, block)[..., :dh]  # (B, H, Tq, Dh)
