"""FIRE: functional interpolation for relative positions (Li et al. 2023, "Functional Interpolation
for Relative Positions Improves Long Context Transformers").

    b(i, j) = f_θ( ψ(i - j) / ψ(max(L, i)) ),   ψ(x) = log(c·x + 1)

with ``f_θ`` a small MLP (1 -> hidden -> H), ``c > 0`` and the threshold ``L`` learned. The
progressive normalisation by the query position makes the input lie in [0, 1] at every length,
which is what lets FIRE interpolate to longer contexts. In bidirectional attention the distance is
``|i - j|`` and its sign is fed as a second MLP input. Shared across layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import Capabilities, PositionalEncoding, option_error, relative_distance


@register("fire")
class FIRE(PositionalEncoding):
    capabilities = Capabilities(hooks=frozenset({"bias"}))
    paper = "Li et al. 2023"
    extrapolates = "yes"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        hidden: int = 32,
        init_c: float = 0.1,
        init_threshold: float = 512.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if hidden < 1:
            raise option_error("fire", "hidden", hidden, "must be >= 1")
        self.mlp = nn.Sequential(nn.Linear(1 if causal else 2, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.log_c = nn.Parameter(torch.tensor(float(init_c)).log())
        self.threshold = nn.Parameter(torch.tensor(float(init_threshold)))
        self.eps = eps

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        c = self.log_c.float().exp()
        dist = relative_distance(q_pos, k_pos).float()  # (B|1, Tq, Tk): i - j
        psi = torch.log1p(c * dist.abs())
        threshold = self.threshold.float().abs()
        norm = torch.log1p(c * torch.maximum(q_pos.float().abs(), threshold))  # (B|1, Tq)
        v = psi / (norm.unsqueeze(-1) + self.eps)  # (B|1, Tq, Tk)
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
            return self._piecewise_linear(v, None if self.causal else torch.sign(dist))
        x = v.unsqueeze(-1)  # (B|1, Tq, Tk, 1)
        if not self.causal:
            x = torch.cat((x, torch.sign(dist).unsqueeze(-1)), dim=-1)  # (B|1, Tq, Tk, 2)
        x = x.to(self.mlp[0].weight.dtype)  # the model may be cast to bf16
        # long inputs: the MLP's hidden activations (Tq·Tk·hidden floats) in row blocks of <= ~64 MB
        rows = max(1, (16 * 2**20) // max(1, x.shape[0] * x.shape[2] * self.mlp[0].out_features))
        parts = [self.mlp(x[:, r : r + rows]).float() for r in range(0, x.shape[1], rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B|1, Tq, Tk, H)
        return out.permute(0, 3, 1, 2)  # (B|1, H, Tq, Tk)

    # ------------------------------------------------------------------ fast exact evaluation
    @torch.no_grad()
    def segments(self, sign: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The MLP as the piecewise-linear function it is: ``f(x) = α_s·x + β_s`` on segment ``s``.

        ``f(x) = W2·relu(w·x + b) + b2`` (with the sign input folded into ``b`` when bidirectional)
        changes slope only where a hidden unit switches on or off, at ``x = -b_h / w_h``.

        Returns:
            breakpoints (m,) sorted, float32; α (H, m + 1) and β (H, m + 1), float32.
        """
        lin1, lin2 = self.mlp[0], self.mlp[2]
        w = lin1.weight[:, 0].double()  # (hidden,)
        b = lin1.bias.double() if lin1.bias is not None else torch.zeros_like(w)
        if sign is not None:
            b = b + lin1.weight[:, 1].double() * sign
        w2 = lin2.weight.double()  # (H, hidden)
        b2 = lin2.bias.double() if lin2.bias is not None else w2.new_zeros(w2.shape[0])
        nz = w != 0
        breaks = torch.sort(-b[nz] / w[nz]).values  # (m,)
        # one point inside every segment: below the first break, between breaks, above the last
        if breaks.numel():
            mids = torch.cat((breaks[:1] - 1, (breaks[1:] + breaks[:-1]) / 2, breaks[-1:] + 1))
        else:
            mids = w.new_zeros(1)
        active = (mids.unsqueeze(1) * w + b > 0).double()  # (m + 1, hidden)
        alpha = (active * w) @ w2.T  # (m + 1, H)
        beta = (active * b) @ w2.T + b2  # (m + 1, H)
        return breaks.float(), alpha.T.float().contiguous(), beta.T.float().contiguous()

    def _piecewise_linear(self, v: Tensor, sign: Tensor | None) -> Tensor:
        """No-grad bias from the MLP input ``v`` (B|1, Tq, Tk) [and ``sign`` (B|1, Tq, Tk) when
        bidirectional] -> (B|1, H, Tq, Tk), float32.

        Equal to the MLP up to float rounding, without its (Tq, Tk, hidden) activations: one
        ``searchsorted`` and two gathers per entry (about 10x faster at long lengths, see tests).
        """
        v = v.float().contiguous()
        out = None
        for s in (None,) if sign is None else (-1.0, 0.0, 1.0):
            breaks, alpha, beta = self.segments(s)
            seg = torch.searchsorted(breaks, v)  # (B|1, Tq, Tk): segment index in [0, m]
            part = (alpha[:, seg] * v + beta[:, seg]).movedim(0, 1)  # (H, B|1, Tq, Tk) -> (B|1, H, Tq, Tk)
            if sign is None:
                return part
            out = part if out is None else torch.where((sign == s).unsqueeze(1), part, out)
        return out
