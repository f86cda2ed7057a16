"""The positions and masks of one forward, shared by every attention layer.

An :class:`AttentionContext` is built once per forward and attention kind (encoder self-attention,
decoder self-attention, cross-attention). Layers share it, so whatever does not depend on the
layer is computed once: rotary tables, the offset-vector bias, the float masks of query blocks.
Each such cache is its own dict, keyed by everything its value depends on:

* ``_rotary_tables``   :class:`RotaryKey` (the positions tensor, query/key side) -> tables;
* ``_offset_vectors``  bias layer -> (1, H, Tq + Tk - 1) float32 bias over all offsets;
* ``_offset_cast``     (bias layer, dtype) -> the same vector cast to the activations' dtype;
* ``_masks``           :class:`BlockKey` -> float (or bool) mask of one query block;
* ``_offset_masks``    :class:`BlockKey` -> Hankel view (or padded copy) of the offset vector;
* ``_features``        layer -> (query features (B, H, Tq, F), key features (B, H, Tk, F)) of a PE
                       whose bias reads the layer input, set by the attention layer that saw it;
* ``_block_masks``     (Tq, Tk, device, tag) -> FlexAttention ``BlockMask`` of :meth:`visible_fn`
                       (:mod:`posformer.model.backends.flex`; a ``tag`` names a region of a PE's
                       own attention: :mod:`posformer.model.backends.shortcut`).

The *bias layer* is the layer index for a bias form with ``per_layer`` and 0 otherwise. The
attention backends (:mod:`posformer.model.backends`) read the context through its public methods
:meth:`~AttentionContext.bias`, :meth:`~AttentionContext.keep` (built from the elementwise
:meth:`~AttentionContext.visible_fn`), :meth:`~AttentionContext.mask`,
:meth:`~AttentionContext.offset_mask`, :meth:`~AttentionContext.value` and
:meth:`~AttentionContext.cached_block_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from posformer.model.knobs import count_visible
from posformer.model.policy import BackendPolicy
from posformer.model.positions import is_arange
from posformer.model.schedule import Span, Temperature
from posformer.pe.forms import BiasForm, Offsets, reads

if TYPE_CHECKING:
    from posformer.model.parallel import ContextParallel
    from posformer.model.remap import PositionMap
    from posformer.pe.base import PositionalEncoding

#: default budget for one materialised mask/bias block, in bytes
DEFAULT_CHUNK_BYTES = 256 * 2**20
#: causal attention with a mask is split into query blocks of about this many rows (0: never)
CAUSAL_BLOCK_ROWS = 128
#: visibility ``(b, q_idx, k_idx) -> bool`` of batch rows, query indices (of the Tq queries) and key
#: indices, broadcast over their shapes
VisibleAt = Callable[[Tensor, Tensor, Tensor], Tensor]


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
    """One query block's mask: bias layer, query rows [start, end), keys [first, keys), mask dtype."""

    bias_layer: int
    start: int
    end: int
    keys: int
    dtype: torch.dtype
    first: int = 0


@dataclass
class AttentionContext:
    """Everything an attention call needs besides q, k, v.

    Attributes:
        pe: the PE applied to this attention kind, or ``None``.
        q_pos: query positions (B|1, Tq).
        k_pos: key positions (B|1, Tk) (for cached decoding: all cached keys plus the new ones).
        causal: causal masking by index (query ``i`` of the new block sees keys ``<= Tk - Tq + i``).
        key_padding_mask: (B, Tk) bool, True for real tokens, or ``None``.
        segment_ids: (B, Tk) int, the document of every key of packed rows (the queries are the last
            Tq keys), or ``None``: a query sees only keys of its own document (block-diagonal).
        chunk_bytes: memory budget of one materialised mask block.
        causal_block_rows: rows per query block for causal attention with a mask (0: one block).
        policy: the backend choice and switches (:class:`BackendPolicy`).
        from_zero: the caller made ``q_pos`` and ``k_pos`` itself, as ``0 … T-1`` (the model's default
            positions) or, with ``segment_ids``, restarting at 0 with every document
            (:func:`~posformer.model.positions.document_positions`): the position facts below are known
            without reading the tensors (no host sync).
        span: which keys a query sees beyond causality (:class:`~posformer.model.schedule.Span`).
        key_start: absolute index of key 0 (a rolling cache dropped that many keys); the queries are
            the last Tq of the keys.
        temperature: the position-dependent query scale of these layers.
        sinks: the layers have sink logits, (H,) or per query (B, H, Tq) (:meth:`set_sinks` before a call).
        softcap: scores ``c · tanh(s / c)`` after the bias, before the masks (explicit softmax); 0: none.
        probe: layer -> [(query start, key start, probabilities (B, H, rows, keys))] the explicit softmax
            records (every call takes it), or ``None`` (:mod:`posformer.eval.attention_probe`).
        origin: subtracted from ``q_pos`` and ``k_pos`` before the rotary tables are built (the PE's
            :meth:`~posformer.pe.base.PositionalEncoding.rotary_origin`; xPos past its range), 0: none.
        parallel: the context-parallel group whose processes share the sequence
            (:class:`~posformer.model.parallel.ContextParallel`), or ``None``; with one, the positions and
            masks are the whole sequence's, each layer's input its rank's slice, and ``pe`` its heads'
            (:meth:`ContextParallel.shard`).
        position_map: a remapping of query/key distances (:mod:`posformer.model.remap`), or ``None``;
            with one, :meth:`rotate` leaves queries and keys unrotated and the ``remapped`` backend
            rotates them per region.
    """

    pe: PositionalEncoding | None
    q_pos: Tensor
    k_pos: Tensor
    causal: bool = False
    key_padding_mask: Tensor | None = None
    segment_ids: Tensor | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    causal_block_rows: int = CAUSAL_BLOCK_ROWS
    policy: BackendPolicy = field(default_factory=BackendPolicy)
    from_zero: bool = False
    span: Span = Span()
    key_start: int = 0
    temperature: Temperature = Temperature()
    sinks: bool = False
    softcap: float = 0.0
    probe: dict[int, list[tuple[int, int, Tensor]]] | None = None
    #: keys each layer's rolling cache keeps after this forward (``None``: all)
    cache_keep: int | None = None
    origin: int = 0
    parallel: ContextParallel | None = None
    position_map: PositionMap | None = None
    # caches (see the module docstring); each is filled at most once per key
    _rotary_tables: dict[RotaryKey, tuple[Tensor, Any]] = field(default_factory=dict, init=False, repr=False)
    _offset_vectors: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)
    _offset_cast: dict[tuple[int, torch.dtype], Tensor] = field(default_factory=dict, init=False, repr=False)
    _masks: dict[BlockKey, Tensor | None] = field(default_factory=dict, init=False, repr=False)
    _offset_masks: dict[BlockKey, Tensor] = field(default_factory=dict, init=False, repr=False)
    _features: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, init=False, repr=False)
    _block_masks: dict[tuple[int, int, str, str], Any] = field(default_factory=dict, init=False, repr=False)
    _sinks: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)
    _query_scale: dict[torch.dtype, Tensor] = field(default_factory=dict, init=False, repr=False)
    _visible_counts: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False)
    # position facts, checked at most once (they read tensor values)
    _aranges: bool | None = field(default=None, init=False, repr=False)
    _starts_at_zero: bool | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.from_zero and self.segment_ids is None:
            self._aranges = self._starts_at_zero = True

    @property
    def attention_backend(self) -> str:
        """The user's backend choice (``auto`` / ``flex`` / ``sdpa``)."""
        return self.policy.choice

    # ------------------------------------------------------------------ what the PE does here
    @property
    def hooks(self) -> frozenset[str]:
        return self.pe.caps.hooks if self.pe is not None else frozenset()

    @property
    def has_bias(self) -> bool:
        return "bias" in self.hooks

    @property
    def bias_form(self) -> BiasForm | None:
        """The form of the PE's bias (:mod:`posformer.pe.forms`), or None without a bias."""
        return self.pe.caps.bias if self.has_bias else None

    @property
    def has_value(self) -> bool:
        return "value" in self.hooks

    def bias_layer(self, layer: int) -> int:
        """Cache key of layer ``layer``'s bias: the layer for per-layer biases, else 0 (shared)."""
        return layer if self.has_bias and self.bias_form.per_layer else 0

    # ------------------------------------------------------------------ positions
    @property
    def aranges(self) -> bool:
        """Whether queries and keys are each one row of consecutive integers."""
        if self._aranges is None:
            self._aranges = is_arange(self.q_pos) and is_arange(self.k_pos)
        return self._aranges

    @property
    def contiguous(self) -> bool:
        """Whether queries and keys are both at positions ``0 … T-1`` (never for packed documents)."""
        q, k = self.q_pos, self.k_pos
        if self.segment_ids is not None or q.shape != k.shape or q.shape[1] == 0 or not self.aranges:
            return False
        if self._starts_at_zero is None:
            self._starts_at_zero = int(q[0, 0]) == 0 and int(k[0, 0]) == 0
        return self._starts_at_zero

    @property
    def index_offsets(self) -> bool:
        """Whether every query and key it may see are as far apart in positions as in indices
        (``q_pos_i - k_pos_j = Tk - Tq + i - j``) with the same queries as keys: positions ``0 … T-1``,
        or packed documents at the positions the model made (restarting with each document)."""
        if self.segment_ids is not None:
            return self.from_zero and self.q_pos.shape == self.k_pos.shape
        return self.contiguous

    @property
    def uses_offset_vector(self) -> bool:
        """Whether the bias is built from one vector over offsets (an ``Offsets`` form, aranges,
        no packed documents: their positions restart, and the mask is block-diagonal; a span of
        offsets only: a sliding window folds into the vector, chunks do not)."""
        return (
            isinstance(self.bias_form, Offsets)
            and self.span.offset_only
            and self.segment_ids is None
            and self.aranges
        )

    # ------------------------------------------------------------------ temperature, sinks
    def scale_queries(self, q: Tensor, start: int = 0) -> Tensor:
        """``q`` (B, H, n, Dh), the queries ``[start, start + n)``, times the temperature of their positions
        (computed once per context and dtype)."""
        if not self.temperature.active:
            return q
        scale = self._query_scale.get(q.dtype)
        if scale is None:  # (B|1, 1, Tq, 1)
            scale = self._query_scale[q.dtype] = self.temperature.query_scale(self.q_pos).to(q.dtype)
        if start or scale.shape[2] != q.shape[2]:
            scale = scale[:, :, start : start + q.shape[2]]
        return q * scale

    def visible_counts(self, device: torch.device) -> Tensor:
        """How many keys each query sees under every mask (causal, span, documents, padding), at least 1:
        float32 (B|1, 1, Tq, 1), counted once per context in blocks of query rows (SSMax's ``n``)."""
        if str(device) not in self._visible_counts:
            keep = None if self.visible_fn() is None else self.keep
            tq, tk = self.q_pos.shape[1], self.k_pos.shape[1]
            self._visible_counts[str(device)] = count_visible(keep, tq, tk, device)
        return self._visible_counts[str(device)]

    def set_sinks(self, layer: int, logits: Tensor) -> None:
        """Layer ``layer``'s sink logits, per head (H,) or per head and query (B, H, Tq) (``sinks``), set
        before its attention call."""
        self._sinks[layer] = logits

    def sink_logits(self, layer: int) -> Tensor | None:
        """Layer ``layer``'s sink logits (H,) or (B, H, Tq), or ``None`` without sinks."""
        if not self.sinks:
            return None
        if layer not in self._sinks:
            raise RuntimeError(f"attention sinks: set_sinks(layer={layer}) was not called")
        return self._sinks[layer]

    # ------------------------------------------------------------------ rotary hook
    def rotate(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """``rotary`` hook on ``x`` (B, H, T, Dh); the tables for ``positions`` (B|1, T), measured from
        :attr:`origin`, are built once per context."""
        if "rotary" not in self.hooks or self.position_map is not None:  # remapped: per region, later
            return x
        key = RotaryKey.of(positions, is_query)
        hit = self._rotary_tables.get(key)
        if hit is None:
            shifted = positions - self.origin if self.origin else positions  # (B|1, T)
            hit = self._rotary_tables[key] = (positions, self.pe.rotary_tables(shifted, is_query=is_query))
        return self.pe.apply_rotary(x, hit[1])

    # ------------------------------------------------------------------ bias, visibility, value term
    def set_features(self, layer: int, q_feats: Tensor, k_feats: Tensor) -> None:
        """Layer ``layer``'s input features (a bias that reads ``x``): q (B, H, Tq, F), k (B, H, Tk, F)."""
        self._features[layer] = (q_feats, k_feats)

    def features(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s input features set by :meth:`set_features`: q (B, H, Tq, F), k (B, H, Tk, F)."""
        if layer not in self._features:
            raise RuntimeError(
                f"pe={self.pe.name!r} reads the layer input: set_features(layer={layer}) was not called"
            )
        return self._features[layer]

    def bias(
        self, s: int, e: int, tk: int, q: Tensor, layer: int, k: Tensor | None = None, *, k0: int = 0
    ) -> Tensor:
        """Score bias for query rows [s, e) and keys [k0, tk): (B|1, H, e-s, tk-k0) float32.

        ``q`` (B, H, e-s, Dh) are the block's queries and ``k`` (B, H, tk-k0, Dh) its keys; each is passed
        to the PE only if its bias form reads it (:func:`~posformer.pe.forms.reads`; likewise the layer
        input's features).
        """
        form = self.pe.caps.bias
        if self.segment_ids is not None and isinstance(form, Offsets) and self.index_offsets:
            # packed documents at the model's positions: a key a query sees is as far from it in
            # positions as in indices, so the bias is the offset vector's (the PE's bias over
            # restarting positions would need their range read on the host: DPB's table)
            return self._offset_rows(s, e, tk, torch.float32, layer, k0).flip(-2)  # (1, H, e-s, tk-k0)
        q_pos, k_pos = self.q_pos[:, s:e], self.k_pos[:, k0:tk]
        extra: dict[str, Tensor] = {}
        wanted = reads(form)
        if "q" in wanted:
            extra["q"] = q
        if "k" in wanted:
            if k is None:
                raise RuntimeError(f"pe={self.pe.name!r} reads the keys: the attention backend must pass k")
            extra["k"] = k[:, :, : tk - k0]
            if self.segment_ids is not None:  # packed documents: count only the keys the query sees
                extra["visible"] = self.keep(s, e, tk, q.device, k0=k0)
        if "x" in wanted:
            q_feats, k_feats = self.features(layer)
            extra["q_feats"], extra["k_feats"] = q_feats[:, :, s:e], k_feats[:, :, k0:tk]
        return self.pe.bias(q_pos, k_pos, layer=layer, **extra)

    @property
    def visibility_per_row(self) -> bool:
        """Whether visibility differs between batch rows (padding, packed documents, or chunks over
        positions that differ per row)."""
        return (
            self.key_padding_mask is not None
            or self.segment_ids is not None
            or (self.span.kind == "chunked" and self._rows() > 1)
        )

    def _rows(self) -> int:
        """Batch rows of the visibility: those of padding, documents and (chunks) positions."""
        rows = [t.shape[0] for t in (self.key_padding_mask, self.segment_ids) if t is not None]
        if self.span.kind == "chunked":
            rows += [self.q_pos.shape[0], self.k_pos.shape[0]]
        return max(rows, default=1)

    def visible_fn(self) -> VisibleAt | None:
        """Which keys each query sees, as one elementwise function, or None if every key is visible.

        ``f(b, q_idx, k_idx) -> bool``: causal by index (query ``i`` sees keys ``<= Tk - Tq + i``), real
        keys only (padding), and keys of the query's own document (packed rows). :meth:`keep` evaluates
        it on broadcast views; the FlexAttention backend turns it into a ``BlockMask`` (``mask_mod``).
        """
        offset = self.k_pos.shape[1] - self.q_pos.shape[1]
        causal, pad, seg = self.causal, self.key_padding_mask, self.segment_ids
        span, start = self.span, self.key_start
        if not (causal or pad is not None or seg is not None or not span.full):
            return None
        if span.kind == "chunked":  # chunks follow positions: (rows, Tq), (rows, Tk)
            rows = self._rows()
            q_pos, k_pos = self.q_pos.expand(rows, -1), self.k_pos.expand(rows, -1)

            def position(pos: Tensor, b: Tensor, idx: Tensor) -> Tensor:  # one row: any b (Flex's batch)
                return pos[0][idx] if rows == 1 else pos[b, idx]

        def visible(b: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
            keep = None
            if causal:
                keep = k_idx <= q_idx + offset
            if span.kind == "chunked":
                near = span.visible(position(q_pos, b, q_idx), position(k_pos, b, k_idx), causal)
                keep = near if keep is None else keep & near
            elif not span.full:  # absolute indices: the keys a rolling cache dropped count too
                near = span.visible(q_idx + (offset + start), k_idx + start, causal)
                keep = near if keep is None else keep & near
            if pad is not None:
                keep = pad[b, k_idx] if keep is None else keep & pad[b, k_idx]
            if seg is not None:  # packed documents: block-diagonal
                same = seg[b, q_idx + offset] == seg[b, k_idx]
                keep = same if keep is None else keep & same
            return keep

        return visible

    def keep(self, s: int, e: int, tk: int, device: torch.device, *, k0: int = 0) -> Tensor | None:
        """Boolean (B|1, 1, e-s, tk-k0) mask of visible keys [k0, tk) for query rows [s, e), or None if
        all keys are visible."""
        visible = self.visible_fn()
        if visible is None:
            return None
        b = torch.arange(self._rows(), device=device).view(-1, 1, 1, 1)
        q_idx = torch.arange(s, e, device=device).view(1, 1, -1, 1)
        return visible(b, q_idx, torch.arange(k0, tk, device=device).view(1, 1, 1, -1))

    def cached_block_mask(
        self, tq: int, tk: int, device: torch.device, build: Callable[[], Any], tag: str = ""
    ) -> Any:
        """The mask for ``tq`` queries over ``tk`` keys (a FlexAttention block mask of :meth:`visible_fn`;
        ``tag`` names another visibility, such as a region of a PE's own attention): ``build()`` once
        per context."""
        key = (tq, tk, str(device), tag)
        if key not in self._block_masks:
            self._block_masks[key] = build()
        return self._block_masks[key]

    def value(self, probs: Tensor, s: int, e: int, tk: int, layer: int, *, k0: int = 0) -> Tensor:
        """``value`` hook for query rows [s, e), keys [k0, tk): probs (B, H, e-s, tk-k0) -> (B, H, e-s,
        Dh)."""
        return self.pe.value(probs, self.q_pos[:, s:e], self.k_pos[:, k0:tk], layer=layer)

    # ------------------------------------------------------------------ materialised masks
    def mask(
        self,
        s: int,
        e: int,
        tk: int,
        q: Tensor,
        layer: int,
        memo: bool,
        k: Tensor | None = None,
        *,
        k0: int = 0,
    ) -> Tensor | None:
        """Mask for query rows [s, e) and keys [k0, tk), or None if every key is visible.

        With a bias: float, bias + ``-inf`` for hidden keys, in ``q``'s dtype, (B|1, H, e-s, tk-k0).
        Without: the boolean :meth:`keep` mask. ``memo`` keeps it for the other layers (never for a
        bias that reads q, k or the layer input: it differs per layer and call).
        """
        if self.has_bias and self.bias_form.per_call:
            memo = False
        key = BlockKey(self.bias_layer(layer), s, e, tk, q.dtype, k0)
        if memo and key in self._masks:
            return self._masks[key]
        if self.has_bias:
            bias = self.bias(s, e, tk, q, layer, k, k0=k0)
            keep = self.keep(s, e, tk, q.device, k0=k0)
            out = (bias if keep is None else bias.masked_fill(~keep, float("-inf"))).to(q.dtype)
        else:
            out = self.keep(s, e, tk, q.device, k0=k0)
        if memo:
            self._masks[key] = out
        return out

    # ------------------------------------------------------------------ offset-vector (Toeplitz) bias
    def offset_vector(self, layer: int, dtype: torch.dtype) -> Tensor:
        """Bias over all offsets, (1, H, Tq + Tk - 1) in ``dtype``; ``-inf`` where causal masking hides a key.

        Entry ``m`` is the bias of query ``i`` and key ``j`` with ``m = Tq - 1 - i + j``. Only for
        :attr:`uses_offset_vector`, and for packed documents at the model's positions (:meth:`bias`).
        Built once per bias layer (float32) and cast once per dtype.
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
        last_q, k0 = self.q_pos[:, -1:], self.k_pos[:, :1]  # (1, 1): query Tq-1, key 0
        if self.segment_ids is not None:  # packed documents (index_offsets): offsets by index
            k0 = torch.zeros_like(self.k_pos[:1, :1])
            last_q = k0 + (tk - 1)
        keys = k0 + torch.arange(tq + tk - 1, device=k0.device, dtype=k0.dtype)  # (1, Tq+Tk-1)
        vec = self.pe.bias(last_q, keys, layer=layer)[:, :, 0]  # (1, H, 1, Tq+Tk-1) -> (1, H, Tq+Tk-1)
        m = torch.arange(tq + tk - 1, device=vec.device)  # i + Tk - Tq - j = Tk - 1 - m
        if self.causal:  # key j visible iff j <= i + Tk - Tq  <=>  m <= Tk - 1
            vec = vec.masked_fill(m >= tk, float("-inf"))
        near = self.span.visible(tk - 1 - m, torch.zeros_like(m), self.causal)  # a sliding window
        if near is not None:
            vec = vec.masked_fill(~near, float("-inf"))
        return vec

    def _offset_rows(self, s: int, e: int, tk: int, dtype: torch.dtype, layer: int, k0: int) -> Tensor:
        """The offset vector as a (1, H, e-s, tk-k0) Hankel *view* (no copy) of query rows e-1 … s
        (*reversed*) and keys [k0, tk): row r is query e-1-r, column c key k0+c."""
        tq = self.q_pos.shape[1]
        vec = self.offset_vector(layer, dtype)[..., tq - e + k0 : tq - 1 - s + tk]  # (1, H, e-s + tk-k0 - 1)
        return vec.unfold(-1, tk - k0, 1)

    def offset_mask(
        self, s: int, e: int, tk: int, dtype: torch.dtype, layer: int, memo: bool, *, k0: int = 0
    ) -> Tensor:
        """Float mask for query rows e-1 .. s (*reversed*) and keys [k0, tk): (1|B, H, e-s, tk-k0).

        Without padding, a Hankel *view* of :meth:`offset_vector` (strides (1, 1) over rows and keys,
        no copy): SDPA's CPU and CUDA kernels read strided masks, and the vector stays in cache. With
        padding, a row-major copy with the padded keys set to ``-inf``. ``memo`` keeps it for the
        other layers.
        """
        key = BlockKey(self.bias_layer(layer), s, e, tk, dtype, k0)
        if memo and key in self._offset_masks:
            return self._offset_masks[key]
        n = tk - k0
        out = self._offset_rows(s, e, tk, dtype, layer, k0)  # (1, H, e-s, n), rows reversed
        if self.key_padding_mask is not None:
            pad = self.key_padding_mask[:, k0:tk].view(-1, 1, 1, n)  # (B, 1, 1, n)
            # materialise row-major (masked_fill of the view could pick any layout)
            out = torch.empty(pad.shape[0], *out.shape[1:], dtype=out.dtype, device=out.device).copy_(out)
            out = out.masked_fill(~pad, float("-inf"))
        if memo:
            self._offset_masks[key] = out
        return out
