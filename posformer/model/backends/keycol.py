"""Backend: a bias of the key alone as head-dim columns of SDPA (a bias form with ``key_columns``).

A bias ``b(i, j) = r(i) + g(j)`` needs no (Tq, Tk) float tensor: the softmax cancels ``r(i)``, a
constant of the row, and ``g(j)`` is a score term of the key alone, which one more dimension of the
dot product carries: ``q'_i = [q_i, √Dh]``, ``k'_j = [k_j, g(j)]``, ``v'_j = [v_j, 0]``, scale
``1/√Dh``, so ``q'_i·k'_j/√Dh = q_i·k_j/√Dh + g(j)``. Forward and backward are then SDPA's (the CPU
flash kernel; on CUDA the kernel nope runs), and ``g``'s gradient comes back through ``k'``'s extra
column. Two bias forms state it (:func:`source`; :mod:`posformer.pe.forms`):

* ``Features(key_columns=True)``: forgetting ALiBi's ``c_i - c_j`` (``g = -c``, the PE's ``key_bias``);
* ``Offsets(key_columns=True)``: in causal attention, where every key a query sees is at a position
  ``<=`` its own, ALiBi's ``-m_h·(i - j)`` (``g = m_h·j``, the PE's ``key_position_bias``), measured
  from the middle key so the column stays small (a constant of the row, cancelled too).

**bf16.** One bf16 column would keep 8 bits of ``g``: at key 2,000 and slope 1/2 that is a logit off
by up to 2. The column is therefore ``h = g·√Dh`` in float32 split into three bf16 parts, ``h1 =
bf16(h)``, ``h2 = bf16(h - h1)``, ``h3 = bf16(h - h1 - h2)`` (``|h - h1 - h2 - h3| <= 2⁻²⁷·|h|``), each
against a query column of ones: every product is exact and the kernels add them up in float32, so the
key term is as exact as in a float32 call; the columns are padded with zeros to a multiple of 8 (the
head sizes the fused kernels take). The gradient reaches ``g`` through ``h1``. float32 calls take the
same parts when ``torch.set_float32_matmul_precision`` lets matmuls round to TF32 or bf16 (a single
column of 131,072 at 64k tokens would keep 10 bits); at ``highest``, torch's default, one column.
float16 keeps the other backends (``h`` would leave its range at long lengths).

Which keys a query sees stays SDPA's business: nothing but causality of as many queries as keys is
``is_causal``; anything else — padding, packed documents, windows and chunks, a cached multi-token
step — is the boolean visibility mask of each query block (:meth:`AttentionContext.keep`, blocks as
in :mod:`~posformer.model.backends.blocks`), which the fused kernel takes as it is. Learned sinks are
not taken: a sink's logit ``s_h`` competes with the scores themselves, not their differences, so it
would see the missing ``r(i)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model.backends.blocks import QueryBlock, mask_row_bytes, run_in_blocks
from posformer.model.context import AttentionContext
from posformer.pe.forms import Features, Offsets

#: the dtypes whose calls the columns take exactly (float32: one column; bf16: three, see the module)
DTYPES = (torch.float32, torch.bfloat16)


def source(ctx: AttentionContext) -> str | None:
    """Where this call's key bias comes from: ``"features"`` (the layer input's: ``Features(key_columns=
    True)``), ``"positions"`` (``Offsets(key_columns=True)`` in causal attention) or None (no such bias)."""
    match ctx.bias_form:
        case Features(key_columns=True):
            return "features"
        case Offsets(key_columns=True) if ctx.causal:
            return "positions"
    return None


def key_bias(ctx: AttentionContext, layer: int) -> Tensor:
    """``g`` of the call's keys, (B|1, H, Tk) float32 (:func:`source`)."""
    if source(ctx) == "features":
        _, k_feats = ctx.features(layer)  # (B, H, Tk, 1)
        return ctx.pe.key_bias(k_feats[..., 0].float())
    g = ctx.pe.key_position_bias(ctx.k_pos, layer=layer)  # (B|1, H, Tk)
    mid = g.shape[-1] // 2
    return g - g[..., mid : mid + 1]  # from the middle key: |g| <= m_h·Tk/2


def _columns(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, Tensor, int]:
    """``q'`` (B, H, Tq, Dh'), ``k'`` (B, H, Tk, Dh') and the number of columns added (see the module)."""
    dh = q.shape[-1]
    g = g.expand(k.shape[0], -1, -1)  # (B, H, Tk)
    if q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        q_cols = q.new_full((*q.shape[:-1], 1), math.sqrt(dh))  # (B, H, Tq, 1)
        k_cols = g.unsqueeze(-1)  # (B, H, Tk, 1)
    else:  # bf16, or float32 whose matmuls may round to TF32/bf16: parts that any of them keep exactly
        h = g * math.sqrt(dh)  # (B, H, Tk) float32
        h1 = h.detach().bfloat16().float()  # the parts, bf16-exact values in float32
        h2 = (h.detach() - h1).bfloat16().float()
        h3 = (h.detach() - h1 - h2).bfloat16().float()
        k_cols = torch.stack([h + (h1 - h).detach(), h2, h3], -1)  # (B, H, Tk, 3): h1 carries h's gradient
        pad = -(dh + 3) % 8  # zero columns up to a multiple of 8
        k_cols = F.pad(k_cols, (0, pad))
        q_cols = F.pad(q.new_ones((*q.shape[:-1], 3)), (0, pad))  # (B, H, Tq, 3 + pad)
    q_ext = torch.cat([q, q_cols], -1)  # (B, H, Tq, Dh')
    k_ext = torch.cat([k, k_cols.to(k.dtype)], -1)  # (B, H, Tk, Dh')
    return q_ext, k_ext, q_cols.shape[-1]


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""
    dh, tq, tk = q.shape[-1], q.shape[2], k.shape[2]
    q_ext, k_ext, added = _columns(q, k, key_bias(ctx, layer))
    v_ext = F.pad(v, (0, added))  # (B, H, Tk, Dh'): the kernels want one head size
    scale = 1 / math.sqrt(dh)
    only_causal = ctx.key_padding_mask is None and ctx.segment_ids is None and ctx.span.full
    if only_causal and (not ctx.causal or tq == 1 or tq == tk):
        causal = ctx.causal and tq > 1
        out = F.scaled_dot_product_attention(
            q_ext, k_ext, v_ext, dropout_p=dropout_p, is_causal=causal, scale=scale
        )
        return out[..., :dh]  # (B, H, Tq, Dh)

    def block(qc: Tensor, kc: Tensor, vc: Tensor, b: QueryBlock, memo: bool) -> Tensor:
        keep = ctx.keep(b.start, b.end, b.keys, qc.device, k0=b.first)  # (B|1, 1, rows, keys) bool | None
        return F.scaled_dot_product_attention(qc, kc, vc, attn_mask=keep, dropout_p=dropout_p, scale=scale)

    row_bytes = mask_row_bytes(ctx, q, tk, per_head=False)  # (B|1, 1, rows, keys) bool: a quarter of this
    return run_in_blocks(q_ext, k_ext, v_ext, ctx, row_bytes, block)[..., :dh]  # (B, H, Tq, Dh)
