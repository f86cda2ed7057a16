"""Relative position representations (Shaw et al. 2018, "Self-Attention with Relative Position
Representations").

The clipped offset ``r = clip(j - i, -k, k)`` selects learned vectors ``a^K_r, a^V_r ∈ R^{Dh}``
(shared across heads, one set per layer as in the paper):

    e_ij = q_i · (k_j + a^K_r) / √Dh          z_i = Σ_j α_ij (v_j + a^V_r)

The key term is a query-dependent score bias (``bias`` hook); the value term needs the attention
probabilities (``value`` hook), so where the shortcut below does not run, attention takes the explicit
softmax path. ``value_relations=False`` keeps only the key term (and SDPA with a materialised bias).

For positions ``0 … T-1`` (training and evaluation alike), :meth:`attention` (the
:class:`~posformer.pe.shortcut.AttentionShortcut` mixin) computes the same result
from fused kernels: every key at least ``k`` positions to the left of the query has the same offset
``-k``, so that region is ordinary causal attention with keys ``k_j + a^K_-k`` (values ``v_j + a^V_-k``)
shifted by ``k``; likewise ``+k`` on the right; only the band ``|j - i| < k`` (causal: ``j <= i``) is
explicit, in blocks of queries (:meth:`ShawRelative._band`). The regions'
softmaxes are merged with their log-sum-exps, and gradients flow through the merge: the fused kernel's
log-sum-exp is differentiable. Cost: one fused attention plus O(T·k·Dh) instead of O(T²) explicit work
and memory. The fused kernel is the model's ``causal_lse`` (:data:`~posformer.pe.base.CausalLSE`): the
CPU flash kernel on the CPU, compiled FlexAttention with a causal block mask on CUDA. Without value
relations the same shortcut runs with zero value vectors (offered on CUDA; the CPU keeps its masked
SDPA path).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import Capabilities, PositionalEncoding, option_error, relative_distance
from posformer.pe.forms import PerCall
from posformer.pe.shortcut import AttentionShortcut, CausalLSE, KeyVisible

#: the shortcut's default least length, in multiples of k: (causal or no gradients, bidirectional
#: training), about where it breaks even with the explicit softmax on the CPU (one layer, k 16, B·T 16k
#: tokens, 1 thread: causal training 0.82-0.85x at 192 tokens, 0.94-1.13x at 256, 1.15x at 320;
#: bidirectional training 0.84-0.88x at 320, 0.92-1.05x at 384, 1.16x at 512;
#: scripts/bench_shortcut_length.py, docs/performance.md)
SHORTCUT_LEN_PER_K = (16, 24)


@register("shaw")
class ShawRelative(AttentionShortcut, PositionalEncoding):
    bias_form = PerCall(reads=frozenset({"q"}))
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
        shortcut_min_len: int | None = None,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if max_relative_position < 1:
            raise option_error("shaw", "max_relative_position", max_relative_position, "must be >= 1")
        if shortcut_min_len is not None and shortcut_min_len < 0:
            raise option_error(
                "shaw", "shortcut_min_len", shortcut_min_len, "must be >= 0 (or null: automatic)"
            )
        self.k = int(max_relative_position)
        self.shortcut_min_len = shortcut_min_len
        n_rel = 2 * self.k + 1
        self.rel_k = nn.Parameter(torch.randn(n_layers, n_rel, self.head_dim) * 0.02)
        self.value_relations = bool(value_relations)
        if self.value_relations:
            self.rel_v = nn.Parameter(torch.randn(n_layers, n_rel, self.head_dim) * 0.02)
        self.refresh_capabilities()

    def describe(self) -> Capabilities:
        """Without value relations there is no value hook (attention then takes the SDPA paths)."""
        caps = type(self).capabilities
        return caps if self.value_relations else replace(caps, hooks=frozenset({"bias"}))

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

    # ------------------------------------------------------------------ the region shortcut
    def min_shortcut_len(self, grad: bool) -> int:
        """Tokens from which the shortcut replaces the explicit softmax: ``shortcut_min_len``, or by
        default :data:`SHORTCUT_LEN_PER_K` times ``k`` (bidirectional training: its second region and
        wider band pay later). Below, the band and the far regions' launches cost more than the (T, T)
        softmax they replace."""
        if self.shortcut_min_len is not None:
            return self.shortcut_min_len
        return SHORTCUT_LEN_PER_K[not self.causal and grad] * self.k

    def offers_attention(
        self, device_type: str, *, grad: bool = False, masked: bool = False, length: int | None = None
    ) -> bool:
        """The shortcut replaces the explicit softmax (value term) or the materialised bias (key term
        only), with or without gradients (both kernels differentiate their log-sum-exp).

        CPU: with value relations (without them the CPU's masked SDPA path is as fast at T 512 and its
        numerics stay as they were). CUDA: always; the model then hands it compiled FlexAttention as
        ``causal_lse`` (and takes the explicit path where it has none: ``model.attention_backend=sdpa``,
        no FlexAttention). Padded and packed rows (``masked``) alike: every region and the band read the
        visibility. From :meth:`min_shortcut_len` tokens (``length``; None: any).
        """
        if length is not None and length < self.min_shortcut_len(grad):
            return False
        return self.value_relations if device_type == "cpu" else device_type == "cuda"

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        causal_lse: CausalLSE,
        layer: int = 0,
        visible: KeyVisible | None = None,
    ) -> Tensor:
        """Exact attention for index distances ``i - j`` from ``causal_lse`` for the far regions and the
        explicit band: (B, H, T, Dh) -> (B, H, T, Dh), differentiable. Without value relations ``a^V_r``
        are zero (the key term). ``visible`` (padding, documents) is read in each region's indices."""
        m, T = self.k, q.shape[2]
        a_k = self.rel_k[layer].to(q.dtype)  # (2m+1, Dh)
        a_v = self.rel_v[layer].to(q.dtype) if self.value_relations else torch.zeros_like(a_k)  # (2m+1, Dh)
        parts: list[tuple[Tensor, Tensor]] = []  # (lse (B, H, T), normalised output (B, H, T, Dh))
        if m < T:  # far left: keys j <= i - m, offset -m; query i -> row i - m of a causal attention
            left = None if visible is None else lambda b, r, c: visible(b, r + m, c)
            out, lse = causal_lse(q[:, :, m:], k[:, :, : T - m] + a_k[0], v[:, :, : T - m], left, "shaw-left")
            parts.append((F.pad(lse, (m, 0), value=float("-inf")), F.pad(out + a_v[0], (0, 0, m, 0))))
            if not causal:  # far right: keys j >= i + m, offset +m; flipped, it is causal too
                # flipped row r is query T - m - 1 - r, flipped column c is key T - 1 - c; the lengths as
                # tensors (a Python int in a Flex mask_mod is a constant: one compile per length), filled
                # on the device (torch.tensor of host ints would be a blocking copy)
                rows, cols = (torch.full((), n, device=q.device) for n in (T - m - 1, T - 1))
                flip = None if visible is None else lambda b, r, c: visible(b, rows - r, cols - c)
                out, lse = causal_lse(
                    q[:, :, : T - m].flip(2),
                    (k[:, :, m:] + a_k[-1]).flip(2),
                    v[:, :, m:].flip(2),
                    flip,
                    "shaw-right",
                )
                right = (out.flip(2) + a_v[-1], lse.flip(2))
                parts.append((F.pad(right[1], (0, m), value=float("-inf")), F.pad(right[0], (0, 0, 0, m))))
        parts.append(self._band(q, k, v, a_k, a_v, causal, visible))
        lse = torch.stack([p[0] for p in parts]).logsumexp(0)  # (B, H, T) float32
        out = sum((p[0] - lse).exp().unsqueeze(-1) * p[1] for p in parts)  # float32
        return out.to(q.dtype)

    def _band(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        a_k: Tensor,
        a_v: Tensor,
        causal: bool,
        visible: KeyVisible | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Keys with |j - i| < m (causal: j <= i), explicitly: (lse (B, H, T), normalised output
        (B, H, T, Dh)).

        In blocks of ``n`` queries, each against the ``n + w - 1`` keys its band can reach (``w`` band
        offsets), so scores and outputs are batched matmuls; the relation terms move between the band's
        relative layout (offset ``r``) and the block's (key column ``t + r - lo``) by :func:`_skew` /
        :func:`_unskew`, which are pads and views. Differentiable (the shortcut's training path).
        ``visible`` hides more keys; a query that sees none of the band gets log-sum-exp ``-inf`` and
        output 0 (computed over every band key, then masked: no NaN reaches the gradients).
        """
        m, T, scale = self.k, q.shape[2], q.shape[-1] ** -0.5
        lo, hi = -(m - 1), 0 if causal else m - 1  # the band's offsets r = j - i
        w = hi - lo + 1
        n = max(32, w)  # queries per block: the matmuls stay large, the waste (n + w - 1 keys) bounded
        nb = -(-T // n)  # blocks
        span = n + w - 1  # keys a block's band reaches
        pad_t = nb * n - T
        qb = F.pad(q, (0, 0, 0, pad_t)).unflatten(2, (nb, n))  # (B, H, nb, n, Dh)
        kw = F.pad(k, (0, 0, -lo, hi + pad_t)).unfold(2, span, n)  # (B, H, nb, Dh, span)
        vw = F.pad(v, (0, 0, -lo, hi + pad_t)).unfold(2, span, n).transpose(-1, -2)  # (B, H, nb, span, Dh)
        rel_k = a_k[m + lo : m + hi + 1]  # (w, Dh): a^K_r for r = lo … hi
        rel_v = a_v[m + lo : m + hi + 1]  # (w, Dh)
        scores = qb @ kw + _skew(qb @ rel_k.T, span)  # (B, H, nb, n, span)
        row = torch.arange(n, device=q.device).unsqueeze(1)  # (n, 1)
        col = torch.arange(span, device=q.device)  # (span,)
        first = torch.arange(nb, device=q.device).view(nb, 1, 1) * n  # (nb, 1, 1): the block's first query
        key = first + lo + col  # (nb, 1, span): key index of every column
        # the band's real keys; the padding queries past T see their zero keys too, so that no row is empty
        # (an empty row's NaN would reach the gradients through the zero upstream gradient)
        band = (col - row >= 0) & (col - row < w) & (((key >= 0) & (key < T)) | (first + row >= T))
        if visible is None:
            scores = (scores.float() * scale).masked_fill(~band, float("-inf"))  # band: (nb, n, span)
            lse = scores.logsumexp(-1)  # (B, H, nb, n); finite: r = 0 is visible to every query
            probs = (scores - lse.unsqueeze(-1)).exp().to(q.dtype)  # (B, H, nb, n, span)
        else:
            b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
            seen = band & visible(b, (first + row).clamp(max=T - 1), key.clamp(0, T - 1))  # (B, nb, n, span)
            empty = ~seen.any(-1, keepdim=True)  # (B, nb, n, 1): rows that see no band key
            seen = (seen | (empty & band)).unsqueeze(1)  # (B, 1, nb, n, span): those see the band
            scores = (scores.float() * scale).masked_fill(~seen, float("-inf"))
            lse = scores.logsumexp(-1)  # (B, H, nb, n); finite: every row sees some band key now
            probs = (scores - lse.unsqueeze(-1)).exp().masked_fill(empty.unsqueeze(1), 0.0).to(q.dtype)
            lse = lse.masked_fill(empty.squeeze(-1).unsqueeze(1), float("-inf"))  # (B, H, nb, n)
        out = probs @ vw + _unskew(probs, w) @ rel_v  # (B, H, nb, n, Dh)
        return lse.flatten(2)[..., :T], out.flatten(2, 3)[:, :, :T]


def _skew(x: Tensor, span: int) -> Tensor:
    """Relative to block layout: (..., n, w) -> (..., n, span), ``y[t, t + c] = x[t, c]``, zeros elsewhere
    (``span >= n + w - 1``): pad each row to ``span + 1``, then read the flat rows ``span`` at a time."""
    n, w = x.shape[-2:]
    y = F.pad(x, (0, span + 1 - w)).flatten(-2)  # (..., n * (span + 1))
    return y[..., : n * span].unflatten(-1, (n, span))


def _unskew(y: Tensor, w: int) -> Tensor:
    """Block to relative layout, the inverse of :func:`_skew`: (..., n, span) -> (..., n, w),
    ``x[t, c] = y[t, t + c]``."""
    n, span = y.shape[-2:]
    x = F.pad(y.flatten(-2), (0, n))  # (..., n * (span + 1))
    return x.unflatten(-1, (n, span + 1))[..., :w]
