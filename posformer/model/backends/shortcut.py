"""Backend: the PE's own exact attention (``caps.attention_shortcut``, e.g. Shaw's fused regions).

:meth:`PositionalEncoding.attention` computes a whole layer's attention from fused kernels. The
decision (:func:`posformer.model.backends.choose`, rule 1) picks it only where it is exact and cheap
to check: the PE offers it on this device (:meth:`PositionalEncoding.offers_attention`), no
gradients, no dropout, no padding, no packed documents, as many queries as keys, and positions
``0 … T-1``.
"""

from __future__ import annotations

from torch import Tensor

from posformer.model.context import AttentionContext


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """(B, H, T, Dh) each -> (B, H, T, Dh)."""
    return ctx.pe.attention(q, k, v, causal=ctx.causal, layer=layer)
