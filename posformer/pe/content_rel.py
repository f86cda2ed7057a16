"""Content-conditioned relative bias: each token mixes a shared bank of learned bias-versus-distance
curves (Thinking Machines' Inkling, ``transformers.models.inkling2``' ``Inkling2RelativePositionBias``;
x-transformers' ``RelativeProjPositionalBias``).

Every query token ``i`` gets per-head mixing weights from the layer input, ``w_{i,h} = (W x_i)_h`` in
``R^{d_rel}``, optionally scaled per head and L2-clipped (Inkling: ``s_h ∘ w`` shrunk to norm at most
``clip``) and multiplied by the floor-log temperature of its position ``p``
(``tau(p) = 1 + alpha · log(max((p + 1) / floor, 1))``). The bank ``P`` (d_rel, E) holds ``d_rel``
curves over the distances ``0 … E-1``; the bias is the query's mixture read at the distance:

    b_h(i, j) = tau(p_i) · (w_{i,h} · P)[p_i - p_j]   if 0 <= p_i - p_j < E,   else 0

so past its extent ``E`` (and for keys after the query) the bias is zero. One ``Linear``, scale and bank
per layer. Its bias form is ``PerCall(reads={"x"})``: the attention layer hands the layer input's
:meth:`input_features` (the mixing weights, (B, H, T, d_rel)) to the bias of each call, which
materialises it per query block (SDPA with a float mask; the explicit softmax). Weights, curves and bias
are float32 under any autocast or weight dtype. x-transformers' module is
``linear_bias=True, clip=0``; Inkling's is ``linear_bias=False, clip=8`` (with ``log_alpha=0.1,
log_floor=128000`` on its full-attention layers). The per-token sinks and the floor-log temperature on
the queries that Inkling uses next to it are layer-kind settings (``sinks: token``,
``temperature: {kind: floorlog}``: :mod:`posformer.model.schedule`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError
from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error, relative_distance
from posformer.pe.forms import PerCall
from posformer.precision import autocast_off, float32_call


def floor_log_scale(positions: Tensor, alpha: float, floor: float) -> Tensor:
    """``1 + alpha · log(max((p + 1) / floor, 1))`` of positions (B|1, T): float32 (B|1, T)."""
    p = positions.to(torch.float32)
    return 1.0 + alpha * torch.log(((p + 1.0) / floor).clamp(min=1.0))


@register("content_rel")
class ContentRelativeBias(PositionalEncoding):
    #: the bias reads the layer input's per-token mixing weights, per layer and call
    bias_form = PerCall(reads=frozenset({"x"}))
    causal_only = True
    paper = "Inkling (Thinking Machines 2026)"
    extrapolates = "yes (zero past its extent)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        d_rel: int = 16,
        extent: int = 1024,
        linear_bias: bool = False,
        clip: float = 8.0,
        log_alpha: float = 0.0,
        log_floor: float = 128000.0,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if isinstance(d_rel, bool) or not isinstance(d_rel, int) or d_rel < 1:
            raise option_error("content_rel", "d_rel", d_rel, "must be an integer >= 1 (curves in the bank)")
        if isinstance(extent, bool) or not isinstance(extent, int) or extent < 1:
            raise option_error("content_rel", "extent", extent, "must be an integer >= 1 (distances 0 … E-1)")
        if not math.isfinite(clip) or clip < 0:
            raise option_error("content_rel", "clip", clip, "must be >= 0 (0: no scale and no clip)")
        if not math.isfinite(log_alpha) or log_alpha < 0:
            raise option_error("content_rel", "log_alpha", log_alpha, "must be >= 0 (0: no log scaling)")
        if not math.isfinite(log_floor) or log_floor < 1:
            raise option_error("content_rel", "log_floor", log_floor, "must be >= 1 (positions per unit)")
        self.d_rel, self.extent = d_rel, extent
        self.clip, self.log_alpha, self.log_floor = float(clip), float(log_alpha), float(log_floor)
        self.linears = nn.ModuleList(
            nn.Linear(d_model, n_heads * d_rel, bias=linear_bias) for _ in range(n_layers)
        )
        self.scales = nn.ParameterList(
            nn.Parameter(torch.ones(n_heads, d_rel)) for _ in range(n_layers if clip else 0)
        )
        self.banks = nn.ParameterList(
            nn.Parameter(torch.randn(d_rel, extent) * 0.02) for _ in range(n_layers)
        )

    def input_features(self, x: Tensor, *, layer: int = 0, past: Tensor | None = None) -> Tensor:
        """The per-head mixing weights of each token: ``x`` (B, T, D) -> (B, H, T, d_rel), float32
        (scaled and L2-clipped with ``clip``); ``past`` is not read (a token's weights are its own)."""
        w = float32_call(self.linears[layer], x).unflatten(-1, (self.n_heads, self.d_rel))  # (B, T, H, d_rel)
        if self.clip:
            w = w * self.scales[layer].float()
            norm = torch.linalg.vector_norm(w, dim=-1, keepdim=True)
            w = w * (self.clip / (norm + 1e-6)).clamp(max=1.0)
        return w.transpose(1, 2)  # (B, H, T, d_rel)

    def bias(
        self,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        q: Tensor | None = None,
        layer: int = 0,
        q_feats: Tensor | None = None,
        k_feats: Tensor | None = None,
    ) -> Tensor:
        """(B, H, Tq, Tk) float32 from ``q_feats`` (B, H, Tq, d_rel), integer ``q_pos`` (B|1, Tq) and
        ``k_pos`` (B|1, Tk); ``k_feats`` is not read (the curve is the query's)."""
        if q_feats is None:
            raise RuntimeError("pe='content_rel' reads the layer input: attention must pass q_feats")
        if q_pos.is_floating_point() or k_pos.is_floating_point():
            raise ConfigError(
                "pe='content_rel' reads a learned curve at integer distances; fractional positions "
                "(interpolation) have none: use integer positions (pe_options without scaling)."
            )
        with autocast_off(q_feats.device):  # the bank's curves in float32 under any autocast or weight dtype
            curves = q_feats.float() @ self.banks[layer].float()  # (B, H, Tq, E)
        if self.log_alpha:
            tau = floor_log_scale(q_pos, self.log_alpha, self.log_floor)  # (B|1, Tq)
            curves = curves * tau[:, None, :, None]
        dist = relative_distance(q_pos, k_pos)[:, None]  # (B|1, 1, Tq, Tk)
        index = dist.clamp(0, self.extent - 1).expand(curves.shape[0], curves.shape[1], -1, -1)
        out = curves.gather(-1, index)  # (B, H, Tq, Tk)
        return out.masked_fill((dist < 0) | (dist >= self.extent), 0.0)
