"""Multi-head attention that calls the positional-encoding hooks.

The attention layer knows nothing about individual PEs. It asks the PE (if any is applied to this
attention kind) for its hooks: ``rotary`` rotates q and the *new* k before they are cached,
``bias`` gives an additive score bias that is folded together with the causal and padding masks
into one float mask for :func:`torch.nn.functional.scaled_dot_product_attention`, ``value`` adds a
term from the attention probabilities (explicit softmax path).

Speed (see ``docs/performance.md``):

* no bias: SDPA with ``is_causal`` (no mask at all);
* a bias that depends on the offset ``i - j`` only (PEs with ``caps.bias_offset_only``: ALiBi,
  T5, KERPLE) and contiguous integer positions: the PE is asked for one bias *vector* over the
  ``Tq + Tk - 1`` distinct offsets (one query against ``Tq + Tk - 1`` keys), the causal mask is
  folded into it as ``-inf``, and each query block's mask is a Toeplitz expansion of a slice of it
  (``unfold``): no (Tq, Tk) tensors at all. The expansion is a Hankel *view* (no copy) for the
  block's queries in *reverse* order, so the block's queries are flipped before SDPA and its output
  flipped back (cheap: (B, H, rows, Dh)). The vector and, when
  it fits the budget, the expanded masks are built once per forward and shared by all layers;
* causal attention with a mask runs in query blocks (``causal_block_rows``), each over the keys it
  can see, so the masked half of the score matrix is skipped;
* a bias that needs a gradient (learned T5/KERPLE/FIRE parameters, Shaw's query term) goes
  through :class:`BiasedAttention`: the fused SDPA forward and an explicit backward that also
  returns the bias gradient (SDPA itself falls back to its slow math path for such masks);
* long sequences are processed in query chunks whenever the (B, H, Tq, Tk) mask would exceed
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
#: causal attention with a mask is split into query blocks of about this many rows (0: never)
CAUSAL_BLOCK_ROWS = 128


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
        causal_block_rows: rows per query block for causal attention with a mask (0: one block).
    """

    pe: PositionalEncoding | None
    q_pos: Tensor
    k_pos: Tensor
    causal: bool = False
    key_padding_mask: Tensor | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    causal_block_rows: int = CAUSAL_BLOCK_ROWS
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def hooks(self) -> frozenset[str]:
        return self.pe.caps.hooks if self.pe is not None else frozenset()

    def rotate(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """``rotary`` hook on ``x`` (B, H, T, Dh); the tables for ``positions`` are built once per context."""
        if "rotary" not in self.hooks:
            return x
        # Keyed by the positions' memory and layout. The memo keeps the positions tensor alive, so its
        # memory cannot be reused by other positions while the key exists: equal keys mean equal positions.
        key = ("rot", positions.data_ptr(), tuple(positions.shape), positions.stride(), is_query)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = (positions, self.pe.rotary_tables(positions, is_query=is_query))
        return self.pe.apply_rotary(x, hit[1])

    @property
    def aranges(self) -> bool:
        """Whether queries and keys are each one row of consecutive integers (checked once per context)."""
        if "aranges" not in self._memo:
            self._memo["aranges"] = _is_arange(self.q_pos) and _is_arange(self.k_pos)
        return self._memo["aranges"]

    @property
    def contiguous(self) -> bool:
        """Whether queries and keys are both at positions ``0 … T-1``."""
        q, k = self.q_pos, self.k_pos
        if q.shape != k.shape or q.shape[1] == 0 or not self.aranges:
            return False
        if "starts_at_zero" not in self._memo:
            self._memo["starts_at_zero"] = int(q[0, 0]) == 0 and int(k[0, 0]) == 0
        return self._memo["starts_at_zero"]

    # ------------------------------------------------------------------ offset (Toeplitz) bias
    @property
    def toeplitz(self) -> bool:
        """Whether the bias can be built from one vector over offsets (checked once per context)."""
        if "toeplitz" not in self._memo:
            pe = self.pe
            ok = (
                pe is not None
                and "bias" in pe.caps.hooks
                and pe.caps.bias_offset_only
                and self.aranges
            )
            self._memo["toeplitz"] = ok
        return self._memo["toeplitz"]

    def _offset_vector(self, layer: int) -> Tensor:
        """Bias over all offsets, (1, H, Tq + Tk - 1), ``-inf`` where causal masking hides the key.

        Entry ``m`` is the bias of query ``i`` and key ``j`` with ``m = Tq - 1 - i + j``.
        """
        pe = self.pe
        key = ("vec", layer if pe.caps.bias_per_layer else 0)
        if key not in self._memo:
            tq, tk = self.q_pos.shape[1], self.k_pos.shape[1]
            last_q = self.q_pos[:, -1:]  # (1, 1): query Tq-1
            k0 = self.k_pos[:, :1]
            keys = k0 + torch.arange(tq + tk - 1, device=k0.device, dtype=k0.dtype)  # (1, Tq+Tk-1)
            vec = pe.bias(last_q, keys, layer=layer)[:, :, 0]  # (1, H, Tq+Tk-1)
            if self.causal:  # key j visible iff j <= i + Tk - Tq  <=>  m <= Tk - 1
                vec = vec.masked_fill(torch.arange(tq + tk - 1, device=vec.device) >= tk, float("-inf"))
            self._memo[key] = vec
        return self._memo[key]

    def _toeplitz_bias(self, s: int, e: int, tk: int, layer: int, dtype: torch.dtype) -> Tensor:
        """(1, H, e-s, tk) bias for query rows e-1 .. s (reversed) and keys [0, tk), causal folded in.

        A Hankel *view* of the offset vector (strides (1, 1) over rows and keys, no copy): SDPA's CPU
        and CUDA kernels read strided masks, and the vector stays in cache.
        """
        tq = self.q_pos.shape[1]
        key = ("vec", layer if self.pe.caps.bias_per_layer else 0, dtype)
        if key not in self._memo:
            self._memo[key] = self._offset_vector(layer).to(dtype)
        vec = self._memo[key][..., tq - e : tq - 1 - s + tk]  # (1, H, e-s+tk-1)
        return vec.unfold(-1, tk, 1)

    # ------------------------------------------------------------------ masks
    def mask(self, s: int, e: int, tk: int, q: Tensor, layer: int, memo: bool) -> Tensor | None:
        """Float (or bool) mask for query rows [s, e) and keys [0, tk), or None if everything is visible.

        Float masks hold bias + ``-inf`` for hidden keys, in ``q``'s dtype: (B|1, H|1, e-s, tk). With
        :attr:`rows_reversed` the rows are the queries in reverse order (e-1 .. s).
        """
        pe = self.pe
        has_bias = "bias" in self.hooks
        if has_bias and pe.caps.bias_reads_queries:
            memo = False  # per layer and per call
        key = ("mask", layer if has_bias and pe.caps.bias_per_layer else 0, s, e, tk, q.dtype)
        if memo and key in self._memo:
            return self._memo[key]
        pad = self.key_padding_mask[:, :tk].view(-1, 1, 1, tk) if self.key_padding_mask is not None else None
        if has_bias and self.toeplitz:
            out = self._toeplitz_bias(s, e, tk, layer, q.dtype)
            if pad is not None:  # materialise row-major (masked_fill of the view could pick any layout)
                out = torch.empty(pad.shape[0], *out.shape[1:], dtype=out.dtype, device=out.device).copy_(out)
                out = out.masked_fill(~pad, float("-inf"))
            if memo:
                self._memo[key] = out
            return out
        else:
            bias = self._bias(s, e, tk, q, layer) if has_bias else None
            keep = self._keep(s, e, tk, q.device)
        if bias is None:
            out = keep
        else:
            out = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
            out = out.to(q.dtype)
        if memo:
            self._memo[key] = out
        return out

    @property
    def rows_reversed(self) -> bool:
        """Whether :meth:`mask` gives the rows in reverse query order (the offset-vector path)."""
        return "bias" in self.hooks and self.toeplitz

    def _bias(self, s: int, e: int, tk: int, q: Tensor, layer: int) -> Tensor:
        """Score bias for query rows [s, e) and keys [0, tk): (B|1, H, e-s, tk) float32."""
        q_pos, k_pos = self.q_pos[:, s:e], self.k_pos[:, :tk]
        if self.pe.caps.bias_reads_queries:
            return self.pe.bias(q_pos, k_pos, q=q, layer=layer)
        return self.pe.bias(q_pos, k_pos, layer=layer)

    def _keep(self, s: int, e: int, tk: int, device: torch.device) -> Tensor | None:
        """Boolean (B|1, 1, e-s, tk) mask of visible keys for query rows [s, e), or None if all visible."""
        keep = None
        if self.causal:
            offset = self.k_pos.shape[1] - self.q_pos.shape[1]
            qi = torch.arange(s, e, device=device).unsqueeze(-1) + offset
            keep = (torch.arange(tk, device=device) <= qi).view(1, 1, e - s, tk)
        if self.key_padding_mask is not None:
            pad = self.key_padding_mask[:, :tk].view(-1, 1, 1, tk)
            keep = pad if keep is None else keep & pad
        return keep


def _is_arange(pos: Tensor) -> bool:
    """Whether ``pos`` (B|1, T) is one row of consecutive integers."""
    if pos.shape[0] != 1 or pos.is_floating_point():
        return False
    t = pos.shape[1]
    if t <= 1:
        return True
    row = pos[0]
    return bool(
        int(row[-1]) - int(row[0]) == t - 1
        and torch.equal(row, torch.arange(int(row[0]), int(row[0]) + t, device=row.device, dtype=row.dtype))
    )


class BiasedAttention(torch.autograd.Function):
    """SDPA with a float mask that needs a gradient.

    Forward: the fused SDPA kernel with the mask detached. Backward: explicit, recomputing the
    probabilities ``P`` (B, H, Tq, Tk) once: ``dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O))``, ``dQ = dS·K/√d``,
    ``dK = dSᵀ·Q/√d``, ``dV = Pᵀ·dO`` and ``dMask = dS`` summed over broadcast dimensions. SDPA itself
    would take its unfused math path (several times slower) for such a mask.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:  # noqa: D102
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ctx.save_for_backward(q, k, v, mask, out)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:  # noqa: D102
        q, k, v, mask, out = ctx.saved_tensors
        dtype = q.dtype
        if dtype != torch.float32:  # half precision: softmax and its gradient in fp32
            q, k, v, out, d_out = (t.float() for t in (q, k, v, out, d_out))
        scale = q.shape[-1] ** -0.5
        p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask.float()).softmax(-1)  # (B, H, Tq, Tk)
        p = torch.nan_to_num_(p, nan=0.0)  # rows with every key hidden: no attention, no gradient
        ds = torch.matmul(d_out, v.transpose(-1, -2)).sub_((d_out * out).sum(-1, keepdim=True)).mul_(p)
        nq, nk, nv, nm = ctx.needs_input_grad
        dq = torch.matmul(ds, k).mul_(scale).to(dtype) if nq else None
        dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale).to(dtype) if nk else None
        dv = torch.matmul(p.transpose(-1, -2), d_out).to(dtype) if nv else None
        dm = ds.sum_to_size(mask.shape).to(mask.dtype) if nm else None
        return dq, dk, dv, dm


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    if (
        mask is not None
        and mask.dtype != torch.bool
        and mask.requires_grad
        and torch.is_grad_enabled()
        and not dropout_p
    ):
        return BiasedAttention.apply(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def attend(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, *, layer: int = 0, dropout_p: float = 0.0
) -> Tensor:
    """Attention of ``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh)."""
    B, H, Tq, Dh = q.shape
    Tk = k.shape[2]
    hooks = ctx.hooks
    has_bias, has_value = "bias" in hooks, "value" in hooks

    # A PE's own exact fused attention (e.g. Shaw's value term): no gradients, contiguous positions.
    if (
        ctx.pe is not None
        and ctx.pe.caps.attention_shortcut
        and not dropout_p
        and ctx.key_padding_mask is None
        and Tq == Tk
        and not torch.is_grad_enabled()
        and ctx.contiguous
    ):
        out = ctx.pe.attention(q, k, v, causal=ctx.causal, layer=layer)
        if out is not None:
            return out

    # Fast paths: no mask to materialise.
    if not has_bias and not has_value and ctx.key_padding_mask is None:
        if not ctx.causal or Tq == 1:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        if Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    per_row_batch = ctx.key_padding_mask is not None or (has_bias and ctx.pe.caps.bias_reads_queries)
    mask_batch = B if per_row_batch else 1
    bytes_per_row = mask_batch * (H if (has_bias or has_value) else 1) * Tk * 4
    if has_bias and not has_value and ctx.key_padding_mask is None and ctx.toeplitz:
        bytes_per_row = 0  # the mask is a view of the offset vector: nothing materialised
    rows = max(16, ctx.chunk_bytes // max(bytes_per_row, 1))
    if ctx.causal and ctx.causal_block_rows and Tq > 1:  # skip the hidden upper triangle block-wise
        rows = min(rows, max(ctx.causal_block_rows, -(-Tq // 8)))  # at most ~8 blocks
    n_chunks = -(-Tq // rows)
    # keep every block's mask for the other layers when all of them fit the budget
    memo = n_chunks == 1 or bytes_per_row * Tq <= ctx.chunk_bytes
    offset = Tk - Tq
    outs = []
    for c in range(n_chunks):
        s, e = c * rows, min(Tq, (c + 1) * rows)
        qc = q[:, :, s:e]
        tk = min(Tk, e + offset) if ctx.causal else Tk  # keys past the block's last query are never visible
        kc, vc = k[:, :, :tk], v[:, :, :tk]
        if has_value:
            bias = ctx._bias(s, e, tk, qc, layer) if has_bias else None
            keep = ctx._keep(s, e, tk, q.device)
            outs.append(_explicit_attention(qc, kc, vc, bias, keep, ctx, s, e, tk, layer, dropout_p))
            continue
        mask = ctx.mask(s, e, tk, qc, layer, memo)
        if ctx.rows_reversed:
            outs.append(_sdpa(qc.flip(2), kc, vc, mask, dropout_p).flip(2))
        else:
            outs.append(_sdpa(qc, kc, vc, mask, dropout_p))
    return outs[0] if n_chunks == 1 else torch.cat(outs, dim=2)


def _explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    keep: Tensor | None,
    ctx: AttentionContext,
    s: int,
    e: int,
    tk: int,
    layer: int,
    dropout_p: float,
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
    """Key/value cache of one attention layer: ``k``, ``v`` are (B, H, T, Dh).

    Self-attention keys/values are appended in place into buffers with spare capacity along T
    (doubled when full), so one decoding step copies only its new keys, not the whole cache.
    ``k``/``v`` are views of the first T slots.
    """

    k: Tensor | None = None
    v: Tensor | None = None
    _buf: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    def _in_buffer(self) -> bool:
        b = self._buf
        return b is not None and self.k is not None and self.k.data_ptr() == b[0].data_ptr() and (
            self.k.shape[:2] == b[0].shape[:2] and self.v.data_ptr() == b[1].data_ptr()
        )

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``, ``v`` (B, H, T, Dh); returns all cached keys/values (B, H, T_past + T, Dh)."""
        if self.k is None:
            self.k, self.v, self._buf = k, v, None
            return k, v
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self.k.requires_grad):
            self.k = torch.cat((self.k, k), dim=2)  # differentiable path: no in-place writes
            self.v = torch.cat((self.v, v), dim=2)
            self._buf = None
            return self.k, self.v
        n, t = self.k.shape[2], k.shape[2]
        fits = self._in_buffer() and self._buf[0].shape[2] >= n + t and self._buf[0].dtype == k.dtype
        if not fits:
            cap = max(2 * (n + t), 64)
            bk = self.k.new_empty(*self.k.shape[:2], cap, self.k.shape[3])  # (B, H, cap, Dh)
            bv = self.v.new_empty(*self.v.shape[:2], cap, self.v.shape[3])
            bk[:, :, :n], bv[:, :, :n] = self.k, self.v
            self._buf = (bk, bv)
        bk, bv = self._buf
        bk[:, :, n : n + t], bv[:, :, n : n + t] = k, v
        self.k, self.v = bk[:, :, : n + t], bv[:, :, : n + t]  # views (B, H, n + t, Dh)
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Keep/reorder batch rows ``index`` (B',) (beam search), keeping the spare capacity."""
        if self.k is None or self.k.shape[0] == 1:
            return
        if self._in_buffer():
            n = self.k.shape[2]
            self._buf = tuple(b.index_select(0, index) for b in self._buf)
            self.k, self.v = self._buf[0][:, :, :n], self._buf[1][:, :, :n]
        else:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self) or Q + fused KV (cross).

    Args:
        d_model: model width D.
        n_heads: heads H (head width Dh = D / H).
        dropout: dropout on the attention probabilities.
        cross: cross-attention (queries from x, keys/values from ``memory``).
    """

    def __init__(
        self, d_model: int, n_heads: int, dropout: float = 0.0, cross: bool = False, bias: bool = True
    ):
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
                k, v = cache.append(k, v)  # (B, H, T_past + T, Dh)
        q = ctx.rotate(q, ctx.q_pos, is_query=True)
        out = attend(q, k, v, ctx, layer=layer, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, H, T, Dh) -> (B, T, D)
