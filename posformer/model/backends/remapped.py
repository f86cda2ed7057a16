"""Backend: attention under a position map (:mod:`posformer.model.remap`, ``eval.position_map``).

Each region ``r`` of the map gives the queries positions ``q_r`` and the keys positions ``k_r``; the
scores of a region are the PE's at those positions: queries and keys rotated at ``q_r``, ``k_r`` (the
``rotary`` hook: the context left them unrotated, and a decoding cache keeps them so) plus the bias of
``(q_r, k_r)`` (the ``bias`` hook, any form of positions). Every pair keeps its region's score, then an
explicit float32 softmax (causal, padding, span masks and sinks as the other backends) in query blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.model.backends.blocks import QueryBlock, mask_row_bytes, run_in_blocks
from posformer.model.backends.explicit import attention_of_scores
from posformer.model.context import AttentionContext


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh), all unrotated -> (B, H, Tq, Dh)."""
    pe, pm = ctx.pe, ctx.position_map
    regions = pm.regions(ctx.q_pos, ctx.k_pos)  # [(q_r (B|1, Tq), k_r (B|1, Tk))]
    which = pm.region(ctx.q_pos, ctx.k_pos)  # (B|1, Tq, Tk)
    rotary = "rotary" in ctx.hooks
    rotated = [
        (pe.rotate(q, qr, is_query=True), pe.rotate(k, kr, is_query=False)) if rotary else (q, k)
        for qr, kr in regions
    ]
    sinks = ctx.sink_logits(layer)  # (H,) | None
    scale = q.shape[-1] ** -0.5

    def block(qc: Tensor, kc: Tensor, vc: Tensor, b: QueryBlock, memo: bool) -> Tensor:
        rows, cols = slice(b.start, b.end), slice(b.first, b.keys)
        pick = which[:, rows, cols].unsqueeze(1)  # (B|1, 1, rows, keys)
        scores = None
        for r, ((qr, kr), (qq, kk)) in enumerate(zip(regions, rotated, strict=True)):
            if scores is not None and not rotary and not ctx.has_bias:
                break  # no PE term: every region scores alike
            s = (qq[:, :, rows] @ kk[:, :, cols].transpose(-1, -2)).float() * scale  # (B, H, rows, keys)
            if ctx.has_bias:
                s = s + pe.bias(qr[:, rows], kr[:, cols], layer=layer)
            scores = s if scores is None else torch.where(pick == r, s, scores)
        keep = ctx.keep(b.start, b.end, b.keys, q.device, k0=b.first)  # (B|1, 1, rows, keys) | None
        return attention_of_scores(scores, vc, keep, dropout_p, sinks, softcap=ctx.softcap)[0]

    return run_in_blocks(q, k, v, ctx, mask_row_bytes(ctx, q, k.shape[2], per_head=True), block)
