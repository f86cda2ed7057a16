"""The positions and masks of one forward, shared by every attention layer.

An :class:`AttentionContext` is built once per forward and attention kind (encoder self-attention,
decoder self-attention, cross-attention). Layers share it, so whatever does not depend on the
layer is computed once: rotary tables, the offset-vector bias, the float masks of query blocks.
Each such cache is its own dict, keyed by everything its value depends on:

* ``_rotary_tables``   :class:`RotaryKey` (the positions tensor, query/key side) -> tables;
* ``_offset_vectors``  bias layer -> (1, H, Tq + Tk - 1) float32 bias over all offsets;
* ``_offset_cast``     (bias layer, dtype) -> the same vector cast to the activations' dtype;
* ``_masks``           :class:`BlockKey` -> float (or bool) mask of one query block;
* ``_offset_masks``    :class:`BlockKey` -> Hankel view (or padded copy) of the offset vector.

The *bias layer* is the layer index for PEs with ``caps.bias_per_layer`` and 0 otherwise. The
attention backends (:mod:`posformer.model.backends`) read the context through its public methods
:meth:`~AttentionContext.bias`, :meth:`~AttentionContext.keep`, :meth:`~AttentionContext.mask`,
:meth:`~AttentionContext.offset_mask` and :meth:`~AttentionContext.value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from posformer.model.positions import is_arange

if TYPE_CHECKING:
    from posformer.pe.base import PositionalEncoding

#: default budget for one materialised mask/bias block, in bytes
DEFAULT_CHUNK_BYTES = 256 * 2**20
#: causal attention with a mask is split into query blocks of about this many rows (0: never)
CAUSAL_BLOCK_ROWS = 128


@dataclass(frozen=True)
class RotaryKey:
    """Identity of a positions tensor (its memory and layout) and the side it rotates.

    The cache keeps the positions tensor alive next to its tables, so its memory cannot be reused
    by other positions while the key exists: equal keys mean equal positions.
    """

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    is_query: bool

    @classmethod
    def of(cls, positions: Tensor, is_query: bool) -> RotaryKey:
        return cls(positions.data_ptr(), tuple(positions.shape), positions.stride(), is_query)


@dataclass(frozen=True)
class BlockKey:
    """One query block's mask: bias layer, query rows [start, end), keys [0, keys), mask dtype."""

    bias_layer: int
    start: int
    end: int
    keys: int
    dtype: torch.dtype


@dataclass
class AttentionContext:
    """Everything an attention call needs besides q, k, v.

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
    # caches (see the module docstring); each is filled at most once per key
    _rotary_tables: dict[RotaryKey, tuple[Tensor, Any]] = field(default_factory=dict, init=False, repr=False)
    _offset_vectors: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)
    _offset_cast: dict[tuple[int, torch.dtype], Tensor] = field(default_factory=dict, init=False, repr=False)
    _masks: dict[BlockKey, Tensor | None] = field(default_factory=dict, init=False, repr=False)
    _offset_masks: dict[BlockKey, Tensor] = field(default_factory=dict, init=False, repr=False)
    # position facts, checked at most once (they read tensor values)
    _aranges: bool | None = field(default=None, init=False, repr=False)
    _starts_at_zero: bool | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------ what the PE does here
    @property
    def hooks(self) -> frozenset[str]:
        return self.pe.caps.hooks if self.pe is not None else frozenset()

    @property
    def has_bias(self) -> bool:
        return "bias" in self.hooks

    @property
    def has_value(self) -> bool:
        return "value" in self.hooks

    def bias_layer(self, layer: int) -> int:
        """Cache key of layer ``layer``'s bias: the layer for per-layer biases, else 0 (shared)."""
        return layer if self.has_bias and self.pe.caps.bias_per_layer else 0

    # ------------------------------------------------------------------ positions
    @property
    def aranges(self) -> bool:
        """Whether queries and keys are each one row of consecutive integers."""
        if self._aranges is None:
            self._aranges = is_arange(self.q_pos) and is_arange(self.k_pos)
        return self._aranges

    @property
    def contiguous(self) -> bool:
        """Whether queries and keys are both at positions ``0 … T-1``."""
        q, k = self.q_pos, self.k_pos
        if q.shape != k.shape or q.shape[1] == 0 or not self.aranges:
            return False
        if self._starts_at_zero is None:
            self._starts_at_zero = int(q[0, 0]) == 0 and int(k[0, 0]) == 0
        return self._starts_at_zero

    @property
    def uses_offset_vector(self) -> bool:
        """Whether the bias is built from one vector over offsets (``caps.bias_offset_only``, aranges)."""
        return self.has_bias and self.pe.caps.bias_offset_only and self.aranges

    # ------------------------------------------------------------------ rotary hook
    def rotate(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """``rotary`` hook on ``x`` (B, H, T, Dh); the tables for ``positions`` are built once per context."""
        if "rotary" not in self.hooks:
            return x
        key = RotaryKey.of(positions, is_query)
        hit = self._rotary_tables.get(key)
        if hit is None:
            hit = self._rotary_tables[key] = (positions, self.pe.rotary_tables(positions, is_query=is_query))
        return self.pe.apply_rotary(x, hit[1])

    # ------------------------------------------------------------------ bias, visibility, value term
    def bias(self, s: int, e: int, tk: int, q: Tensor, layer: int) -> Tensor:
        """Score bias for query rows [s, e) and keys [0, tk): (B|1, H, e-s, tk) float32.

        ``q`` (B, H, e-s, Dh) are the block's queries (read by PEs with ``caps.bias_reads_queries``).
        """
        q_pos, k_pos = self.q_pos[:, s:e], self.k_pos[:, :tk]
        if self.pe.caps.bias_reads_queries:
            return self.pe.bias(q_pos, k_pos, q=q, layer=layer)
        return self.pe.bias(q_pos, k_pos, layer=layer)

    def keep(self, s: int, e: int, tk: int, device: torch.device) -> Tensor | None:
        """Boolean (B|1, 1, e-s, tk) mask of visible keys for query rows [s, e), or None if all visible."""
        keep = None
        if self.causal:
            offset = self.k_pos.shape[1] - self.q_pos.shape[1]
            qi = torch.arange(s, e, device=device).unsqueeze(-1) + offset  # (e-s, 1)
            keep = (torch.arange(tk, device=device) <= qi).view(1, 1, e - s, tk)
        if self.key_padding_mask is not None:
            pad = self.key_padding_mask[:, :tk].view(-1, 1, 1, tk)  # (B, 1, 1, tk)
            keep = pad if keep is None else keep & pad
        return keep

    def value(self, probs: Tensor, s: int, e: int, tk: int, layer: int) -> Tensor:
        """``value`` hook for query rows [s, e), keys [0, tk): probs (B, H, e-s, tk) -> (B, H, e-s, Dh)."""
        return self.pe.value(probs, self.q_pos[:, s:e], self.k_pos[:, :tk], layer=layer)

    # ------------------------------------------------------------------ materialised masks
    def mask(self, s: int, e: int, tk: int, q: Tensor, layer: int, memo: bool) -> Tensor | None:
        """Mask for query rows [s, e) and keys [0, tk), or None if every key is visible.

        With a bias: float, bias + ``-inf`` for hidden keys, in ``q``'s dtype, (B|1, H, e-s, tk).
        Without: the boolean :meth:`keep` mask. ``memo`` keeps it for the other layers (never for a
        bias that reads the queries: it differs per layer and call).
        """
        if self.has_bias and self.pe.caps.bias_reads_queries:
            memo = False
        key = BlockKey(self.bias_layer(layer), s, e, tk, q.dtype)
        if memo and key in self._masks:
            return self._masks[key]
        if self.has_bias:
            bias = self.bias(s, e, tk, q, layer)
            keep = self.keep(s, e, tk, q.device)
            out = (bias if keep is None else bias.masked_fill(~keep, float("-inf"))).to(q.dtype)
        else:
            out = self.keep(s, e, tk, q.device)
        if memo:
            self._masks[key] = out
        return out

    # ------------------------------------------------------------------ offset-vector (Toeplitz) bias
    def offset_vector(self, layer: int, dtype: torch.dtype) -> Tensor:
        """Bias over all offsets, (1, H, Tq + Tk - 1) in ``dtype``; ``-inf`` where causal masking hides a key.

        Entry ``m`` is the bias of query ``i`` and key ``j`` with ``m = Tq - 1 - i + j``. Only for
        :attr:`uses_offset_vector`. Built once per bias layer (float32) and cast once per dtype.
        """
        bias_layer = self.bias_layer(layer)
        cast = self._offset_cast.get((bias_layer, dtype))
        if cast is None:
            vec = self._offset_vectors.get(bias_layer)
            if vec is None:
                vec = self._offset_vectors[bias_layer] = self._build_offset_vector(layer)
            cast = self._offset_cast[(bias_layer, dtype)] = vec.to(dtype)
        return cast

    def _build_offset_vector(self, layer: int) -> Tensor:
        """The float32 (1, H, Tq + Tk - 1) vector of :meth:`offset_vector`: one query against all offsets."""
        tq, tk = self.q_pos.shape[1], self.k_pos.shape[1]
        last_q = self.q_pos[:, -1:]  # (1, 1): query Tq-1
        k0 = self.k_pos[:, :1]
        keys = k0 + torch.arange(tq + tk - 1, device=k0.device, dtype=k0.dtype)  # (1, Tq+Tk-1)
        vec = self.pe.bias(last_q, keys, layer=layer)[:, :, 0]  # (1, H, 1, Tq+Tk-1) -> (1, H, Tq+Tk-1)
        if self.causal:  # key j visible iff j <= i + Tk - Tq  <=>  m <= Tk - 1
            vec = vec.masked_fill(torch.arange(tq + tk - 1, device=vec.device) >= tk, float("-inf"))
        return vec

    def offset_mask(self, s: int, e: int, tk: int, dtype: torch.dtype, layer: int, memo: bool) -> Tensor:
        """Float mask for query rows e-1 .. s (*reversed*) and keys [0, tk): (1|B, H, e-s, tk).

        Without padding, a Hankel *view* of :meth:`offset_vector` (strides (1, 1) over rows and keys,
        no copy): SDPA's CPU and CUDA kernels read strided masks, and the vector stays in cache. With
        padding, a row-major copy with the padded keys set to ``-inf``. ``memo`` keeps it for the
        other layers.
        """
        key = BlockKey(self.bias_layer(layer), s, e, tk, dtype)
        if memo and key in self._offset_masks:
            return self._offset_masks[key]
        tq = self.q_pos.shape[1]
        vec = self.offset_vector(layer, dtype)[..., tq - e : tq - 1 - s + tk]  # (1, H, e-s+tk-1)
        out = vec.unfold(-1, tk, 1)  # (1, H, e-s, tk) view: row r is query e-1-r
        if self.key_padding_mask is not None:
            pad = self.key_padding_mask[:, :tk].view(-1, 1, 1, tk)  # (B, 1, 1, tk)
            # materialise row-major (masked_fill of the view could pick any layout)
            out = torch.empty(pad.shape[0], *out.shape[1:], dtype=out.dtype, device=out.device).copy_(out)
            out = out.masked_fill(~pad, float("-inf"))
        if memo:
            self._offset_masks[key] = out
        return out
