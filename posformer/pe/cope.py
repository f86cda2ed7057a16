"""CoPE, contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding:
Learning to Count What's Important"; x-transformers' ``CoPE``).

Positions are counted by the content: query ``i`` gates every visible key, ``g_ij = σ(q_i·k_j/√Dh)``,
and the position of key ``j`` is the sum of the gates from ``j`` to ``i`` (a reverse cumulative sum):

    p_ij = min(Σ_{t=j}^{i} g_it, max_pos - 1)
    b(i, j) = (1 - w)·z_i[⌊p_ij⌋] + w·z_i[⌈p_ij⌉],   w = p_ij - ⌊p_ij⌋,   z_i[p] = q_i·e[p]

with learned position embeddings ``e ∈ R^{max_pos × Dh}`` per layer. The bias reads the queries and
the keys (``bias_reads_queries``, ``bias_reads_keys``); keys later than the query (``k_pos > q_pos``)
get gate 0. With packed documents the attention context passes ``visible`` (its causal and
block-diagonal mask), so keys of other documents get gate 0 too and the counts never cross a
document boundary. Cached decoding needs nothing beyond the cached keys. Causal attention only; the
positions tensor is read only for that visibility (``content_positions``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error, relative_distance


@register("cope")
class ContextualPosition(PositionalEncoding):
    bias_reads = frozenset({"q", "k"})
    bias_per_layer = True
    causal_only = True
    content_positions = True
    paper = "Golovneva et al. 2024"
    extrapolates = "yes (positions capped at max_pos)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        max_pos: int = 16,
        init_std: float = 0.02,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if max_pos < 2:
            raise option_error("cope", "max_pos", max_pos, "must be >= 2 (positions 0 … max_pos-1)")
        self.max_pos = int(max_pos)
        self.pos_emb = nn.Parameter(torch.randn(n_layers, self.max_pos, self.head_dim) * init_std)

    def positions(self, q: Tensor, k: Tensor, visible: Tensor) -> Tensor:
        """Contextual positions ``p`` (B, H, Tq, Tk), float32, of ``q`` (B, H, Tq, Dh) over ``k``
        (B, H, Tk, Dh); ``visible`` (B|1, 1, Tq, Tk) bool."""
        gates = torch.sigmoid((q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5)
        gates = gates * visible
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_pos - 1)

    def bias(
        self,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        q: Tensor | None = None,
        k: Tensor | None = None,
        visible: Tensor | None = None,
        layer: int = 0,
    ) -> Tensor:
        """Bias (B, H, Tq, Tk); ``visible`` (B|1, 1, Tq, Tk) bool: the keys each query sees (default:
        ``k_pos <= q_pos``; packed documents pass the attention's block-diagonal causal mask)."""
        if q is None or k is None:
            raise ValueError("cope's bias reads the queries and keys: pass q and k")
        if visible is None:
            visible = (relative_distance(q_pos, k_pos) >= 0).unsqueeze(1)  # (B|1, 1, Tq, Tk)
        pos = self.positions(q, k, visible)  # (B, H, Tq, Tk)
        z = q.float() @ self.pos_emb[layer].float().T  # (B, H, Tq, max_pos): q_i·e[p] for every p
        lo = pos.floor()
        w = pos - lo
        z_lo = z.gather(-1, lo.long())
        z_hi = z.gather(-1, pos.ceil().long())
        return z_lo * (1 - w) + z_hi * w  # (B, H, Tq, Tk)
