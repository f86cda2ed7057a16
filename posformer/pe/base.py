"""The positional-encoding interface: four hooks, the form of a bias, and the record attention reads.

A positional encoding (PE) is an ``nn.Module`` whose methods are its *hooks* (as torchtune's
positional modules: embed, rotate, bias, value); model code calls the hooks and never looks at a PE's
name:

``embed``   adds position information to the token embeddings, ``x + PE(pos)`` (sinusoidal,
            learned).
``rotary``  rotates queries and keys per head before the dot product (RoPE, xPos): :meth:`rotate`,
            in two halves the attention context caches, :meth:`rotary_tables` and :meth:`apply_rotary`.
``bias``    an additive attention-score bias ``b[h, i, j]`` (ALiBi, T5, FIRE, KERPLE; Shaw's key
            relations, which also read ``q``). The class states the bias's form (``bias_form``,
            :mod:`posformer.pe.forms`), which tells attention how it may be computed: from one vector
            over offsets, elementwise as FlexAttention's ``score_mod`` (:meth:`bias_fn`), as key columns,
            from features of the layer input, or per call.
``value``   adds a term to the attention output computed from the attention probabilities
            (Shaw's value relations). It needs the probabilities, so attention with this hook
            runs the explicit softmax path instead of fused SDPA.

A PE that computes a whole layer's attention from fused kernels (Shaw, CoPE) adds the
:class:`~posformer.pe.shortcut.AttentionShortcut` mixin.

Positions always travel as an explicit tensor of shape ``(B, T)`` or ``(1, T)`` (broadcast over
the batch). Integer dtypes are ordinary positions (offsets for cached decoding, sparse sorted
positions for randomized training); floating dtypes are fractional positions (interpolation).
Tables are computed in float64 from those positions and stored in float32; they are cast to the
activation dtype only when applied, so a bf16/fp16 run sees the same positions as fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError
from posformer.pe.forms import OLD_FACTS, BiasForm, Positions, form_problems
from posformer.pe.limits import PositionRange
from posformer.pe.shortcut import AttentionShortcut

HOOKS = ("embed", "rotary", "bias", "value")
#: the hooks that act inside attention (a PE with none of them needs no attention context)
ATTENTION_HOOKS = frozenset({"rotary", "bias", "value"})
#: the method whose override gives each hook but ``bias`` (a bias form gives that one)
HOOK_METHODS = {"embed": "embed", "rotary": "rotary_tables", "value": "value"}
#: an elementwise bias ``(h, q_pos, k_pos) -> float32``, broadcast over the shapes of its arguments
#: (:meth:`PositionalEncoding.bias_fn`)
BiasAt = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Capabilities:
    """What a positional encoding does, as attention and evaluation ask it: derived, never hand-written.

    Model, attention and evaluation code never test a PE's name or class; they read this record
    (``pe.caps`` for an instance, ``cls.capabilities`` for a class). It is computed from the class
    (:func:`class_capabilities`: which methods it overrides, its stated ``bias_form``, whether it has
    the :class:`~posformer.pe.shortcut.AttentionShortcut` mixin) and, for an instance whose options change
    it, by :meth:`PositionalEncoding.describe`.

    Attributes:
        hooks: the hooks the class implements (a subset of :data:`HOOKS`): ``embed`` when it overrides
            :meth:`~PositionalEncoding.embed`, ``rotary`` :meth:`~PositionalEncoding.rotary_tables`,
            ``bias`` when it has a bias form (it overrides :meth:`~PositionalEncoding.bias` or
            :meth:`~PositionalEncoding.bias_fn`), ``value`` :meth:`~PositionalEncoding.value`; an instance
            may have fewer (Shaw without value relations).
        bias: the bias's form (:mod:`posformer.pe.forms`: ``Positions``, ``Offsets``, ``Features``,
            ``PerCall``), the tagged value the attention backends match on; ``None`` without a bias.
        attention_shortcut: the class computes a layer's whole attention itself
            (:class:`~posformer.pe.shortcut.AttentionShortcut`: Shaw, CoPE).
        rotary_scalable: the class defines ``set_scaling(scaling)`` (context extension at evaluation).
        rotary_depends_on_length: the instance's rotation of a position depends on the sequence length
            (dynamic NTK, LongRoPE): the KV cache is replayed whenever the PE's ``rotary_key(length)`` of
            the grown length differs.
    """

    hooks: frozenset[str] = frozenset()
    bias: BiasForm | None = None
    attention_shortcut: bool = False
    rotary_scalable: bool = False
    rotary_depends_on_length: bool = False

    @property
    def in_attention(self) -> bool:
        """Whether the PE acts inside attention (rotary, bias or value hook)."""
        return bool(self.hooks & ATTENTION_HOOKS)


def _overrides(cls: type, method: str) -> bool:
    """Whether ``cls`` defines ``method`` itself or inherits it from a class below PositionalEncoding."""
    return getattr(cls, method, None) is not getattr(PositionalEncoding, method, None)


def _stated_form(cls: type[PositionalEncoding]) -> BiasForm | None:
    """The class's ``bias_form``; without one, the general form of the methods it defines: ``bias_fn``
    gives ``Positions(score_mod=True)``, ``bias`` ``Positions()``."""
    if cls.bias_form is not None:
        return cls.bias_form
    if _overrides(cls, "bias_fn"):
        return Positions(score_mod=True)
    return Positions() if _overrides(cls, "bias") else None


def class_capabilities(cls: type[PositionalEncoding]) -> Capabilities:
    """The :class:`Capabilities` of a PE class: its overridden methods, its bias form, its mixins."""
    form = _stated_form(cls)
    hooks = {hook for hook, method in HOOK_METHODS.items() if _overrides(cls, method)}
    return Capabilities(
        hooks=frozenset(hooks | ({"bias"} if form is not None else set())),
        bias=form,
        attention_shortcut=issubclass(cls, AttentionShortcut),
        rotary_scalable=callable(getattr(cls, "set_scaling", None)),
    )


def contract_problems(cls: type[PositionalEncoding]) -> list[str]:
    """Where the class's stated facts disagree with the methods it defines (checked at registration): its
    bias form against the methods the form names (:func:`~posformer.pe.forms.form_problems`), the fused
    attention mixin without ``attention``, and facts of the contract before 2026-12."""
    out = [
        f"states {name}, which bias_form replaces (e.g. bias_form = Offsets(); docs/adding_a_pe.md)"
        for name in OLD_FACTS
        if any(name in vars(k) for k in cls.__mro__ if k is not PositionalEncoding)
    ]
    out += form_problems(_stated_form(cls), lambda m: _overrides(cls, m))
    if issubclass(cls, AttentionShortcut) and cls.attention is AttentionShortcut.attention:
        out.append("AttentionShortcut without attention() (the layer's attention it computes)")
    return out


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
    #: the form of the bias (:mod:`posformer.pe.forms`); without one, a class that defines ``bias_fn``
    #: has ``Positions(score_mod=True)``, one that defines ``bias`` ``Positions()``
    bias_form: ClassVar[BiasForm | None] = None
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
                "state only bias_form, causal_only as class attributes (docs/adding_a_pe.md)"
            )
        cls.capabilities = class_capabilities(cls)

    # ------------------------------------------------------------------ metadata
    @property
    def caps(self) -> Capabilities:
        """This instance's capabilities: :meth:`describe`, computed once by the constructor (and again
        when an option that changes them changes, e.g. RoPE's ``set_scaling``)."""
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

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, q: Tensor | None = None, layer: int = 0) -> Tensor:
        """``bias`` hook: additive score bias, float32 of shape (B|1, H, Tq, Tk).

        ``q_pos`` (B|1, Tq) and ``k_pos`` (B|1, Tk) are the query and key positions. The bias is added to
        the *scaled* scores ``q·k / sqrt(Dh)``. Attention passes what the bias form reads besides:
        ``PerCall`` the queries ``q`` (B, H, Tq, Dh) and/or the keys ``k`` (B, H, Tk, Dh) (with packed
        documents and keys also ``visible``), ``Features`` ``q_feats`` (B, H, Tq, F) and ``k_feats``
        (B, H, Tk, F) from the PE's ``input_features`` (:mod:`posformer.pe.forms`).

        The default (forms with ``score_mod``) evaluates :meth:`bias_fn` on broadcast views: heads
        (1, H, 1, 1), queries (B|1, 1, Tq, 1), keys (B|1, 1, 1, Tk).
        """
        heads = torch.arange(self.n_heads, device=q_pos.device).view(1, -1, 1, 1)
        return self.bias_fn(layer)(heads, q_pos[:, None, :, None], k_pos[:, None, None, :])

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """The bias of layer ``layer`` as an elementwise function (forms with ``score_mod``).

        Returns ``f(h, q_pos, k_pos) -> float32`` of the broadcast shape of its arguments: ``h`` int64
        head indices, ``q_pos``/``k_pos`` integer or float positions, any broadcastable shapes (0-dim
        inside FlexAttention's ``score_mod``). Whatever does not depend on the element (slopes, tables,
        the MLP's segments) is prepared here, once per call, and only *read* by ``f``: ``f`` uses
        pointwise operations and indexing of those tensors, so that ``torch.compile`` can fuse it into
        an attention kernel.
        """
        raise NotImplementedError(f"pe={self.name!r} has no elementwise bias")

    def value(self, probs: Tensor, q_pos: Tensor, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        """``value`` hook: ``probs`` (B, H, Tq, Tk) -> term added to the attention output (B, H, Tq, Dh)."""
        raise NotImplementedError


def relative_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``i - j`` for every query/key pair: (B|1, Tq) x (B|1, Tk) -> (B|1, Tq, Tk)."""
    return q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)


def option_error(name: str, key: str, value: Any, rule: str) -> ConfigError:
    """One consistently worded error for a bad PE option."""
    return ConfigError(f"pe={name!r}: option {key}={value!r} is invalid: {rule}.")
