"""Backend: the PE's own exact attention (``caps.attention_shortcut``, e.g. Shaw's fused regions).

:meth:`PositionalEncoding.attention` computes a whole layer's attention from fused kernels. It is
tried only where it is exact and cheap to check: no gradients, no dropout, no padding, no packed
documents, as many queries as keys, and positions ``0 … T-1``. The PE may still decline (return
``None``), and then the next backend runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.model.context import AttentionContext


def applies(q: Tensor, k: Tensor, ctx: AttentionContext, dropout_p: float) -> bool:
    return (
        ctx.pe is not None
        and ctx.pe.caps.attention_shortcut
        and not dropout_p
        and ctx.key_padding_mask is None
        and ctx.segment_ids is None
        and q.shape[2] == k.shape[2]
        and not torch.is_grad_enabled()
        and ctx.contiguous
    )


def run(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float
) -> Tensor | None:
    """(B, H, T, Dh) each -> (B, H, T, Dh), or ``None`` when the PE declines."""
    return ctx.pe.attention(q, k, v, causal=ctx.causal, layer=layer)
