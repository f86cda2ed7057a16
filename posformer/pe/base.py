"""The positional-encoding interface.

A positional encoding (PE) is an ``nn.Module`` that declares which *hooks* it implements; model
code calls the hooks and never looks at a PE's name:

``embed``   adds position information to the token embeddings, ``x + PE(pos)``
            (sinusoidal, learned).
``rotary``  rotates queries and keys per head before the dot product (RoPE, xPos).
``bias``    an additive attention-score bias ``b[h, i, j]`` built from the query and key
            positions (ALiBi, T5, FIRE, KERPLE; Shaw's key relations, which also read ``q``).
``value``   adds a term to the attention output computed from the attention probabilities
            (Shaw's value relations). It needs the probabilities, so attention with this hook
            runs the explicit softmax path instead of fused SDPA.

Positions always travel as an explicit tensor of shape ``(B, T)`` or ``(1, T)`` (broadcast over
the batch). Integer dtypes are ordinary positions (offsets for cached decoding, sparse sorted
positions for randomized training); floating dtypes are fractional positions (interpolation).
Tables are computed in float64 from those positions and stored in float32; they are cast to the
activation dtype only when applied, so a bf16/fp16 run sees the same positions as fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError, PositionRangeError

HOOKS = ("embed", "rotary", "bias", "value")
#: the hooks that act inside attention (a PE with none of them needs no attention context)
ATTENTION_HOOKS = frozenset({"rotary", "bias", "value"})
#: an elementwise bias ``(h, q_pos, k_pos) -> float32``, broadcast over the shapes of its arguments
#: (:meth:`PositionalEncoding.bias_fn`)
BiasAt = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Capabilities:
    """What a positional encoding can do: declared once per class, asked by attention and evaluation.

    Model, attention and evaluation code never test a PE's name or class; they read this record
    (``pe.caps`` for an instance, ``cls.capabilities`` for a class). :func:`posformer.pe.register`
    checks it when the class is registered.

    Attributes:
        hooks: the hooks the PE implements, a subset of :data:`HOOKS`.
        bias_offset_only: the bias of query ``i`` and key ``j`` depends on ``i - j`` only (ALiBi, T5,
            KERPLE): attention may build it from one vector over offsets.
        bias_reads_queries: the bias reads the queries ``q`` (Shaw): built per layer and per call.
        bias_reads_keys: the bias reads the keys ``k`` (CoPE's gates ``σ(q·k)``): attention passes the
            block's keys, and the bias is built per layer and per call. With packed documents it also
            passes ``visible`` (B|1, 1, Tq, Tk) bool, the keys each query sees, so the bias must take it.
        bias_reads_input: the bias reads per-token features of the layer input (forget gates): the
            class implements :meth:`PositionalEncoding.input_features`; attention calls it on the
            layer input, keeps the features of past tokens in the KV cache next to ``k``/``v``, and
            passes ``q_feats``/``k_feats`` to :meth:`PositionalEncoding.bias`.
        content_positions: the PE derives positions from the content (gates), not from the positions
            tensor: shifted or randomized positions do not change its output.
        bias_per_layer: the bias differs between layers (built once per layer, not once per forward).
        causal_only: only defined for causal attention (xPos).
        integer_positions: positions must be integers (table lookups).
        length_limited: the PE represents finitely many positions (``max_positions`` is an int).
        rotary_scalable: the rotary frequencies can be rescaled at evaluation time (:meth:`set_scaling`).
        rotary_depends_on_length: the rotation of a position depends on the total sequence length
            (scalings whose frequencies follow the length, e.g. dynamic NTK): the KV cache is recomputed
            whenever :meth:`PositionalEncoding.rotary_key` of the grown length differs from its own.
        attention_shortcut: the class implements :meth:`PositionalEncoding.attention`.
        elementwise_bias: the bias is an elementwise function of (head, query position, key position),
            stated once in :meth:`PositionalEncoding.bias_fn`: :meth:`PositionalEncoding.bias` is built
            from it (broadcast views), and so is the ``score_mod`` of the FlexAttention backend.
    """

    hooks: frozenset[str] = frozenset()
    bias_offset_only: bool = False
    bias_reads_queries: bool = False
    bias_reads_keys: bool = False
    bias_reads_input: bool = False
    bias_per_layer: bool = False
    causal_only: bool = False
    integer_positions: bool = False
    length_limited: bool = False
    rotary_scalable: bool = False
    rotary_depends_on_length: bool = False
    attention_shortcut: bool = False
    content_positions: bool = False
    elementwise_bias: bool = False

    @property
    def bias_per_call(self) -> bool:
        """Whether the bias reads tensors of the call (q, k or the layer input): never shared or kept."""
        return self.bias_reads_queries or self.bias_reads_keys or self.bias_reads_input

    @property
    def in_attention(self) -> bool:
        """Whether the PE acts inside attention (rotary, bias or value hook)."""
        return bool(self.hooks & ATTENTION_HOOKS)

    def narrows(self, declared: Capabilities) -> bool:
        """Whether every hook and flag of ``self`` is also in ``declared`` (an instance may only narrow)."""
        flags_ok = all(
            getattr(declared, f.name) or not getattr(self, f.name) for f in fields(self) if f.name != "hooks"
        )
        return self.hooks <= declared.hooks and flags_ok

    def problems(self) -> list[str]:
        """Inconsistencies of the record itself (checked at registration)."""
        out = []
        unknown = sorted(set(self.hooks) - set(HOOKS))
        if unknown:
            out.append(f"unknown hooks {unknown} (valid: {', '.join(HOOKS)})")
        bias_flags = [
            n
            for n in ("bias_offset_only", "bias_reads_queries", "bias_reads_keys", "bias_reads_input")
            + ("bias_per_layer",)
            if getattr(self, n)
        ]
        if bias_flags and "bias" not in self.hooks:
            out.append(f"{', '.join(bias_flags)} declared without the 'bias' hook")
        for reads in ("bias_reads_queries", "bias_reads_keys", "bias_reads_input"):
            if self.bias_offset_only and getattr(self, reads):
                out.append(f"bias_offset_only and {reads} exclude each other")
            if self.elementwise_bias and getattr(self, reads):
                out.append(f"elementwise_bias and {reads} exclude each other (the bias reads tensors)")
        if self.elementwise_bias and "bias" not in self.hooks:
            out.append("elementwise_bias declared without the 'bias' hook")
        if self.rotary_scalable and "rotary" not in self.hooks:
            out.append("rotary_scalable declared without the 'rotary' hook")
        if self.rotary_depends_on_length and "rotary" not in self.hooks:
            out.append("rotary_depends_on_length declared without the 'rotary' hook")
        return out


class PositionalEncoding(nn.Module):
    """Base class of every positional encoding.

    Args:
        d_model: model width ``D``.
        n_heads: number of attention heads ``H``.
        causal: whether the attention this PE serves is causal (decoder self-attention).
        n_layers: number of layers the PE serves (for PEs with per-layer parameters).
    """

    #: registry name, set by :func:`posformer.pe.register`
    name: ClassVar[str] = ""
    #: what the class can do (the upper bound of every instance's :attr:`caps`)
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: one-line summary for tables: paper and whether it extrapolates
    paper: ClassVar[str] = ""
    extrapolates: ClassVar[str] = ""

    def __init__(self, *, d_model: int, n_heads: int, causal: bool = False, n_layers: int = 1) -> None:
        super().__init__()
        if d_model <= 0 or n_heads <= 0:
            raise ConfigError(f"d_model={d_model} and n_heads={n_heads} must be positive.")
        if d_model % n_heads:
            raise ConfigError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}: choose d_model as a multiple of "
                f"n_heads (e.g. d_model={n_heads * max(1, round(d_model / n_heads))})."
            )
        if self.capabilities.causal_only and not causal:
            raise ConfigError(
                f"pe={self.name!r} is defined for causal attention only, but it was applied to a "
                "bidirectional attention (encoder self-attention or cross-attention). Use it in decoder "
                "self-attention only (model.pe_apply.encoder=false, cross=false) or pick another PE."
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.causal = causal
        self.n_layers = n_layers

    # ------------------------------------------------------------------ metadata
    @property
    def caps(self) -> Capabilities:
        """This instance's capabilities: the class declaration, narrowed by :meth:`narrow_capabilities`."""
        caps = self.__dict__.get("_caps")
        if caps is None:
            caps = self.narrow_capabilities(type(self).capabilities)
            if not caps.narrows(type(self).capabilities):
                raise RuntimeError(
                    f"{type(self).__name__}.narrow_capabilities returned {caps}, which is not a narrowing of "
                    f"the declared {type(self).capabilities}"
                )
            self.__dict__["_caps"] = caps
        return caps

    def narrow_capabilities(self, declared: Capabilities) -> Capabilities:
        """Capabilities of this instance given its options; may only switch declared ones off.

        The default keeps the declaration. A PE whose option removes a hook (Shaw without value
        relations) or a flag (KERPLE with shared parameters) overrides this, using
        ``dataclasses.replace(declared, ...)``.
        """
        return declared

    @property
    def max_positions(self) -> int | None:
        """Largest number of positions this PE can represent (``None``: unbounded)."""
        return None

    def check_positions(self, positions: Tensor) -> None:
        """Raise :class:`PositionRangeError` if ``positions`` are out of this PE's range."""
        limit = self.max_positions
        if limit is None or positions.numel() == 0:
            return
        top = int(positions.max())
        if top >= limit:
            raise PositionRangeError(
                f"pe={self.name!r} has a table of max_len={limit} positions, but the input needs position "
                f"{top} (sequence length {top + 1}). Raise model.pe_options.max_len to at least {top + 1}, "
                "shorten the input, or use a PE without a length limit (e.g. rope, alibi, sinusoidal)."
            )
        if self.caps.integer_positions and positions.is_floating_point():
            raise PositionRangeError(
                f"pe={self.name!r} looks positions up in a table and needs integer positions, "
                f"got dtype {positions.dtype}."
            )

    def extra_repr(self) -> str:
        hooks = sorted(self.caps.hooks)
        return f"hooks={hooks}, d_model={self.d_model}, n_heads={self.n_heads}, causal={self.causal}"

    # ------------------------------------------------------------------ hooks
    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """``embed`` hook: ``x`` (B, T, D), ``positions`` (B|1, T) -> (B, T, D)."""
        raise NotImplementedError

    def rotate(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """``rotary`` hook: ``x`` (B, H, T, Dh), ``positions`` (B|1, T) -> (B, H, T, Dh)."""
        return self.apply_rotary(x, self.rotary_tables(positions, is_query=is_query))

    def rotary_tables(self, positions: Tensor, *, is_query: bool) -> Any:
        """``rotary`` hook, first half: whatever the rotation of ``positions`` (B|1, T) needs (cos/sin …).

        The attention context computes this once per positions tensor and forward, and every layer
        reuses it through :meth:`apply_rotary`.
        """
        raise NotImplementedError

    def apply_rotary(self, x: Tensor, tables: Any) -> Tensor:
        """``rotary`` hook, second half: rotate ``x`` (B, H, T, Dh) with :meth:`rotary_tables`' output."""
        raise NotImplementedError

    def rotary_key(self, length: int) -> Any:
        """Identity of the rotation tables for sequences of ``length`` positions (PEs with
        ``caps.rotary_depends_on_length``): cached decoding recomputes its cache when it changes."""
        return None

    def set_scaling(self, scaling: dict[str, Any] | None) -> None:
        """Replace the rotary context-extension scaling (PEs with ``caps.rotary_scalable``)."""
        raise NotImplementedError(f"pe={self.name!r} has no rotary scaling")

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, layer: int = 0) -> Tensor:
        """Optional exact shortcut for the whole attention of one layer (``caps.attention_shortcut``).

        Called only where :meth:`offers_attention` says so, without gradients, dropout or padding, for
        contiguous positions ``0 … T-1`` of queries and keys: ``q``, ``k``, ``v`` (B, H, T, Dh) (already
        rotated) -> (B, H, T, Dh). A PE whose hooks force the explicit softmax path can return the same
        result from fused kernels.
        """
        raise NotImplementedError(f"pe={self.name!r} has no attention shortcut")

    def offers_attention(self, device_type: str) -> bool:
        """Whether :meth:`attention` computes this instance's attention on ``device_type`` (``cpu``,
        ``cuda``): the attention backend decision asks before it picks the shortcut."""
        return self.caps.attention_shortcut

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        """``bias`` hook: additive score bias, float32 of shape (B|1, H, Tq, Tk).

        ``q_pos`` (B|1, Tq) and ``k_pos`` (B|1, Tk) are the query and key positions; ``q`` (B, H, Tq, Dh)
        is given for PEs with ``caps.bias_reads_queries``. The bias is added to the *scaled* scores
        ``q·k / sqrt(Dh)``. PEs with ``caps.bias_reads_keys`` also take ``k`` (B, H, Tk, Dh); PEs with
        ``caps.bias_reads_input`` take ``q_feats`` (B, H, Tq, F) and ``k_feats`` (B, H, Tk, F) from
        :meth:`input_features`. Attention passes each only when the capability is declared.

        The default (PEs with ``caps.elementwise_bias``) evaluates :meth:`bias_fn` on broadcast views:
        heads (1, H, 1, 1), queries (B|1, 1, Tq, 1), keys (B|1, 1, 1, Tk).
        """
        if not self.caps.elementwise_bias:
            raise NotImplementedError
        heads = torch.arange(self.n_heads, device=q_pos.device).view(1, -1, 1, 1)
        return self.bias_fn(layer)(heads, q_pos[:, None, :, None], k_pos[:, None, None, :])

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """The bias of layer ``layer`` as an elementwise function (PEs with ``caps.elementwise_bias``).

        Returns ``f(h, q_pos, k_pos) -> float32`` of the broadcast shape of its arguments: ``h`` int64
        head indices, ``q_pos``/``k_pos`` integer or float positions, any broadcastable shapes (0-dim
        inside FlexAttention's ``score_mod``). Whatever does not depend on the element (slopes, tables,
        the MLP's segments) is prepared here, once per call, and only *read* by ``f``: ``f`` uses
        pointwise operations and indexing of those tensors, so that ``torch.compile`` can fuse it into
        an attention kernel.
        """
        raise NotImplementedError(f"pe={self.name!r} has no elementwise bias")

    def bias_at(self, h: Tensor, q_pos: Tensor, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        """The bias of heads ``h`` for query positions ``q_pos`` and key positions ``k_pos``
        (broadcast together), float32: :meth:`bias_fn` of ``layer`` evaluated once."""
        return self.bias_fn(layer)(h, q_pos, k_pos)

    def input_features(self, x: Tensor, *, layer: int = 0, past: Tensor | None = None) -> Tensor:
        """Per-token features of the layer input (``caps.bias_reads_input``): ``x`` (B, T, D) -> (B, H, T, F).

        ``past`` (B, H, T_past, F) are the cached features of the tokens before ``x`` (cached decoding)
        or ``None``; the result covers the new tokens only and is appended to the cache.
        """
        raise NotImplementedError

    def value(self, probs: Tensor, q_pos: Tensor, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        """``value`` hook: ``probs`` (B, H, Tq, Tk) -> term added to the attention output (B, H, Tq, Dh)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def position_logits(self, positions: Tensor) -> Tensor:
        """Position-only attention logits (H, T, T) at ``positions`` (1, T), for inspection plots.

        Embedding PEs: ``PE·PEᵀ/√D``; rotary PEs: scores of a constant query/key; bias PEs: the bias.
        The probes are made on ``positions``' device, in the dtype of the PE's parameters (fp32 for a
        PE without any), so the PE may live on any device and in any precision.
        """
        pos = positions
        length = pos.shape[-1]
        hooks = self.caps.hooks
        with torch.no_grad():
            if "bias" in hooks and (self.caps.bias_reads_keys or self.caps.bias_reads_input):
                return self.bias(pos, pos, **self._probe_inputs(pos)).squeeze(0).float()
            if "bias" in hooks and not self.caps.bias_reads_queries:
                return self.bias(pos, pos).squeeze(0).float()
            if "rotary" in hooks:
                ones = self._probe(pos, 1, self.n_heads, length, self.head_dim)
                q = self.rotate(ones, pos, is_query=True)
                k = self.rotate(ones, pos, is_query=False)
                return (q @ k.transpose(-1, -2)).squeeze(0).float() / self.head_dim**0.5
            if "embed" in hooks:
                zeros = self._probe(pos, 1, length, self.d_model, fill=0.0)
                pe = self.embed(zeros, pos).squeeze(0).float()  # (T, D)
                return (pe @ pe.T / self.d_model**0.5).unsqueeze(0)
            if "bias" in hooks:  # query-dependent bias: use a constant query
                q = self._probe(pos, 1, self.n_heads, length, self.head_dim)
                return self.bias(pos, pos, q=q).squeeze(0).float()
        return torch.zeros(1, length, length, device=pos.device)

    def _probe(self, positions: Tensor, *shape: int, fill: float = 1.0) -> Tensor:
        """A constant probe of ``shape`` on ``positions``' device, in the dtype of the PE's parameters."""
        dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
        return torch.full(shape, fill, dtype=dtype, device=positions.device)

    def _probe_inputs(self, positions: Tensor) -> dict[str, Tensor]:
        """Constant q/k/layer input at ``positions`` (1, T), for the tensors the bias declares it reads."""
        length = positions.shape[-1]
        ones = self._probe(positions, 1, self.n_heads, length, self.head_dim, fill=1.0 / self.head_dim**0.5)
        out: dict[str, Tensor] = {}
        if self.caps.bias_reads_queries:
            out["q"] = ones
        if self.caps.bias_reads_keys:
            out["k"] = ones
        if self.caps.bias_reads_input:
            feats = self.input_features(self._probe(positions, 1, length, self.d_model))
            out["q_feats"] = out["k_feats"] = feats
        return out


def relative_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``i - j`` for every query/key pair: (B|1, Tq) x (B|1, Tk) -> (B|1, Tq, Tk)."""
    return q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)


def option_error(name: str, key: str, value: Any, rule: str) -> ConfigError:
    """One consistently worded error for a bad PE option."""
    return ConfigError(f"pe={name!r}: option {key}={value!r} is invalid: {rule}.")
