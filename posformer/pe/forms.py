"""The forms a PE's attention-score bias takes: a small tagged value the attention backends match on.

A PE with a bias states one form as its class attribute ``bias_form``; :func:`form_problems` checks the
form against the methods the class defines when it is registered. Each form names the methods its PE
defines and what attention may then do:

==================================  ==================================================================
form                                the PE defines; attention may then
==================================  ==================================================================
``Positions()``                     ``bias(q_pos, k_pos, layer=)``: materialise it per query block
``Positions(score_mod=True)``       ``bias_fn(layer)``: the same bias elementwise, FlexAttention's
                                    ``score_mod`` (FIRE)
``Offsets(...)``                    a bias of ``i - j`` alone: build it from one vector over the
                                    ``Tq + Tk - 1`` offsets (ALiBi, T5, KERPLE, Sandwich, DPB)
``Offsets(key_columns=True)``       ``key_position_bias(k_pos, layer=)``: in causal attention the bias
                                    is ``r(i) + g(j)``, the softmax cancels ``r``: ``g`` as head-dim
                                    columns of fused SDPA (causal ALiBi)
``Features(...)``                   ``input_features(x, layer=, past=)`` of the layer input and
                                    ``feature_bias(q_feat, k_feat)``, elementwise: the features as two
                                    captured tensors of a ``score_mod`` (forget gates)
``Features(key_columns=True)``      ``key_bias(k_feat)``: the feature bias's key part (``-c_j``), as
                                    head-dim columns
``PerCall(reads={"q", "k"})``       ``bias(q_pos, k_pos, q=, k=, visible=, layer=)``: built per layer and
                                    call from the queries / keys it reads (Shaw, CoPE); ``"x"``: the
                                    layer input's ``input_features`` too (``q_feats=``, ``k_feats=``)
==================================  ==================================================================

``score_mod`` and ``trainable`` belong to the forms of positions: ``trainable`` states that
``bias_fn`` reads the PE's parameters only as captured tensors, each by one index, none 0-d and none a
view, so FlexAttention returns their gradients (T5's table, KERPLE's and FIRE's per-head vectors).
``per_layer`` states that the bias differs between layers (built once per layer instead of once per
forward); a bias that reads tensors of the call is built per layer and call anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

#: what a per-call bias may read besides positions: the queries, the keys, the layer input's features
CALL_READS = ("q", "k", "x")
#: the methods a form may name (beyond ``bias``); a class that defines one its form does not name is refused
FORM_METHODS = ("bias_fn", "key_position_bias", "input_features", "feature_bias", "key_bias")
#: class attributes of the contract before 2026-12, now said by ``bias_form``
OLD_FACTS = ("bias_offset_only", "bias_reads", "bias_per_layer", "bias_fn_trainable")


class BiasForm:
    """Base of the forms (module docstring), with the facts every form answers: ``per_call`` (the bias
    reads tensors of the call: built per layer and call, never kept), ``per_layer``, and ``score_mod`` /
    ``trainable``, which only a form of positions (:class:`Positions`, :class:`Offsets`) may state."""

    per_call: ClassVar[bool] = False
    per_layer: bool = True
    score_mod: bool = False
    trainable: bool = False

    def methods(self) -> frozenset[str]:
        """The methods of :data:`FORM_METHODS` a PE of this form defines."""
        return frozenset()


@dataclass(frozen=True)
class Positions(BiasForm):
    """``b[h, i, j]`` from the query and key positions (the form of a bias that states nothing more).

    Attributes:
        score_mod: ``bias_fn(layer)`` gives it elementwise: the materialised bias and FlexAttention's
            ``score_mod`` both come from it.
        trainable: ``bias_fn`` reads the parameters as FlexAttention can differentiate (module docstring).
        per_layer: the bias differs between layers.
    """

    score_mod: bool = False
    trainable: bool = False
    per_layer: bool = False

    def methods(self) -> frozenset[str]:
        return frozenset({"bias_fn"} if self.score_mod else ())


@dataclass(frozen=True)
class Offsets(Positions):
    """A bias of ``i - j`` alone, built from one vector over offsets where positions are contiguous.

    Attributes:
        key_columns: in causal attention ``bias(i, j) = r(i) + key_position_bias(j)`` for every key a
            query sees (``j <= i``): ``posformer.model.backends.keycol`` (causal ALiBi: ``m_h·j``).
    """

    key_columns: bool = False

    def methods(self) -> frozenset[str]:
        return super().methods() | ({"key_position_bias"} if self.key_columns else frozenset())


@dataclass(frozen=True)
class Features(BiasForm):
    """``feature_bias(q_feat, k_feat)``: a bias elementwise in the query token's and the key token's
    scalar feature of the layer input (``input_features``, cached next to the keys for decoding), which
    FlexAttention reads as two captured tensors.

    Attributes:
        key_columns: ``feature_bias(q, k) = r(q) + key_bias(k)`` (forget gates: ``-c_j``), which needs
            no (Tq, Tk) bias: head-dim columns (``posformer.model.backends.keycol``).
    """

    per_call: ClassVar[bool] = True
    key_columns: bool = False

    def methods(self) -> frozenset[str]:
        return frozenset({"input_features", "feature_bias"} | ({"key_bias"} if self.key_columns else set()))


@dataclass(frozen=True)
class PerCall(BiasForm):
    """A bias that reads tensors of the call: the queries (``"q"``), the keys (``"k"``; with packed
    documents ``bias`` also takes ``visible`` (B|1, 1, Tq, Tk) bool, the keys each query sees), the
    layer input's features (``"x"``: ``q_feats``, ``k_feats`` from the PE's ``input_features``)."""

    per_call: ClassVar[bool] = True
    reads: frozenset[str] = field(default_factory=lambda: frozenset({"q"}))

    def methods(self) -> frozenset[str]:
        return frozenset({"input_features"} if "x" in self.reads else ())


def reads(form: BiasForm | None) -> frozenset[str]:
    """What a bias of ``form`` reads besides the positions: ``q``, ``k``, ``x`` the layer input's features
    (``PerCall``: those it states; ``Features``: ``x``), nothing (the forms of positions, or no bias)."""
    if isinstance(form, PerCall):
        return frozenset(form.reads)
    return frozenset({"x"}) if isinstance(form, Features) else frozenset()


def form_problems(form: object, defines: Callable[[str], bool]) -> list[str]:
    """What is wrong with ``form`` as the bias form of a class that ``defines`` (method name -> whether
    the class defines it below ``PositionalEncoding``): a method the form names and the class lacks, or
    one the class defines and the form does not name (it would never be called)."""
    if form is not None and not isinstance(form, BiasForm):
        return [f"bias_form={form!r} is not a form (Positions, Offsets, Features, PerCall)"]
    named = form.methods() if form is not None else frozenset()
    out = [f"bias_form={form!r} needs {m}()" for m in sorted(named) if not defines(m)]
    if form is not None and not (defines("bias") or "bias_fn" in named):
        out.append(f"bias_form={form!r} stated without a bias (define bias, or bias_fn with score_mod)")
    out += [
        f"defines {m}(), which its bias_form={form!r} does not name: state it (docs/adding_a_pe.md)"
        for m in FORM_METHODS
        if defines(m) and m not in named
    ]
    if isinstance(form, Positions) and form.trainable and not form.score_mod:
        out.append(f"bias_form={form!r}: trainable without score_mod (it is about bias_fn)")
    if isinstance(form, PerCall) and (not form.reads or set(form.reads) - set(CALL_READS)):
        out.append(f"bias_form={form!r} reads {sorted(form.reads)} (valid: a non-empty subset of q, k, x)")
    return out
