"""Multi-head attention that calls the positional-encoding hooks.

The attention layer knows nothing about individual PEs. It asks the PE (if any is applied to this
attention kind) for its hooks: ``rotary`` rotates q and the *new* k before they are cached,
``bias`` gives an additive score bias that is folded together with the causal and padding masks
into one float mask for :func:`torch.nn.functional.scaled_dot_product_attention`, ``value`` adds a
term from the attention probabilities (explicit softmax path).

Long sequences are processed in query chunks whenever the (B, H, Tq, Tk) mask would exceed
``chunk_bytes``, so a 16k-token evaluation with a bias PE never materialises the full matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.pe.base import PositionalEncoding

#: default budget for one materialised mask/bias block, in bytes
DEFAULT_CHUNK_BYTES = 256 * 2**20


@dataclass
class AttentionContext:
    """Everything an attention call needs besides q, k, v.

    Built once per forward and attention kind, and shared by all layers (so a bias that is the same
    in every layer is built once).

    Attributes:
        pe: the PE applied to this attention kind, or ``None``.
        q_pos: query positions (B|1, Tq).
        k_pos: key positions (B|1, Tk) (for cached decoding: all cached keys plus the new ones).
        causal: causal masking by index (query ``i`` of the new block sees keys ``<= Tk - Tq + i``).
        key_padding_mask: (B, Tk) bool, True for real tokens, or ``None``.
        chunk_bytes: memory budget of one materialised mask block.
    """

    pe: PositionalEncoding | None
    q_pos: Tensor
    k_pos: Tensor
    causal: bool = False
    key_padding_mask: Tensor | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def hooks(self) -> frozenset[str]:
        return self.pe.hooks if self.pe is not None else frozenset()

    def rotate(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        if "rotary" in self.hooks:
            return self.pe.rotate(x, positions, is_query=is_query)
        return x

    def _bias(self, s: int, e: int, q: Tensor, layer: int, n_chunks: int) -> Tensor | None:
        """Score bias for query rows [s, e): (B|1, H, e-s, Tk) float32, memoised across layers."""
        pe = self.pe
        if "bias" not in self.hooks:
            return None
        q_pos = self.q_pos[:, s:e]
        if pe.bias_reads_queries:
            return pe.bias(q_pos, self.k_pos, q=q, layer=layer)
        key = (layer if pe.bias_per_layer else 0, s, e)
        if n_chunks > 1:  # long inputs: do not hold every chunk's bias
            return pe.bias(q_pos, self.k_pos, layer=layer)
        if key not in self._memo:
            self._memo[key] = pe.bias(q_pos, self.k_pos, layer=layer)
        return self._memo[key]

    def _keep(self, s: int, e: int, tk: int, device: torch.device) -> Tensor | None:
        """Boolean (B|1, 1, e-s, Tk) mask of visible keys for query rows [s, e), or None if all visible."""
        keep = None
        if self.causal:
            offset = tk - self.q_pos.shape[1]
            qi = torch.arange(s, e, device=device).unsqueeze(-1) + offset
            keep = (torch.arange(tk, device=device) <= qi).view(1, 1, e - s, tk)
        if self.key_padding_mask is not None:
            pad = self.key_padding_mask.view(-1, 1, 1, tk)
            keep = pad if keep is None else keep & pad
        return keep


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, *, layer: int = 0, dropout_p: float = 0.0) -> Tensor:
    """Attention of ``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""
    B, H, Tq, Dh = q.shape
    Tk = k.shape[2]
    hooks = ctx.hooks
    has_bias, has_value = "bias" in hooks, "value" in hooks

    # Fast paths: no mask to materialise.
    if not has_bias and not has_value and ctx.key_padding_mask is None:
        if not ctx.causal or Tq == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        if Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    bytes_per_row = B * (H if (has_bias or has_value) else 1) * Tk * 4
    rows = max(16, ctx.chunk_bytes // max(bytes_per_row, 1))
    n_chunks = -(-Tq // rows)
    offset = Tk - Tq
    outs = []
    for c in range(n_chunks):
        s, e = c * rows, min(Tq, (c + 1) * rows)
        qc = q[:, :, s:e]
        # causal without padding: keys past the chunk's last query are never visible
        tk = min(Tk, e + offset) if (ctx.causal and ctx.key_padding_mask is None) else Tk
        kc, vc = k[:, :, :tk], v[:, :, :tk]
        keep = ctx._keep(s, e, tk, q.device)
        bias = ctx._bias(s, e, qc, layer, n_chunks)
        if bias is not None and tk < Tk:
            bias = bias[..., :tk]
        if has_value:
            outs.append(_explicit_attention(qc, kc, vc, bias, keep, ctx, s, e, tk, layer, dropout_p))
            continue
        if bias is None:
            mask = keep
        else:
            mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
            mask = mask.to(q.dtype)
        outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, dropout_p=dropout_p))
    return outs[0] if n_chunks == 1 else torch.cat(outs, dim=2)


def _explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, keep: Tensor | None, ctx: AttentionContext,
    s: int, e: int, tk: int, layer: int, dropout_p: float,
) -> Tensor:
    """softmax(q·kᵀ/√Dh + bias) with the probabilities kept for the ``value`` hook (fp32 softmax)."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # (B, H, c, tk)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    out = probs @ v
    return out + ctx.pe.value(probs, ctx.q_pos[:, s:e], ctx.k_pos[:, :tk], layer=layer)


@dataclass
class LayerCache:
    """Key/value cache of one attention layer: (B, H, T, Dh) tensors."""

    k: Tensor | None = None
    v: Tensor | None = None


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self) or Q + fused KV (cross).

    Args:
        d_model: model width D.
        n_heads: heads H (head width Dh = D / H).
        dropout: dropout on the attention probabilities.
        cross: cross-attention (queries from x, keys/values from ``memory``).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, cross: bool = False, bias: bool = True):
        super().__init__()
        self.n_heads, self.head_dim, self.cross = n_heads, d_model // n_heads, cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # (B, T, D) -> (B, H, T, Dh)

    def forward(
        self,
        x: Tensor,
        ctx: AttentionContext,
        *,
        layer: int = 0,
        memory: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """``x`` (B, T, D) [, ``memory`` (B, S, D)] -> (B, T, D).

        With a ``cache``: self-attention appends the new (rotated) keys/values to it; cross-attention
        projects ``memory`` once and reuses it afterwards.
        """
        if self.cross:
            q = self._heads(self.q_proj(x))  # (B, H, T, Dh)
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v
            else:
                k, v = (self._heads(t) for t in self.kv_proj(memory).chunk(2, dim=-1))  # (B, H, S, Dh) each
                k = ctx.rotate(k, ctx.k_pos, is_query=False)
                if cache is not None:
                    cache.k, cache.v = k, v
        else:
            q, k, v = (self._heads(t) for t in self.qkv_proj(x).chunk(3, dim=-1))  # (B, H, T, Dh) each
            new_pos = ctx.k_pos[:, -x.shape[1] :]
            k = ctx.rotate(k, new_pos, is_query=False)
            if cache is not None:
                if cache.k is not None:
                    k = torch.cat((cache.k, k), dim=2)  # (B, H, T_past + T, Dh)
                    v = torch.cat((cache.v, v), dim=2)
                cache.k, cache.v = k, v
        q = ctx.rotate(q, ctx.q_pos, is_query=True)
        out = attend(q, k, v, ctx, layer=layer, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, H, T, Dh) -> (B, T, D)
