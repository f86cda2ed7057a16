"""Query blocks: how the blocked backends split a long attention call.

A materialised (B|1, H|1, Tq, Tk) mask can be large (16k tokens with a bias PE: gigabytes), and
causal attention wastes half of it on hidden keys. The blocked backends (explicit, offset vector,
masked) therefore run over query blocks of at most ``rows`` queries:

* ``rows`` keeps one block's mask within ``ctx.chunk_bytes``;
* causal attention also caps ``rows`` at ``ctx.causal_block_rows`` (at most ~8 blocks), and each
  block only sees keys up to its last query, so the masked upper triangle is skipped block-wise;
* when all blocks' masks together fit the budget (or there is one block), they are kept in the
  context for the other layers (``memo``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posformer.model.context import AttentionContext


@dataclass(frozen=True)
class QueryBlock:
    """Query rows [start, end) and the keys [first, keys) they can see."""

    start: int
    end: int
    keys: int
    first: int = 0


#: one block's attention: (q (B, H, rows, Dh), k, v (B, H, keys, Dh), block, memo) -> (B, H, rows, Dh)
BlockFn = Callable[[Tensor, Tensor, Tensor, QueryBlock, bool], Tensor]


def mask_row_bytes(ctx: AttentionContext, q: Tensor, tk: int, *, per_head: bool) -> int:
    """Bytes of one query row of a float32 mask (B|1, H|1, 1, Tk) for ``q`` (B, H, Tq, Dh).

    The mask has the batch dimension when keys are padded, documents are packed or the bias reads q, k
    or the input, and the head dimension when ``per_head`` (a bias or a value hook).
    """
    batch, heads = q.shape[0], q.shape[1]
    per_row_batch = ctx.visibility_per_row or (ctx.has_bias and ctx.bias_form.per_call)
    return (batch if per_row_batch else 1) * (heads if per_head else 1) * tk * 4


def plan_query_blocks(
    ctx: AttentionContext, tq: int, tk: int, bytes_per_row: int
) -> tuple[list[QueryBlock], bool]:
    """Query blocks for ``tq`` queries over ``tk`` keys, and whether their masks may be kept (``memo``)."""
    sliding = ctx.span.kind == "sliding"
    reach = (ctx.span.window - 1 if ctx.causal else ctx.span.window // 2) if sliding else 0
    if sliding:  # a row's mask spans its window only
        bytes_per_row = bytes_per_row * min(tk, 2 * reach + 1) // max(tk, 1)
    rows = max(16, ctx.chunk_bytes // max(bytes_per_row, 1))
    if ctx.causal and ctx.causal_block_rows and tq > 1:  # skip the hidden upper triangle block-wise
        rows = min(rows, max(ctx.causal_block_rows, -(-tq // 8)))  # at most ~8 blocks
    if sliding and ctx.causal_block_rows and tq > 1:  # window-high blocks: O(T·W) scores and masks
        rows = min(rows, max(ctx.causal_block_rows, reach + 1))
    n_blocks = -(-tq // rows)
    # keep every block's mask for the other layers when all of them fit the budget
    memo = n_blocks == 1 or bytes_per_row * tq <= ctx.chunk_bytes
    offset = tk - tq
    blocks = []
    for c in range(n_blocks):
        s, e = c * rows, min(tq, (c + 1) * rows)
        keys = min(tk, e + offset) if ctx.causal else tk  # keys past the block's last query are never visible
        first = 0
        if sliding:  # keys before the first query's window (or past the last one's) are never visible
            first = max(0, s + offset - reach)
            keys = min(keys, e - 1 + offset + reach + 1)
        blocks.append(QueryBlock(s, e, keys, first))
    return blocks, memo


def run_in_blocks(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, bytes_per_row: int, block_fn: BlockFn
) -> Tensor:
    """``block_fn`` over the query blocks of ``q`` (B, H, Tq, Dh), concatenated: (B, H, Tq, Dh)."""
    blocks, memo = plan_query_blocks(ctx, q.shape[2], k.shape[2], bytes_per_row)
    outs = [
        block_fn(q[:, :, b.start : b.end], k[:, :, b.first : b.keys], v[:, :, b.first : b.keys], b, memo)
        for b in blocks
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
