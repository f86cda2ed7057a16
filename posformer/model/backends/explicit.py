"""Backend: explicit softmax, for PEs with a ``value`` hook (Shaw's value relations) and soft-capped
scores (``softcap``: :mod:`posformer.model.knobs`).

The ``value`` hook needs the attention probabilities, which fused kernels do not return, so the
scores are written out: ``P = softmax(q·kᵀ/√Dh + bias)`` in float32 (hidden keys ``-inf``), then
``P·v + value(P)``. Runs in query blocks (:mod:`~posformer.model.backends.blocks`); masks are not
kept across layers (Shaw's bias reads the queries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model.backends.blocks import QueryBlock, mask_row_bytes, run_in_blocks
from posformer.model.backends.sinks import sink_rows, sink_scores
from posformer.model.context import AttentionContext


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""

    sinks = ctx.sink_logits(layer)  # (H,) | (B, H, Tq) | None

    def block(qc: Tensor, kc: Tensor, vc: Tensor, b: QueryBlock, memo: bool) -> Tensor:
        # (B|1, H, rows, keys) | None
        bias = ctx.bias(b.start, b.end, b.keys, qc, layer, kc, k0=b.first) if ctx.has_bias else None
        keep = ctx.keep(b.start, b.end, b.keys, q.device, k0=b.first)  # (B|1, 1, rows, keys) | None
        rows = sink_rows(sinks, b.start, b.end)
        out, probs = explicit_attention(qc, kc, vc, bias, keep, dropout_p, rows, softcap=ctx.softcap)
        if ctx.probe is not None:  # posformer-inspect's attention probe
            ctx.probe.setdefault(layer, []).append((b.start, b.first, probs.detach()))
        return out if not ctx.has_value else out + ctx.value(probs, b.start, b.end, b.keys, layer, k0=b.first)

    return run_in_blocks(q, k, v, ctx, mask_row_bytes(ctx, q, k.shape[2], per_head=True), block)


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    keep: Tensor | None,
    dropout_p: float,
    sinks: Tensor | None = None,
    *,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(q·kᵀ/√Dh + bias)·v with fp32 softmax: (output (B, H, Tq, Dh), probabilities (B, H, Tq, Tk)).

    ``q`` (B, H, Tq, Dh), ``k``, ``v`` (B, H, Tk, Dh); ``bias`` float32 (B|1, H, Tq, Tk) or None;
    ``keep`` bool (B|1, 1, Tq, Tk), False = hidden, or None; ``sinks`` (H,) or (B, H, Tq) sink logits in
    the denominator, or None; ``softcap`` > 0: scores ``c · tanh(s / c)`` after the bias, before the
    masks. The probabilities (after dropout, in ``q``'s dtype; without the sink's share) are what the
    ``value`` hook reads.
    """
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # (B, H, Tq, Tk)
    if bias is not None:
        scores = scores + bias
    return attention_of_scores(scores, v, keep, dropout_p, sinks, softcap=softcap)


def attention_of_scores(
    scores: Tensor,
    v: Tensor,
    keep: Tensor | None,
    dropout_p: float,
    sinks: Tensor | None = None,
    *,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The softmax of float32 ``scores`` (B, H, Tq, Tk) (bias included) times ``v`` (B, H, Tk, Dh):
    (output (B, H, Tq, Dh), probabilities in ``v``'s dtype), as :func:`explicit_attention`."""
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # one more logit per row, dropped after the softmax
        probs = sink_scores(scores, sinks).softmax(-1)[..., :-1].to(v.dtype)
    else:
        probs = scores.softmax(-1).to(v.dtype)
    if keep is not None:  # a row with every key hidden (a padded query): no attention instead of NaN
        probs = probs.masked_fill(~keep, 0.0)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs @ v, probs
