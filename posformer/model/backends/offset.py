"""Backend: a bias that depends on the offset ``i - j`` only, from one vector (no (Tq, Tk) tensors).

For a bias form ``Offsets`` (ALiBi, T5, KERPLE, Sandwich, DPB) and contiguous integer positions, the PE
is asked once per forward (and bias layer) for the bias of one query against ``Tq + Tk - 1`` keys,
i.e. over every distinct offset; the causal mask is folded into it as ``-inf``
(:meth:`AttentionContext.offset_vector`). Each query block's mask is then a Toeplitz expansion of
a slice of it (``unfold``). That expansion is a Hankel *view* (no copy) for the block's queries in
*reverse* order, so the block's queries are flipped before SDPA and its output flipped back
(cheap: (B, H, rows, Dh)). Without padding nothing of size (Tq, Tk) is materialised; with padding
each block's mask is one (B, H, rows, keys) copy. Masks that fit the budget are shared by all layers.
"""

from __future__ import annotations

from torch import Tensor

from posformer.model.backends.blocks import QueryBlock, mask_row_bytes, run_in_blocks
from posformer.model.backends.masked import masked_sdpa
from posformer.model.context import AttentionContext


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""

    def block(qc: Tensor, kc: Tensor, vc: Tensor, b: QueryBlock, memo: bool) -> Tensor:
        mask = ctx.offset_mask(b.start, b.end, b.keys, qc.dtype, layer, memo, k0=b.first)  # rows reversed
        return masked_sdpa(qc.flip(2), kc, vc, mask, dropout_p).flip(2)  # (B, H, rows, Dh)

    # the mask is a view of the offset vector (nothing materialised) unless keys are padded
    row_bytes = 0 if ctx.key_padding_mask is None else mask_row_bytes(ctx, q, k.shape[2], per_head=True)
    return run_in_blocks(q, k, v, ctx, row_bytes, block)
