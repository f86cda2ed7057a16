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
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError
from posformer.pe.limits import PositionRange

HOOKS = ("embed", "rotary", "bias", "value")
#: the hooks that act inside attention (a PE with none of them needs no attention context)
ATTENTION_HOOKS = frozenset({"rotary", "bias", "value"})
#: an elementwise bias ``(h, q_pos, k_pos) -> float32``, broadcast over the shapes of its arguments
#: (:meth:`PositionalEncoding.bias_fn`)
BiasAt = Callable[[Tensor, Tensor, Tensor], Tensor]
#: which keys a query sees, elementwise: ``(b, q_idx, k_idx) -> bool`` of batch rows and indices,
#: broadcast over their shapes (padding, packed documents; causality included or not)
KeyVisible = Callable[[Tensor, Tensor, Tensor], Tensor]


class CausalLSE(Protocol):
    """Causal fused attention with its log-sum-exp, handed to :meth:`PositionalEncoding.attention` by
    the model (the device's kernel): q, k, v (B, H, T, Dh), scale Dh^-0.5 -> (output (B, H, T, Dh) in
    q's dtype, natural-log log-sum-exp (B, H, T) float32), both differentiable.

    ``visible`` (in the call's own indices) hides more keys than causality; a query that then sees
    none gets output 0 and log-sum-exp ``-inf``. ``tag`` names the visibility for the forward (the
    same for every layer), so the kernel may build its mask once and reuse it.
    """

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, visible: KeyVisible | None = None, tag: str = ""
    ) -> tuple[Tensor, Tensor]: ...


#: what a bias may read besides positions: the queries, the keys, the layer input
BIAS_READS = ("q", "k", "x")


@dataclass(frozen=True)
class Capabilities:
    """What a positional encoding does, as attention and evaluation ask it: derived, never hand-written.

    Model, attention and evaluation code never test a PE's name or class; they read this record
    (``pe.caps`` for an instance, ``cls.capabilities`` for a class). It is computed from the class
    (:func:`class_capabilities`: which methods it overrides, and three facts it states as class
    attributes) and, for an instance whose options change it, by :meth:`PositionalEncoding.describe`.

    Attributes:
        hooks: the hooks the class implements (a subset of :data:`HOOKS`): ``embed`` when it overrides
            :meth:`~PositionalEncoding.embed`, ``rotary`` :meth:`~PositionalEncoding.rotary_tables`,
            ``bias`` :meth:`~PositionalEncoding.bias` or :meth:`~PositionalEncoding.bias_fn`, ``value``
            :meth:`~PositionalEncoding.value`; an instance may have fewer (Shaw without value relations).
        bias_offset_only: stated — the bias of query ``i`` and key ``j`` depends on ``i - j`` only (ALiBi,
            T5, KERPLE): attention may build it from one vector over offsets.
        bias_reads: stated (``q``, ``k``) or derived (``x``: the class overrides
            :meth:`~PositionalEncoding.input_features`) — the tensors of the call the bias reads besides
            the positions: the queries (Shaw), the keys (CoPE's gates ``σ(q·k)``; with packed documents
            attention also passes ``visible`` (B|1, 1, Tq, Tk) bool), per-token features of the layer
            input (forget gates: cached next to ``k``/``v`` for decoding). Such a bias is built per call.
        bias_per_layer: stated — the bias differs between layers (built once per layer, not per forward).
        elementwise_bias: the class overrides :meth:`~PositionalEncoding.bias_fn` — one elementwise
            function of (head, query position, key position) gives the materialised bias and the
            FlexAttention ``score_mod``.
        feature_bias: the class overrides :meth:`~PositionalEncoding.feature_bias` — a bias read from the
            layer input (``bias_reads`` has ``x``) that is one elementwise function of the query token's
            and the key token's scalar features (forget gates: ``c_i - c_j``); FlexAttention reads the
            features as two captured (B, H, T) tensors, each indexed once, and returns their gradients.
        key_bias: the class overrides :meth:`~PositionalEncoding.key_bias` — the feature bias is a function
            of the key token alone plus a term of the query token, which the softmax cancels (forget
            gates: ``-c_j``); attention then adds it as one more head-dim column of fused SDPA.
        key_position_bias: the class overrides :meth:`~PositionalEncoding.key_position_bias` — in causal
            attention the bias is a function of the key position alone plus a term of the query's (causal
            ALiBi: ``m_h·j``); attention may add it as head-dim columns of fused SDPA, as ``key_bias``.
        bias_fn_trainable: stated — :meth:`~PositionalEncoding.bias_fn` reads the PE's parameters only
            as captured tensors, each indexed once, none 0-d and none a view (dynamo drops a captured
            view's gradient), so FlexAttention can return their
            gradients (T5, KERPLE, FIRE); without it FlexAttention never trains the PE's parameters.
        attention_shortcut: the class overrides :meth:`~PositionalEncoding.attention`.
        rotary_scalable: the class overrides :meth:`~PositionalEncoding.set_scaling` (context extension).
        rotary_depends_on_length: the instance's rotation of a position depends on the sequence length
            (dynamic NTK, LongRoPE): the KV cache is replayed whenever
            :meth:`~PositionalEncoding.rotary_key` of the grown length differs.
    """

    hooks: frozenset[str] = frozenset()
    bias_offset_only: bool = False
    bias_reads: frozenset[str] = frozenset()
    bias_per_layer: bool = False
    elementwise_bias: bool = False
    feature_bias: bool = False
    key_bias: bool = False
    key_position_bias: bool = False
    bias_fn_trainable: bool = False
    attention_shortcut: bool = False
    rotary_scalable: bool = False
    rotary_depends_on_length: bool = False

    @property
    def bias_reads_queries(self) -> bool:
        return "q" in self.bias_reads

    @property
    def bias_reads_keys(self) -> bool:
        return "k" in self.bias_reads

    @property
    def bias_reads_input(self) -> bool:
        return "x" in self.bias_reads

    @property
    def bias_per_call(self) -> bool:
        """Whether the bias reads tensors of the call (q, k or the layer input): never shared or kept."""
        return bool(self.bias_reads)

    @property
    def in_attention(self) -> bool:
        """Whether the PE acts inside attention (rotary, bias or value hook)."""
        return bool(self.hooks & ATTENTION_HOOKS)

    def problems(self) -> list[str]:
        """Inconsistencies of the class's stated facts with what it implements (checked at registration)."""
        out = []
        unknown = sorted(set(self.bias_reads) - set(BIAS_READS))
        if unknown:
            out.append(f"bias_reads names {unknown} (valid: {', '.join(BIAS_READS)})")
        stated = [n for n in ("bias_offset_only", "bias_per_layer") if getattr(self, n)]
        if (stated or self.bias_reads) and "bias" not in self.hooks:
            out.append(f"{', '.join(stated + ['bias_reads'] * bool(self.bias_reads))} stated without a bias")
        if self.bias_offset_only and self.bias_reads:
            out.append("bias_offset_only and bias_reads exclude each other (a bias of i - j reads no tensor)")
        if self.elementwise_bias and self.bias_reads:
            out.append("bias_fn (an elementwise bias) and bias_reads exclude each other (it reads tensors)")
        if self.bias_fn_trainable and not self.elementwise_bias:
            out.append("bias_fn_trainable stated without a bias_fn")
        if self.feature_bias and not self.bias_reads_input:
            out.append("feature_bias without input_features (it reads the layer input's features)")
        if self.key_bias and not self.feature_bias:
            out.append("key_bias without feature_bias (it is the feature bias's key part)")
        if self.key_position_bias and "bias" not in self.hooks:
            out.append("key_position_bias without a bias (it is the bias's key part)")
        return out


def _overrides(cls: type, method: str) -> bool:
    """Whether ``cls`` defines ``method`` itself or inherits it from a class below PositionalEncoding."""
    return getattr(cls, method) is not getattr(PositionalEncoding, method)


def class_capabilities(cls: type[PositionalEncoding]) -> Capabilities:
    """The :class:`Capabilities` of a PE class: its overridden methods and its stated facts."""
    hooks = {
        hook
        for hook, methods in (
            ("embed", ("embed",)),
            ("rotary", ("rotary_tables",)),
            ("bias", ("bias", "bias_fn")),
            ("value", ("value",)),
        )
        if any(_overrides(cls, m) for m in methods)
    }
    reads = frozenset(cls.bias_reads) | ({"x"} if _overrides(cls, "input_features") else set())
    return Capabilities(
        hooks=frozenset(hooks),
        bias_offset_only=cls.bias_offset_only,
        bias_reads=reads,
        bias_per_layer=cls.bias_per_layer,
        elementwise_bias=_overrides(cls, "bias_fn"),
        feature_bias=_overrides(cls, "feature_bias"),
        key_bias=_overrides(cls, "key_bias"),
        key_position_bias=_overrides(cls, "key_position_bias"),
        bias_fn_trainable=cls.bias_fn_trainable,
        attention_shortcut=_overrides(cls, "attention"),
        rotary_scalable=_overrides(cls, "set_scaling"),
    )


class PositionalEncoding(PositionRange, nn.Module):
    """Base class of every positional encoding.

    Args:
        d_model: model width ``D``.
        n_heads: number of attention heads ``H``.
        causal: whether the attention this PE serves is causal (decoder self-attention).
        n_layers: number of layers the PE serves (for PEs with per-layer parameters).
    """

    #: registry name, set by :func:`posformer.pe.register`
    name: ClassVar[str] = ""
    #: stated facts (everything else about the class is read from the methods it overrides)
    #: the bias depends on ``i - j`` only (built from one vector over offsets)
    bias_offset_only: ClassVar[bool] = False
    #: what the bias reads besides positions: ``q`` (queries), ``k`` (keys); the layer input is read
    #: by overriding :meth:`input_features`
    bias_reads: ClassVar[frozenset[str]] = frozenset()
    #: the bias differs between layers
    bias_per_layer: ClassVar[bool] = False
    #: :meth:`bias_fn` reads the parameters as captured tensors, each indexed once, none 0-d
    #: (FlexAttention can train them)
    bias_fn_trainable: ClassVar[bool] = False
    #: defined for causal attention only (refused in an encoder or cross-attention at construction)
    causal_only: ClassVar[bool] = False
    #: positions come from the content (gates), so shifted or randomized positions change nothing;
    #: read by tests and studies, not by the model
    content_positions: ClassVar[bool] = False
    #: derived from the above for every subclass (:func:`class_capabilities`); never assigned by hand
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
        if self.causal_only and not causal:
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} assigns `capabilities`: they are derived from the methods it overrides; "
                "state only bias_offset_only, bias_reads, bias_per_layer, bias_fn_trainable, causal_only as "
                "class attributes (docs/adding_a_pe.md)"
            )
        cls.capabilities = class_capabilities(cls)

    # ------------------------------------------------------------------ metadata
    @property
    def caps(self) -> Capabilities:
        """This instance's capabilities: :meth:`describe`, computed once by the constructor (and again
        when an option that changes them changes, e.g. :meth:`set_scaling`)."""
        caps = self.__dict__.get("_caps")
        return caps if caps is not None else type(self).capabilities

    def describe(self) -> Capabilities:
        """The capabilities of this instance given its options; the default is the class's.

        A PE whose option changes them (Shaw without value relations has no value hook; KERPLE with
        shared parameters has one bias for all layers) overrides this with
        ``dataclasses.replace(type(self).capabilities, ...)`` and calls :meth:`refresh_capabilities`
        at the end of its constructor.
        """
        return type(self).capabilities

    def refresh_capabilities(self) -> None:
        """Recompute :attr:`caps` from :meth:`describe` (after the options it reads are set)."""
        self.__dict__["_caps"] = self.describe()

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
        """Optional exact shortcut for the whole attention of one layer (``caps.attention_shortcut``).

        Called only where :meth:`offers_attention` says so (with gradients only where it says so for
        ``grad=True``, with padding or packed documents only where it says so for ``masked=True``),
        without dropout, for as many queries as keys whose position distances are their index
        distances (``0 … T-1``; packed documents restarting at 0): ``q``, ``k``, ``v`` (B, H, T, Dh)
        (already rotated) -> (B, H, T, Dh). ``visible`` (:data:`KeyVisible`, causality included; None:
        every key, causality aside) hides padding and other documents; every query sees at least one
        key (the model zeroes the rows of queries that see none itself). A PE whose hooks force
        the explicit softmax path can return the same result from fused kernels: ``causal_lse`` is the
        device's causal attention with its log-sum-exp (:data:`CausalLSE`; the CPU flash kernel,
        FlexAttention on CUDA; both differentiable), chosen by the model
        (``posformer.model.backends.shortcut``), so the PE imports no kernel of its own.
        """
        raise NotImplementedError(f"pe={self.name!r} has no attention shortcut")

    def offers_attention(
        self, device_type: str, *, grad: bool = False, masked: bool = False, length: int | None = None
    ) -> bool:
        """Whether :meth:`attention` computes this instance's attention on ``device_type`` (``cpu``,
        ``cuda``), with gradients when ``grad`` (training), for padded or packed rows (its ``visible``)
        when ``masked``, for ``length`` tokens (None: unknown), where it pays: the attention backend
        decision asks before it picks the shortcut (and picks it only where the model has a
        ``causal_lse`` kernel for the device and the user's backend setting). Default: wherever the
        class has one, inference only, without masks, at any length."""
        return self.caps.attention_shortcut and not grad and not masked

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

    def feature_bias(self, q_feat: Tensor, k_feat: Tensor) -> Tensor:
        """The bias from one query token's and one key token's scalar input features (``caps.feature_bias``):
        an elementwise function of broadcastable float32 tensors (0-dim inside FlexAttention's
        ``score_mod``; (B, H, Tq, 1) and (B, H, 1, Tk) in :meth:`bias`), pointwise operations only."""
        raise NotImplementedError(f"pe={self.name!r} has no feature bias")

    def key_bias(self, k_feat: Tensor) -> Tensor:
        """The feature bias's part that depends on the key (``caps.key_bias``): ``feature_bias(q, k) =
        r(q) + key_bias(k)`` for some function ``r`` of the query token alone, which the softmax cancels
        (it shifts a whole row). ``k_feat`` (B, H, Tk) float32 -> (B, H, Tk) float32, pointwise. Attention
        then needs no (Tq, Tk) bias: ``posformer.model.backends.keycol``."""
        raise NotImplementedError(f"pe={self.name!r} has no key bias")

    def key_position_bias(self, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        """The causal bias's part that depends on the key position (``caps.key_position_bias``): for every
        key a query sees in causal attention (``k_pos <= q_pos``), ``bias(i, j) = r(i) +
        key_position_bias(j)``, ``r`` cancelled by the softmax. ``k_pos`` (B|1, Tk) -> (B|1, H, Tk)
        float32. Attention then needs no (Tq, Tk) bias: ``posformer.model.backends.keycol``."""
        raise NotImplementedError(f"pe={self.name!r} has no key position bias")

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
