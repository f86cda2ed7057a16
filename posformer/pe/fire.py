"""FIRE: functional interpolation for relative positions (Li et al. 2023, "Functional Interpolation
for Relative Positions Improves Long Context Transformers").

    b(i, j) = f_θ( ψ(i - j) / ψ(max(L, i)) ),   ψ(x) = log(c·x + 1)

with ``f_θ`` a small MLP (1 -> hidden -> H), ``c > 0`` and the threshold ``L`` learned. The
progressive normalisation by the query position makes the input lie in [0, 1] at every length,
which is what lets FIRE interpolate to longer contexts. In bidirectional attention the distance is
``|i - j|`` and its sign is fed as a second MLP input. Shared across layers.

The bias is elementwise in (head, i, j) (:meth:`FIRE.bias_fn`): the MLP is evaluated as the
piecewise-linear function it is (:meth:`FIRE.segments`), one segment lookup and one multiply-add per
score, which is also what FlexAttention's ``score_mod`` runs. With gradients, :meth:`FIRE.bias` keeps
the MLP form on the materialised path (the same function, equal to rounding; training numerics
unchanged).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import BiasAt, PositionalEncoding, option_error, relative_distance
from posformer.pe.forms import Positions
from posformer.precision import float32_call


def count_below(breaks: Tensor, v: Tensor) -> Tensor:
    """How many of the sorted ``breaks`` (m,) lie below each ``v``: ``torch.searchsorted(breaks, v)``.

    Under ``torch.compile`` (FlexAttention's ``score_mod``, whose pointwise lowering has no bucketize)
    the same integers come from ``m`` comparisons.
    """
    if not torch.compiler.is_compiling():
        return torch.bucketize(v, breaks)
    if breaks.shape[0] == 0:
        return torch.zeros_like(v, dtype=torch.int32)
    seg = (v > breaks[0]).to(torch.int32)
    for j in range(1, breaks.shape[0]):
        seg = seg + (v > breaks[j]).to(torch.int32)
    return seg


@register("fire")
class FIRE(PositionalEncoding):
    #: elementwise; bias_fn reads per-head vectors, each indexed once (no 0-d c or L)
    bias_form = Positions(score_mod=True, trainable=True)
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

    def _needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """``f_θ(ψ(i - j) / ψ(max(L, i)))[h]``, ``f_θ`` from its linear segments (differentiable in θ
        when gradients are needed: the segments' slopes and offsets are functions of the weights).

        What the function reads from the parameters are per-head tensors, each indexed once (``c`` and
        ``L`` copied per head, the slopes and offsets of every sign stacked): the form FlexAttention can
        differentiate (``trainable`` in its form; a 0-d trainable scalar in a ``score_mod`` it cannot).
        """
        heads = self.n_heads
        c = self.log_c.float().exp().expand(heads).contiguous()  # (H,): c per head
        threshold = self.threshold.float().abs().expand(heads).contiguous()  # (H,): L per head
        # no Python float in the closure: under torch.compile(dynamic=True) one becomes a CPU float64
        # input, which FlexAttention's CUDA lowering cannot read (seen on an H200, torch 2.11)
        eps = torch.full((), self.eps, device=c.device)
        signs = (None,) if self.causal else (-1, 0, 1)
        pieces = [self.segments(s, grad=self._needs_grad()) for s in signs]  # (breaks, α, β) per sign
        breaks = [b for b, _, _ in pieces]  # (m,) per sign; m is the same for every sign
        # (S·H·(m + 1),): sign, head, segment; concatenated, not a view (dynamo drops a view's gradient)
        alpha = torch.cat([a.flatten() for _, a, _ in pieces])
        beta = torch.cat([b.flatten() for _, _, b in pieces])
        width = pieces[0][1].shape[1]  # m + 1 segments

        def fire(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
            dist = (q_pos - k_pos).float()  # i - j
            c_h, threshold_h = c[h], threshold[h]
            psi = torch.log1p(c_h * dist.abs())
            norm = torch.log1p(c_h * torch.maximum(q_pos.float().abs(), threshold_h))
            v = psi / (norm + eps)  # the MLP input, in [0, 1]
            seg = count_below(breaks[0], v)  # segment index in [0, m]
            index = h * width + seg
            if len(breaks) > 1:  # bidirectional: sign(i - j) = -1, 0, 1 picks the pieces 0, 1, 2
                sign = torch.sign(dist).long() + 1
                seg = torch.where(sign == 1, count_below(breaks[1], v), seg)
                seg = torch.where(sign == 2, count_below(breaks[2], v), seg)
                index = (sign * heads + h) * width + seg
            return alpha[index] * v + beta[index]

        return fire

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        if not self._needs_grad():  # the elementwise (piecewise-linear) form, ~10x faster than the MLP
            return super().bias(q_pos, k_pos, layer=layer)
        c = self.log_c.float().exp()
        dist = relative_distance(q_pos, k_pos).float()  # (B|1, Tq, Tk): i - j
        psi = torch.log1p(c * dist.abs())
        threshold = self.threshold.float().abs()
        norm = torch.log1p(c * torch.maximum(q_pos.float().abs(), threshold))  # (B|1, Tq)
        v = psi / (norm.unsqueeze(-1) + self.eps)  # (B|1, Tq, Tk)
        x = v.unsqueeze(-1)  # (B|1, Tq, Tk, 1)
        if not self.causal:
            x = torch.cat((x, torch.sign(dist).unsqueeze(-1)), dim=-1)  # (B|1, Tq, Tk, 2)
        # long inputs: the MLP's hidden activations (Tq·Tk·hidden floats) in row blocks of <= ~64 MB; in
        # float32 under any autocast or weight dtype (the segments' form is float32/float64 too)
        rows = max(1, (16 * 2**20) // max(1, x.shape[0] * x.shape[2] * self.mlp[0].out_features))
        parts = [float32_call(self.mlp, x[:, r : r + rows]) for r in range(0, x.shape[1], rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B|1, Tq, Tk, H)
        return out.permute(0, 3, 1, 2)  # (B|1, H, Tq, Tk)

    # ------------------------------------------------------------------ fast exact evaluation
    def segments(self, sign: float | None = None, *, grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """The MLP as the piecewise-linear function it is: ``f(x) = α_s·x + β_s`` on segment ``s``.

        ``f(x) = W2·relu(w·x + b) + b2`` (with the sign input folded into ``b`` when bidirectional)
        changes slope only where a hidden unit switches on or off, at ``x = -b_h / w_h``. With
        ``grad``, α and β carry gradients to the MLP's weights (the breakpoints do not: ``f`` is
        continuous across them).

        Returns:
            breakpoints (m,) sorted, float32; α (H, m + 1) and β (H, m + 1), float32.
        """
        with torch.set_grad_enabled(grad):
            return self._segments(sign)

    def _segments(self, sign: float | None) -> tuple[Tensor, Tensor, Tensor]:
        lin1, lin2 = self.mlp[0], self.mlp[2]
        w = lin1.weight[:, 0].double()  # (hidden,)
        b = lin1.bias.double() if lin1.bias is not None else torch.zeros_like(w)
        if sign is not None:
            b = b + lin1.weight[:, 1].double() * sign
        w2 = lin2.weight.double()  # (H, hidden)
        b2 = lin2.bias.double() if lin2.bias is not None else w2.new_zeros(w2.shape[0])
        nz = w != 0
        breaks = torch.sort(-b[nz] / w[nz]).values.detach()  # (m,)
        # one point inside every segment: below the first break, between breaks, above the last
        if breaks.numel():
            mids = torch.cat((breaks[:1] - 1, (breaks[1:] + breaks[:-1]) / 2, breaks[-1:] + 1))
        else:
            mids = w.new_zeros(1)
        active = (mids.unsqueeze(1) * w.detach() + b.detach() > 0).double()  # (m + 1, hidden)
        alpha = (active * w) @ w2.T  # (m + 1, H)
        beta = (active * b) @ w2.T + b2  # (m + 1, H)
        return breaks.float(), alpha.T.float().contiguous(), beta.T.float().contiguous()
