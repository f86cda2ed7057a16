"""What a PE's positions alone do to the attention logits: the probe behind the heat maps.

:func:`position_logits` calls a PE's hooks with constant probes (its contract, never its name), for
``posformer-inspect`` and the training run's heat-map callback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.pe.base import PositionalEncoding
from posformer.pe.forms import reads


def position_logits(pe: PositionalEncoding, positions: Tensor) -> Tensor:
    """Position-only attention logits (H, T, T) of ``pe`` at ``positions`` (1, T), float32.

    Embedding PEs: ``PE·PEᵀ/√D``; rotary PEs: scores of a constant query/key; bias PEs: the bias (of
    constant queries, keys or layer input where its form reads them). The probes are made on
    ``positions``' device, in the dtype of the PE's parameters (fp32 for a PE without any), so the PE
    may live on any device and in any precision.
    """
    pos, length, hooks, form = positions, positions.shape[-1], pe.caps.hooks, pe.caps.bias
    with torch.no_grad():
        if reads(form) & {"k", "x"}:
            return pe.bias(pos, pos, **_probe_inputs(pe, pos)).squeeze(0).float()
        if form is not None and not reads(form):
            return pe.bias(pos, pos).squeeze(0).float()
        if "rotary" in hooks:
            ones = _probe(pe, pos, 1, pe.n_heads, length, pe.head_dim)
            q = pe.rotate(ones, pos, is_query=True)
            k = pe.rotate(ones, pos, is_query=False)
            return (q @ k.transpose(-1, -2)).squeeze(0).float() / q.shape[-1] ** 0.5  # as attention scales
        if "embed" in hooks:
            zeros = _probe(pe, pos, 1, length, pe.d_model, fill=0.0)
            table = pe.embed(zeros, pos).squeeze(0).float()  # (T, D)
            return (table @ table.T / pe.d_model**0.5).unsqueeze(0)
        if form is not None:  # a bias of the queries alone: one constant query
            q = _probe(pe, pos, 1, pe.n_heads, length, pe.head_dim)
            return pe.bias(pos, pos, q=q).squeeze(0).float()
    return torch.zeros(1, length, length, device=pos.device)


def _probe(pe: PositionalEncoding, positions: Tensor, *shape: int, fill: float = 1.0) -> Tensor:
    """A constant probe of ``shape`` on ``positions``' device, in the dtype of the PE's parameters."""
    dtype = next((p.dtype for p in pe.parameters() if p.is_floating_point()), torch.float32)
    return torch.full(shape, fill, dtype=dtype, device=positions.device)


def _probe_inputs(pe: PositionalEncoding, positions: Tensor) -> dict[str, Tensor]:
    """What the bias form reads (:func:`~posformer.pe.forms.reads`), as constants at ``positions`` (1, T):
    queries and keys as one (1, H, T, Dh) probe of ``1/√Dh``, the layer input's features of a ones
    input."""
    length = positions.shape[-1]
    wanted = reads(pe.caps.bias)
    ones = _probe(pe, positions, 1, pe.n_heads, length, pe.head_dim, fill=1.0 / pe.head_dim**0.5)
    out = {name: ones for name in ("q", "k") if name in wanted}
    if "x" in wanted:
        feats = pe.input_features(_probe(pe, positions, 1, length, pe.d_model))
        out["q_feats"] = out["k_feats"] = feats
    return out
