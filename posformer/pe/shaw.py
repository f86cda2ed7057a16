"""Relative position representations (Shaw et al. 2018, "Self-Attention with Relative Position
Representations").

The clipped offset ``r = clip(j - i, -k, k)`` selects learned vectors ``a^K_r, a^V_r ∈ R^{Dh}``
(shared across heads, one set per layer as in the paper):

    e_ij = q_i · (k_j + a^K_r) / √Dh          z_i = Σ_j α_ij (v_j + a^V_r)

The key term is a query-dependent score bias (``bias`` hook); the value term needs the attention
probabilities (``value`` hook), so with ``value_relations=True`` attention runs the explicit
softmax path instead of fused SDPA. ``value_relations=False`` keeps only the key term (and SDPA).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error, relative_distance


@register("shaw")
class ShawRelative(PositionalEncoding):
    hooks = frozenset({"bias", "value"})
    bias_reads_queries = True
    paper = "Shaw et al. 2018"
    extrapolates = "yes (clipped)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        max_relative_position: int = 16,
        value_relations: bool = True,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if max_relative_position < 1:
            raise option_error("shaw", "max_relative_position", max_relative_position, "must be >= 1")
        self.k = int(max_relative_position)
        n_rel = 2 * self.k + 1
        self.rel_k = nn.Parameter(torch.randn(n_layers, n_rel, self.head_dim) * 0.02)
        self.value_relations = bool(value_relations)
        if self.value_relations:
            self.rel_v = nn.Parameter(torch.randn(n_layers, n_rel, self.head_dim) * 0.02)
        else:
            self.hooks = frozenset({"bias"})  # instance override: no value term, SDPA path

    def _index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        rel = -relative_distance(q_pos, k_pos)  # (B|1, Tq, Tk): j - i
        if rel.is_floating_point():
            rel = rel.round()
        return rel.long().clamp(-self.k, self.k) + self.k

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        if q is None:
            raise ValueError("shaw's bias reads the queries: pass q")
        qa = q.float() @ self.rel_k[layer].float().T  # (B, H, Tq, 2k+1): q_i · a^K_r for every r
        idx = self._index(q_pos, k_pos).unsqueeze(1)  # (B|1, 1, Tq, Tk)
        idx = idx.expand(qa.shape[0], qa.shape[1], -1, -1)
        return qa.gather(-1, idx) / self.head_dim**0.5  # (B, H, Tq, Tk)

    def value(self, probs: Tensor, q_pos: Tensor, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        idx = self._index(q_pos, k_pos).unsqueeze(1).expand_as(probs)  # (B, H, Tq, Tk)
        per_rel = probs.new_zeros(*probs.shape[:-1], 2 * self.k + 1)  # (B, H, Tq, 2k+1)
        per_rel.scatter_add_(-1, idx, probs)  # total probability on each clipped offset
        return per_rel @ self.rel_v[layer].to(probs.dtype)  # (B, H, Tq, Dh)
