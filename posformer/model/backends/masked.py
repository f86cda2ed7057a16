"""Backend: SDPA with a materialised mask per query block (the general path).

Every call the other backends do not take lands here: bias PEs whose bias is not an offset vector
(FIRE, Shaw's key relations without value relations, sparse or per-row positions), padding, and
cached multi-token steps. Each query block (:mod:`~posformer.model.backends.blocks`) gets one mask
from :meth:`AttentionContext.mask`: the bias with causal and padding masks folded in as ``-inf``
(float, in the activations' dtype), or the boolean visibility mask when there is no bias.

A float mask that needs a gradient (learned T5/KERPLE/FIRE parameters, Shaw's query term) goes
through :class:`BiasedAttention`: the fused SDPA forward and an explicit backward that also
returns the mask's gradient (SDPA itself would fall back to its slow math path for such masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model.backends.blocks import QueryBlock, mask_row_bytes, run_in_blocks
from posformer.model.backends.sinks import sink_rows, with_sink_column
from posformer.model.context import AttentionContext


class BiasedAttention(torch.autograd.Function):
    """SDPA with a float mask that needs a gradient.

    Forward: the fused SDPA kernel with the mask detached. Backward: explicit, recomputing the
    probabilities ``P`` (B, H, Tq, Tk) once: ``dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O))``, ``dQ = dS·K/√d``,
    ``dK = dSᵀ·Q/√d``, ``dV = Pᵀ·dO`` and ``dMask = dS`` summed over broadcast dimensions. SDPA itself
    would take its unfused math path (several times slower) for such a mask.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:  # noqa: D102
        # detached: SDPA picks its kernel by ``requires_grad``, not by grad mode, and a mask that requires
        # grad sends it to the unfused math path (3.5x slower: docs/performance.md)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach())
        ctx.save_for_backward(q, k, v, mask, out)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:  # noqa: D102
        q, k, v, mask, out = ctx.saved_tensors
        dtype = q.dtype
        if dtype != torch.float32:  # half precision: softmax and its gradient in fp32
            q, k, v, out, d_out = (t.float() for t in (q, k, v, out, d_out))
        scale = q.shape[-1] ** -0.5
        p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask.float()).softmax(-1)  # (B, H, Tq, Tk)
        p = torch.nan_to_num_(p, nan=0.0)  # rows with every key hidden: no attention, no gradient
        ds = torch.matmul(d_out, v.transpose(-1, -2)).sub_((d_out * out).sum(-1, keepdim=True)).mul_(p)
        nq, nk, nv, nm = ctx.needs_input_grad
        dq = torch.matmul(ds, k).mul_(scale).to(dtype) if nq else None
        dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale).to(dtype) if nk else None
        dv = torch.matmul(p.transpose(-1, -2), d_out).to(dtype) if nv else None
        dm = ds.sum_to_size(mask.shape).to(mask.dtype) if nm else None
        return dq, dk, dv, dm


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """SDPA of ``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) with ``mask`` (B|1, H|1, Tq, Tk).

    A float mask that needs a gradient (and no dropout) goes through :class:`BiasedAttention`.
    """
    if (
        mask is not None
        and mask.dtype != torch.bool
        and mask.requires_grad
        and torch.is_grad_enabled()
        and not dropout_p
    ):
        return BiasedAttention.apply(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""

    sinks = ctx.sink_logits(layer)  # (H,) | (B, H, Tq) | None

    def block(qc: Tensor, kc: Tensor, vc: Tensor, b: QueryBlock, memo: bool) -> Tensor:
        mask = ctx.mask(b.start, b.end, b.keys, qc, layer, memo, kc, k0=b.first)  # (B|1, H|1, rows, keys)
        if sinks is not None:  # one more key: zero key and value, logit s_h (backends/sinks.py)
            kc, vc, mask = with_sink_column(qc, kc, vc, mask, sink_rows(sinks, b.start, b.end))
        return masked_sdpa(qc, kc, vc, mask, dropout_p)

    per_head = ctx.has_bias or sinks is not None
    return run_in_blocks(q, k, v, ctx, mask_row_bytes(ctx, q, k.shape[2], per_head=per_head), block)
