"""CoPE, contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding:
Learning to Count What's Important"; x-transformers' ``CoPE``).

Positions are counted by the content: query ``i`` gates every visible key, ``g_ij = σ(q_i·k_j/√Dh)``,
and the position of key ``j`` is the sum of the gates from ``j`` to ``i`` (a reverse cumulative sum):

    p_ij = min(Σ_{t=j}^{i} g_it, max_pos - 1)
    b(i, j) = (1 - w)·z_i[⌊p_ij⌋] + w·z_i[⌈p_ij⌉],   w = p_ij - ⌊p_ij⌋,   z_i[p] = q_i·e[p]

with learned position embeddings ``e ∈ R^{max_pos × Dh}`` per layer. The bias reads the queries and
the keys (its form: ``PerCall(reads={"q", "k"})``); keys later than the query (``k_pos > q_pos``)
get gate 0. With packed documents the attention context passes ``visible`` (its causal and
block-diagonal mask), so keys of other documents get gate 0 too and the counts never cross a
document boundary. Cached decoding needs nothing beyond the cached keys. Causal attention only; the
positions tensor is read only for that visibility (``content_positions``).

Without gradients (evaluation, prefill) and for positions ``0 … T-1``, :meth:`attention` (the
:class:`~posformer.pe.shortcut.AttentionShortcut` mixin) computes the
same result without a (T, T) bias. The positions saturate: once the gates from ``j`` to ``i`` sum to
``max_pos - 1``, every key further left has ``p_ij = max_pos - 1`` and the same bias ``z_i[max_pos - 1]``,
a constant of the query's row. So if the gates of the band of the last ``w`` keys (offsets
``0 … w-1``) sum to the cap, the keys at offsets ``>= w`` are ordinary causal attention shifted by
``w`` (the model's fused ``causal_lse`` kernel), whose log-sum-exp is raised by that constant; the band
is explicit (blocks of ``w`` queries against ``2w`` keys); the two merge by their log-sum-exps. The
band widens (``w`` doubles, from ``4·max_pos``) while more than ``2w`` query rows fail to saturate in
it; the few that still fail are computed exactly over all their keys. A trained character LM
(``docs/leaderboard.md``, max_pos 16) saturates within 101 keys in every layer and head. Cost: one
fused attention plus O(T·w·Dh), and the failing rows' O(T·Dh) each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error, relative_distance
from posformer.pe.forms import PerCall
from posformer.pe.shortcut import AttentionShortcut, CausalLSE, KeyVisible
from posformer.precision import without_autocast

#: float32 elements of one temporary of the shortcut's band or row blocks (128 MiB)
BLOCK_ELEMENTS = 1 << 25
#: float32 elements of one temporary of the training attention's row blocks (4 MiB: its dozen elementwise
#: passes per block run 4-6x faster on cache-sized blocks than on one (B, H, T, T) block; measured at
#: B 8, H 4, T 512 and B 2, T 2048: 2^20 fastest of 2^18 … 2^22)
TRAIN_BLOCK_ELEMENTS = 1 << 20
#: the same on other devices (CUDA): 128 MiB, so that each of a block's ~50 kernels moves far more data
#: than a launch costs (B 4, H 16, T 2048: 8 blocks a layer; ~20 such temporaries live in the backward,
#: 2.5 GiB); its speed against the masked path is gpu_speed.sh stage sh's to measure
DEVICE_TRAIN_BLOCK_ELEMENTS = 1 << 25
#: on the CPU without gradients, below this many tokens the exact function (:class:`_CopeTraining`'s
#: forward) beats the saturation shortcut in every run (one layer, B·T 16k tokens, 1 thread: 1.5-6x at
#: 64-256 tokens; past that the saturation shortcut's speed varies with its band and the crossing moves
#: between ~300 and ~1000 tokens; scripts/bench_shortcut_length.py, docs/performance.md)
SATURATION_MIN_LEN = 256


@register("cope")
class ContextualPosition(AttentionShortcut, PositionalEncoding):
    bias_form = PerCall(reads=frozenset({"q", "k"}))
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

    @without_autocast
    def positions(self, q: Tensor, k: Tensor, visible: Tensor) -> Tensor:
        """Contextual positions ``p`` (B, H, Tq, Tk), float32, of ``q`` (B, H, Tq, Dh) over ``k``
        (B, H, Tk, Dh); ``visible`` (B|1, 1, Tq, Tk) bool. Float32 under autocast too (a position)."""
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
        return _interpolate(self._z(q, layer), pos)  # (B, H, Tq, Tk)

    @without_autocast
    def _z(self, q: Tensor, layer: int) -> Tensor:
        """``z_i[p] = q_i·e[p]`` for every ``p``: ``q`` (B, H, Tq, Dh) -> (B, H, Tq, max_pos), float32 (also
        under autocast)."""
        return q.float() @ self.pos_emb[layer].float().T

    # ------------------------------------------------------------------ fused no-grad attention
    def offers_attention(
        self, device_type: str, *, grad: bool = False, masked: bool = False, length: int | None = None
    ) -> bool:
        """On the CPU and CUDA, in every case :meth:`attention` takes. Without gradients and masks, the
        saturation shortcut (the flash kernel, FlexAttention): it reads on the host which rows saturate
        (a sync), and an untrained CoPE's gates rarely saturate. With gradients, padding or packed
        documents (``masked``; it counts the gates of the visible keys only), :class:`_CopeTraining`:
        q·k once per row block, the gradients by hand, nothing of size (T, T) kept for the backward.
        The masked path it replaces on CUDA (unmeasured there either way: gpu_speed.sh stage sh
        times the two) keeps ~26 bytes per (batch, head, query, key) for its backward (measured on
        the CPU with saved-tensor hooks, T 1,024): 7 GiB a layer at B 4, H 16, T 2,048, out of an
        80 GiB GPU's reach at T 4,096 with 4 layers."""
        return device_type in ("cpu", "cuda")

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
        """Exact causal attention for positions 0 … T-1: (B, H, T, Dh) -> (B, H, T, Dh).

        With gradients, ``visible`` (padding, documents) or, on the CPU, fewer than
        :data:`SATURATION_MIN_LEN` tokens: :class:`_CopeTraining`. Otherwise: the band of
        the last ``w`` keys explicitly, the
        saturated keys further left from ``causal_lse``, the rows that do not saturate in the band over
        all their keys (reads the saturation on the host)."""
        if not causal:
            raise ValueError("cope is causal only: its shortcut has no bidirectional form")
        T, cap = q.shape[2], self.max_pos - 1
        short = q.device.type == "cpu" and T < SATURATION_MIN_LEN  # the function is faster there
        if torch.is_grad_enabled() or visible is not None or short:  # masks: only the exact function
            return _CopeTraining.apply(q, k, v, self.pos_emb[layer], cap, visible)
        z = self._z(q, layer)  # (B, H, T, max_pos)
        w = min(4 * self.max_pos, T)
        while True:
            lse, out, sums = self._band(q, k, v, z, w)  # (B, H, T), (B, H, T, Dh), (B, H, T)
            unsaturated = (sums < cap).flatten(0, 1).any(0)  # (T,): some batch row or head fails
            rows = unsaturated[w:].nonzero().squeeze(1) + w  # (R,) queries with keys past the band
            if rows.numel() <= 2 * w or w >= T:
                break
            w = min(2 * w, T)
        if w < T:  # keys j <= i - w: causal attention of query i -> row i - w, all at position cap
            far, far_lse = causal_lse(q[:, :, w:], k[:, :, : T - w], v[:, :, : T - w])
            far_lse = far_lse.float() + z[:, :, w:, cap]  # (B, H, T - w): the row's constant bias
            far_lse = F.pad(far_lse, (w, 0), value=float("-inf"))
            merged = torch.logaddexp(lse, far_lse)  # (B, H, T)
            far = F.pad(far.float(), (0, 0, w, 0))  # (B, H, T, Dh)
            out = (lse - merged).exp().unsqueeze(-1) * out + (far_lse - merged).exp().unsqueeze(-1) * far
        if rows.numel():
            out[:, :, rows] = self._rows(q, k, v, rows, layer)
        return out.to(q.dtype)

    @without_autocast
    def _band(self, q: Tensor, k: Tensor, v: Tensor, z: Tensor, w: int) -> tuple[Tensor, Tensor, Tensor]:
        """Every query over its last ``w`` keys (offsets 0 … w-1), in blocks of ``w`` queries against the
        ``2w`` keys of their block and the one before: (lse (B, H, T), normalised output (B, H, T, Dh)
        float32, the band's gate sum (B, H, T)). ``z`` (B, H, T, max_pos) is ``q_i·e[p]``. Float32 scores
        and gates under autocast too."""
        B, H, T, Dh = q.shape
        n = -(-T // w)  # blocks
        pad = n * w - T
        qb = F.pad(q, (0, 0, 0, pad)).view(B, H, n, w, Dh)  # queries b·w … b·w + w-1
        kb = F.pad(k, (0, 0, w, pad)).unfold(2, 2 * w, w)  # (B, H, n, Dh, 2w): keys (b-1)·w … (b+1)·w-1
        vb = F.pad(v, (0, 0, w, pad)).unfold(2, 2 * w, w).transpose(-1, -2)  # (B, H, n, 2w, Dh)
        zb = F.pad(z, (0, 0, 0, pad)).view(B, H, n, w, -1)  # (B, H, n, w, max_pos)
        a = torch.arange(w, device=q.device).unsqueeze(1)  # (w, 1) query within its block
        c = torch.arange(2 * w, device=q.device)  # (2w,) key within the block's keys
        offset = a + w - c  # (w, 2w): i - j
        first = torch.arange(n, device=q.device).view(n, 1, 1) == 0
        visible = (offset >= 0) & (offset < w) & ~(first & (c < w))  # (n, w, 2w): no key before 0
        step = max(1, BLOCK_ELEMENTS // (B * H * w * 2 * w))  # blocks per chunk
        parts = []
        for s in range(0, n, step):
            sl = slice(s, s + step)
            scores = (qb[:, :, sl].float() @ kb[:, :, sl].float()) * Dh**-0.5  # (B, H, n', w, 2w)
            gates = torch.sigmoid(scores) * visible[sl]
            pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_pos - 1)
            scores = (scores + _interpolate(zb[:, :, sl], pos)).masked_fill(~visible[sl], float("-inf"))
            lse = scores.logsumexp(-1)  # (B, H, n', w); never -inf: offset 0 is visible
            probs = (scores - lse.unsqueeze(-1)).exp().to(q.dtype)
            parts.append((lse, (probs @ vb[:, :, sl]).float(), gates.sum(-1)))
        lse, out, sums = (torch.cat(p, 2).flatten(2, 3)[:, :, :T] for p in zip(*parts))
        return lse, out, sums

    @without_autocast
    def _rows(self, q: Tensor, k: Tensor, v: Tensor, rows: Tensor, layer: int) -> Tensor:
        """Exact attention of the queries ``rows`` (R,) over all their keys from :meth:`bias`, in blocks
        of rows: (B, H, R, Dh) float32 (also under autocast)."""
        B, H, T, Dh = k.shape
        k_pos = torch.arange(T, device=q.device).unsqueeze(0)  # (1, T)
        out = []
        for block in rows.split(max(1, BLOCK_ELEMENTS // (B * H * T))):
            qr = q[:, :, block]  # (B, H, r, Dh)
            bias = self.bias(block.unsqueeze(0), k_pos, q=qr, k=k, layer=layer)  # (B, H, r, T)
            scores = (qr.float() @ k.float().transpose(-1, -2)) * Dh**-0.5 + bias
            scores = scores.masked_fill(k_pos > block.unsqueeze(1), float("-inf"))
            out.append((scores.softmax(-1).to(q.dtype) @ v).float())
        return torch.cat(out, 2)


class _CopeTraining(torch.autograd.Function):
    """CoPE's causal attention at positions 0 … T-1 with gradients, in float32, one block of query rows
    at a time (rows are independent: a row's positions count only its own gates).

    The scores ``s = q·kᵀ/√Dh`` are computed once per block and serve both the gates ``σ(s)`` and the
    logits ``s + b`` (the masked path computes q·k three times: gates, the SDPA forward, its backward),
    and nothing of size (T, T) outlives the call: the forward keeps the output and the log-sum-exp, the
    backward recomputes each block's scores (as flash attention does). Gradients, with ``L`` the logits,
    ``P`` the probabilities, ``b = (1 - w)·z[⌊p⌋] + w·z[⌈p⌉]`` and ``p = min(Σ_{t>=j} g_it, cap)``:
    ``∂L = P ∘ (dO·vᵀ - rowsum(dO ∘ O))``; ``∂z`` scatters ``∂L·(1 - w)`` and ``∂L·w`` to their indices;
    ``∂p = ∂L ∘ (z[⌈p⌉] - z[⌊p⌋])`` (0 at the cap); the reverse cumulative sum's adjoint is the forward one,
    ``∂g = cumsum_j ∂p``; ``∂s = ∂L + ∂g ∘ g(1 - g)``. Checked against CoPE written out in float64 and
    differentiated by autograd, and against the masked path (``tests/pe/test_cope_training.py``).
    """

    @staticmethod
    @without_autocast  # float32, as the backward recomputes it (autocast would make it bf16)
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, emb: Tensor, cap: int, visible: KeyVisible | None = None
    ) -> Tensor:
        qf, kf, vf, ef = (t.float() for t in (q, k, v, emb))
        out, lse = torch.empty_like(qf), qf.new_empty(qf.shape[:3])  # (B, H, T, Dh), (B, H, T)
        for r0, r1 in _row_blocks(q):
            logits, _ = _cope_logits(qf[:, :, r0:r1], kf[:, :, :r1], ef, cap, r0, visible)  # (B, H, R, r1)
            lse[:, :, r0:r1] = logits.logsumexp(-1)
            probs = (logits - lse[:, :, r0:r1, None]).exp()
            out[:, :, r0:r1] = probs @ vf[:, :, :r1]
        ctx.save_for_backward(q, k, v, emb, out, lse)
        ctx.cap, ctx.visible = cap, visible
        return out.to(q.dtype)

    @staticmethod
    @without_autocast
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, emb, out, lse = ctx.saved_tensors
        qf, kf, vf, ef, do = (t.float() for t in (q, k, v, emb, d_out))
        scale = q.shape[-1] ** -0.5
        dq, dk, dv, de = (torch.zeros_like(t) for t in (qf, kf, vf, ef))
        rowsum = (do * out).sum(-1, keepdim=True)  # (B, H, T, 1): D_i = dO_i·O_i
        for r0, r1 in _row_blocks(q):
            qb, kb, vb, dob = qf[:, :, r0:r1], kf[:, :, :r1], vf[:, :, :r1], do[:, :, r0:r1]
            logits, (g, w, lo, hi, z_lo, z_hi, visible) = _cope_logits(qb, kb, ef, ctx.cap, r0, ctx.visible)
            probs = (logits - lse[:, :, r0:r1, None]).exp()  # (B, H, R, r1)
            dv[:, :, :r1] += probs.transpose(-1, -2) @ dob
            d_logits = probs * (dob @ vb.transpose(-1, -2) - rowsum[:, :, r0:r1])  # (B, H, R, r1)
            dz = qb.new_zeros(*qb.shape[:3], ef.shape[0])  # (B, H, R, max_pos)
            dz.scatter_add_(-1, lo, d_logits * (1 - w)).scatter_add_(-1, hi, d_logits * w)
            d_pos = d_logits * (z_hi - z_lo)  # 0 at the cap, where ⌊p⌋ = ⌈p⌉: no gradient past it
            d_gates = d_pos.cumsum(-1) * visible  # adjoint of the reverse cumulative sum
            d_scores = (d_logits + d_gates * g * (1 - g)) * scale  # (B, H, R, r1)
            dq[:, :, r0:r1] = d_scores @ kb + dz @ ef
            dk[:, :, :r1] += d_scores.transpose(-1, -2) @ qb
            de += torch.einsum("bhrp,bhrd->pd", dz, qb)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), de.to(emb.dtype), None, None


def _row_blocks(q: Tensor) -> list[tuple[int, int]]:
    """Query row ranges [r0, r1) whose (B, H, rows, r1) temporaries stay within the device's budget
    (:data:`TRAIN_BLOCK_ELEMENTS` on the CPU, :data:`DEVICE_TRAIN_BLOCK_ELEMENTS` elsewhere)."""
    B, H, T, _ = q.shape
    budget = TRAIN_BLOCK_ELEMENTS if q.device.type == "cpu" else DEVICE_TRAIN_BLOCK_ELEMENTS
    rows = max(1, budget // (B * H * T))
    return [(r0, min(r0 + rows, T)) for r0 in range(0, T, rows)]


def _cope_logits(
    q: Tensor, k: Tensor, emb: Tensor, cap: int, first: int, seen: KeyVisible | None = None
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Logits of queries ``first … first+R-1`` (``q`` (B, H, R, Dh)) over keys ``0 … L-1`` (``k``
    (B, H, L, Dh)), float32, hidden keys ``-inf``: (B, H, R, L), and what the backward reads: the gates,
    the interpolation weight and indices, ``z`` at both indices, the visibility: causal, and ``seen``
    (padding, documents; (B|1, 1, R, L)) where given, whose hidden keys count no gate."""
    R, L = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, R, L)
    row = torch.arange(first, first + R, device=q.device).unsqueeze(1)  # (R, 1)
    key = torch.arange(L, device=q.device)  # (L,)
    visible = key <= row  # (R, L)
    if seen is not None:
        b = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        visible = visible & seen(b, row.view(1, 1, R, 1), key.view(1, 1, 1, L))  # (B, 1, R, L)
    gates = torch.sigmoid(scores) * visible
    capped = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=cap)  # (B, H, R, L): min(Σ_{t >= j} g_it, cap)
    floor = capped.floor()
    w = capped - floor
    lo, hi = floor.long(), capped.ceil().long()
    z = q @ emb.T  # (B, H, R, max_pos): q_i·e[p]
    z_lo, z_hi = z.gather(-1, lo), z.gather(-1, hi)
    logits = (scores + z_lo * (1 - w) + z_hi * w).masked_fill(~visible, float("-inf"))
    return logits, (gates, w, lo, hi, z_lo, z_hi, visible)


def _interpolate(z: Tensor, pos: Tensor) -> Tensor:
    """``(1 - w)·z[⌊p⌋] + w·z[⌈p⌉]`` with ``w = p - ⌊p⌋``: ``z`` (..., Tq, max_pos), ``pos`` (..., Tq, Tk)
    float32 -> (..., Tq, Tk)."""
    lo = pos.floor()
    w = pos - lo
    return z.gather(-1, lo.long()) * (1 - w) + z.gather(-1, pos.ceil().long()) * w
