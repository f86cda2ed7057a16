"""Data-dependent ALiBi, the forget-gate bias of the Forgetting Transformer (Lin et al. 2025,
"Forgetting Transformer: Softmax Attention with a Forget Gate"; x-transformers' ``DataDependentAlibi``).

Every token ``t`` gets a per-head forget gate from the layer input, ``f_{t,h} = σ(w_h·x_t + b_h)``; the
score bias of query ``i`` and key ``j <= i`` is the log of the product of the gates in between:

    b_h(i, j) = scale · Σ_{l=j+1}^{i} log f_{l,h} = c_{i,h} - c_{j,h},  c_{t,h} = scale · Σ_{l<=t} log f_{l,h}

The gates are per layer (one ``Linear(D, H)`` per layer, bias initialised to ``bias_init`` so that
``f ≈ 1`` at the start). Its bias form is ``Features(key_columns=True)``: the attention layer calls
:meth:`input_features` on its input, which returns the running sums ``c`` (B, H, T, 1) continued from
the cached ones, and the KV cache keeps them next to the keys, so cached decoding sees exactly the
sums of the full forward. The bias is :meth:`feature_bias` of the two tokens' sums, so FlexAttention
runs it (and trains the gates) by reading ``c`` as captured tensors. Within a softmax row ``c_i`` is a
constant, so the bias is ``-c_j`` (:meth:`key_bias`): in float32, fused SDPA takes it as one more
head-dim column (``posformer.model.backends.keycol``), with no (T, T) tensor. Defined for causal
attention (the gates run left to right); the positions tensor is not read (``content_positions``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error
from posformer.pe.forms import Features


@register("forget_alibi")
class ForgetGateBias(PositionalEncoding):
    #: the bias of the layer input's features, elementwise; its key part ``-c_j`` as key columns
    bias_form = Features(key_columns=True)
    causal_only = True
    content_positions = True
    paper = "Lin et al. 2025"
    extrapolates = "yes"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        bias_init: float = 5.0,
        scale: float = 1.0,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if scale <= 0:
            raise option_error("forget_alibi", "scale", scale, "must be > 0 (it multiplies log f <= 0)")
        self.gates = nn.ModuleList(nn.Linear(d_model, n_heads) for _ in range(n_layers))
        for lin in self.gates:
            nn.init.constant_(lin.bias, float(bias_init))
        self.scale = float(scale)

    def input_features(self, x: Tensor, *, layer: int = 0, past: Tensor | None = None) -> Tensor:
        """Running sums ``c`` of the scaled log forget gates: ``x`` (B, T, D) -> (B, H, T, 1), float32."""
        lin = self.gates[layer]
        log_f = F.logsigmoid(lin(x.to(lin.weight.dtype)).float()) * self.scale  # (B, T, H)
        c = log_f.transpose(1, 2).cumsum(-1).unsqueeze(-1)  # (B, H, T, 1)
        if past is not None and past.shape[2]:
            c = c + past[:, :, -1:]  # continue the sums of the cached tokens
        return c

    def bias(
        self,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        q: Tensor | None = None,
        q_feats: Tensor | None = None,
        k_feats: Tensor | None = None,
        layer: int = 0,
    ) -> Tensor:
        if q_feats is None or k_feats is None:
            raise ValueError("forget_alibi's bias reads the layer input: pass q_feats and k_feats")
        return self.feature_bias(q_feats.float(), k_feats.float().transpose(-1, -2))  # (B, H, Tq, Tk)

    def feature_bias(self, q_feat: Tensor, k_feat: Tensor) -> Tensor:
        """``c_i - c_j``: the scaled log gates of the tokens after key ``j`` up to query ``i``."""
        return q_feat - k_feat

    def key_bias(self, k_feat: Tensor) -> Tensor:
        """``-c_j``: the softmax cancels ``c_i``, the query's own sum."""
        return -k_feat
