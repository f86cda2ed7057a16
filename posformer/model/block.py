"""One Transformer layer: self-attention [+ cross-attention] + feed-forward, each a residual sub-layer."""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn

from posformer.model.attention import MultiHeadAttention
from posformer.model.cache import LayerCache
from posformer.model.config import ModelConfig
from posformer.model.context import AttentionContext
from posformer.model.schedule import DEFAULT_KIND, LayerKind

__all__ = ["Block", "FeedForward", "SwiGLU", "make_norm"]


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str, bias: bool = True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff, bias=bias), nn.Linear(d_ff, d_model, bias=bias)
        self.act = F.gelu if activation == "gelu" else F.relu
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class SwiGLU(nn.Module):
    """The gated feed-forward of Llama (Shazeer 2020): ``down(dropout(silu(gate(x)) * up(x)))``."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        return self.down_proj(self.dropout(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The model's normalization over ``d_model``: ``nn.LayerNorm`` or ``nn.RMSNorm`` (``model.norm``)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


def make_ffn(cfg: ModelConfig) -> nn.Module:
    """The block's feed-forward (``model.mlp``): :class:`FeedForward` or :class:`SwiGLU`."""
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg.d_model, cfg.ffn_dim, cfg.dropout, cfg.bias)
    return FeedForward(cfg.d_model, cfg.ffn_dim, cfg.dropout, cfg.activation, cfg.bias)


class Block(nn.Module):
    """Self-attention [+ cross-attention] + feed-forward, each a residual sub-layer.

    Post-LN (the paper): ``x = LN(x + Dropout(Sublayer(x)))``; pre-LN: ``x = x + Dropout(Sublayer(LN(x)))``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        cross: bool,
        index: int,
        kind: LayerKind = DEFAULT_KIND,
        cross_kind: LayerKind = DEFAULT_KIND,
    ):
        super().__init__()
        d = cfg.d_model
        self.index, self.pre_ln = index, cfg.pre_ln
        attention = functools.partial(MultiHeadAttention, d, cfg.n_heads, cfg.attn_dropout, bias=cfg.bias)
        self.self_attn = attention(sinks=kind.sinks, knobs=kind.knobs)
        self.norm1 = make_norm(cfg)
        self.cross_attn = (
            attention(cross=True, sinks=cross_kind.sinks, knobs=cross_kind.knobs) if cross else None
        )
        self.norm2 = make_norm(cfg) if cross else None
        self.ffn = make_ffn(cfg)
        self.norm3 = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, fn) -> Tensor:
        if self.pre_ln:
            return x + self.dropout(fn(norm(x)))
        return norm(x + self.dropout(fn(x)))

    def forward(
        self,
        x: Tensor,
        self_ctx: AttentionContext,
        *,
        memory: Tensor | None = None,
        cross_ctx: AttentionContext | None = None,
        cache: tuple[LayerCache, LayerCache] | None = None,
    ) -> Tensor:
        """``x`` (B, T, D) -> (B, T, D)."""
        sc, cc = cache if cache is not None else (None, None)
        x = self._sublayer(x, self.norm1, lambda h: self.self_attn(h, self_ctx, layer=self.index, cache=sc))
        if self.cross_attn is not None:
            x = self._sublayer(
                x,
                self.norm2,
                lambda h: self.cross_attn(h, cross_ctx, layer=self.index, memory=memory, cache=cc),
            )
        return self._sublayer(x, self.norm3, self.ffn)
