"""Learned attention sinks (gpt-oss): a per-head logit ``s_h`` in every softmax denominator,

    out_i = sum_j exp(l_ij) v_j / (exp(s_h) + sum_j exp(l_ij)),

i.e. a virtual key whose score is ``s_h`` and whose value is zero. Two equivalent forms, one per kind of
kernel (tested against each other and an explicit reference in ``tests/model/test_sinks.py``):

* a *virtual key column* (:func:`with_sink_column`): SDPA over the keys plus one zero key/value whose
  mask entry is ``s_h`` (the masked backend; the mask then needs a gradient, which
  :class:`~posformer.model.backends.masked.BiasedAttention` returns) — and the explicit softmax
  appends the same column to its scores (:func:`sink_scores`);
* an *LSE correction* (:func:`rescale_by_sinks`): a kernel that returns the log-sum-exp ``L_i`` of its
  scores (FlexAttention) gives ``out_i · sigmoid(L_i - s_h)``; differentiable through ``L``.

Sink logits are per head (H,) or per head and query (B, H, Tq) (data-dependent sinks from the layer
input, Inkling); a backend that runs in query blocks passes each block its rows (:func:`sink_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sink_rows(sinks: Tensor | None, start: int, end: int) -> Tensor | None:
    """The sink logits of query rows [start, end): per head (H,) unchanged, per query (B, H, Tq) sliced."""
    return sinks[:, :, start:end] if sinks is not None and sinks.dim() == 3 else sinks


def _grid(sinks: Tensor, h: int) -> Tensor:
    """Sink logits (H,) or (B, H, Tq) as (B|1, H, Tq|1)."""
    return sinks.view(1, h, 1) if sinks.dim() == 1 else sinks


def with_sink_column(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Keys, values (B, H, Tk + 1, Dh) and a float mask (B|1, H, Tq, Tk + 1) with the sink column last.

    ``q`` (B, H, Tq, Dh); ``mask`` (B|1, H|1, Tq, Tk) float (added) or bool (True = visible) or None;
    ``sinks`` (H,) or (B, H, Tq). The zero key scores ``q · 0 = 0``, so its mask entry ``s`` is its whole
    logit.
    """
    b, h, tq, _ = q.shape
    zero_k = k.new_zeros(b, h, 1, k.shape[-1])  # (B, H, 1, Dk): keys may be wider than values (PoPE)
    k2, v2 = torch.cat((k, zero_k), 2), torch.cat((v, v.new_zeros(b, h, 1, v.shape[-1])), 2)
    if mask is None:
        mask = q.new_zeros(1, 1, tq, k.shape[2])
    elif mask.dtype == torch.bool:
        mask = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
    grid = _grid(sinks, h)
    rows = max(mask.shape[0], grid.shape[0])
    column = grid.to(q.dtype).unsqueeze(-1).expand(rows, h, tq, 1)  # (B|1, H, Tq, 1)
    return k2, v2, torch.cat((mask.expand(rows, h, tq, -1), column), -1)


def sink_scores(scores: Tensor, sinks: Tensor) -> Tensor:
    """Scores (B, H, Tq, Tk) float32 with the sink logits (H,) or (B, H, Tq) appended as key Tk:
    (B, H, Tq, Tk + 1)."""
    b, h, tq, _ = scores.shape
    return torch.cat((scores, _grid(sinks, h).float().unsqueeze(-1).expand(b, h, tq, 1)), -1)


def rescale_by_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``out`` (B, H, Tq, Dh) normalised over the keys, ``lse`` (B, H, Tq) their natural log-sum-exp:
    the output with the sinks (H,) or (B, H, Tq) in the denominator, ``out · sigmoid(lse - s)``."""
    weight = torch.sigmoid(lse.float() - _grid(sinks, lse.shape[1]).float())  # (B, H, Tq)
    return out * weight.unsqueeze(-1).to(out.dtype)
