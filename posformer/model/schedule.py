"""Per-layer schedules: which PE, attention span, query temperature and sinks each layer uses.

A model config may name *layer kinds* and lay them out over the layers of each place (decoder or
decoder-only self-attention, encoder self-attention, cross-attention)::

    model:
      layer_kinds:
        rope_local:  {pe: rope, pe_options: {base: 10000}, span: {kind: chunked, window: 64}}
        nope_global: {pe: nope, temperature: {kind: llama4, floor_scale: 64, attn_scale: 0.1}}
      layers:
        pattern: [rope_local, rope_local, rope_local, nope_global]   # repeated over the decoder layers

``layers.<place>`` is an explicit list (its length is the place's depth); ``layers.pattern`` (decoder)
and ``layers.<place>_pattern`` repeat a pattern of at most the depth (cut at the last layer, as Gemma's
5:1 stacks). A place without an entry uses :data:`DEFAULT_KIND` in every layer: today's model, bitwise.
A kind without ``pe``/``pe_options`` uses the model's PE (``model.pe``, one shared instance); a kind
with either builds its own (``pe_options`` of a kind without ``pe`` are merged over ``model.pe_options``).

Spans (a query at absolute index ``i`` and position ``p``, a key at ``j`` and ``p'``):

* ``full``: every key (today);
* ``sliding`` (width ``window`` = W; by index, like the causal mask): causal ``i - W < j <= i``,
  bidirectional ``|i - j| <= W // 2``; decoding keeps a rolling cache of the last W - 1 keys;
* ``chunked`` (length ``window`` = C, Llama 4; by position, so packed documents chunk from their own
  start): ``p // C == p' // C`` (and causal ``j <= i``); decoding keeps every key (chunk boundaries
  follow the positions, which the cache does not read on the host).

Temperatures scale the queries by a function of their position ``p`` (Llama 4: on the NoPE layers):

* ``llama4``: ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``;
* ``logn`` (scalable softmax, Nakanishi 2025): ``scale * log(p + 1)`` (``p + 1`` keys seen causally),
  at least ``min`` (default 1: short contexts are unscaled);
* ``floorlog`` (Inkling's queries): ``1 + alpha * log(max((p + 1) / n_floor, 1))``, 1 up to ``n_floor``.

``sinks: true`` gives each head of the layer a learned logit in the softmax denominator (gpt-oss);
``sinks: token`` a logit per head and query token from the layer input, ``Linear(D, H)`` (Inkling's
data-dependent sinks). The attention knobs (``qk_norm``, ``output_gate``, ``softcap``, ``ssmax``) are
:mod:`posformer.model.knobs`'.

``switch: {at_step: N, pe: nope}`` (or ``at_fraction: f`` of ``trainer.max_steps``) changes the kind's PE
during training (DroPE, Gelberg et al. 2025, "Dropping positional embeddings after training"): steps
``0 … N-1`` use the kind's ``pe``, every step from ``N`` on (and every checkpoint saved from then, and its
evaluation) the switched one (``pe``, ``pe_options``: ``rope -> nope``, ``rope -> rope {proportion: 0.25}``).
The model applies it (:meth:`~posformer.model.transformer.DecoderOnlyTransformer.apply_switches`) from
the training step alone, so a run resumed across the switch builds what the unbroken run had. Both PEs
must be free of trainable parameters (the optimizer holds the parameters it started with).
Everything here is checked when the config is validated (:meth:`ModelConfig.validate`) and the model is
built, one line per problem, before any work.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.model.knobs import KNOB_KEYS, Knobs, parse_knobs

PLACES = ("decoder", "encoder", "cross")
SPAN_KINDS = ("full", "sliding", "chunked")
TEMPERATURE_KINDS = ("none", "llama4", "logn", "floorlog")
KIND_KEYS = ("pe", "pe_options", "span", "temperature", "sinks", "switch", *KNOB_KEYS)
SWITCH_KEYS = ("at_step", "at_fraction", "pe", "pe_options")
LAYERS_KEYS = ("pattern", *PLACES, *(f"{p}_pattern" for p in PLACES))
#: a layer kind's name names its modules (``decoder_<name>``) and files (figures): no dot, no slash
KIND_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
#: the widest ``span.window`` (int32, what the attention kernels index with); wider is ``span: full``
MAX_WINDOW = 2**31 - 1
#: the settings each temperature kind reads, and the largest value of each (a query scaled by more than
#: this saturates the softmax; an overflowing one trains to NaN)
TEMPERATURE_SETTINGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "llama4": ("floor_scale", "attn_scale"),
    "logn": ("scale", "min"),
    "floorlog": ("alpha", "n_floor"),
}
MAX_TEMPERATURE = {
    "floor_scale": 2.0**40,
    "attn_scale": 100.0,
    "scale": 100.0,
    "min": 100.0,
    "alpha": 100.0,
    "n_floor": 2.0**40,
}
#: settings that count positions: at least 1
AT_LEAST_ONE = ("floor_scale", "n_floor")


@dataclass(frozen=True)
class Span:
    """Which keys a query sees beyond causality: ``full``, ``sliding`` (``window`` keys), ``chunked``."""

    kind: str = "full"
    window: int = 0

    @property
    def full(self) -> bool:
        return self.kind == "full"

    def visible(self, q_at: Tensor, k_at: Tensor, causal: bool) -> Tensor | None:
        """Elementwise: whether a query at ``q_at`` sees a key at ``k_at`` (broadcast): absolute indices
        for ``sliding``, positions for ``chunked``; ``None`` for ``full``. Causality is the caller's mask."""
        q_abs, k_abs = q_at, k_at
        if self.kind == "sliding":
            if causal:
                return k_abs > q_abs - self.window
            return (q_abs - k_abs).abs() <= self.window // 2
        if self.kind == "chunked":
            return torch.div(q_abs, self.window, rounding_mode="floor") == torch.div(
                k_abs, self.window, rounding_mode="floor"
            )
        return None

    def cached_keys(self, seen: int) -> int | None:
        """Causal decoding, ``seen`` tokens so far: how many of the latest keys the next query can still
        see (what a rolling cache keeps); ``None`` for ``full`` (keep all)."""
        if self.kind == "sliding":
            return min(seen, self.window - 1)
        return None

    @property
    def offset_only(self) -> bool:
        """Whether visibility depends on ``i - j`` only (a bias over offsets can fold it in)."""
        return self.kind != "chunked"


@dataclass(frozen=True)
class Temperature:
    """A query scale that grows with the query's position (module docstring)."""

    kind: str = "none"
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    scale: float = 1.0
    min: float = 1.0
    alpha: float = 0.1
    n_floor: float = 128000.0

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def query_scale(self, q_pos: Tensor) -> Tensor:
        """Scale of queries at positions ``q_pos`` (B|1, Tq): float32 (B|1, 1, Tq, 1)."""
        p = q_pos.to(torch.float32)
        if self.kind == "llama4":
            s = torch.log1p(torch.floor((p + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        elif self.kind == "floorlog":
            s = 1.0 + self.alpha * torch.log(((p + 1.0) / self.n_floor).clamp(min=1.0))
        else:  # logn
            s = (self.scale * torch.log(p + 1.0)).clamp_min(self.min)
        return s[:, None, :, None]


@dataclass(frozen=True)
class Switch:
    """A layer kind's PE change during training (module docstring): from step :meth:`step` on, ``pe`` with
    ``pe_options``."""

    pe: str
    pe_options: Mapping[str, Any] = field(default_factory=dict, compare=False)
    at_step: int | None = None
    at_fraction: float | None = None

    def step(self, max_steps: int | None) -> int:
        """The first training step that uses the switched PE (``at_fraction`` of ``max_steps``, rounded)."""
        if self.at_step is not None:
            return self.at_step
        if max_steps is None or max_steps <= 0:
            raise ConfigError(
                f"switch at_fraction={self.at_fraction} needs trainer.max_steps (the training length it is a "
                "fraction of); set trainer.max_steps, or give switch.at_step."
            )
        return int(round(self.at_fraction * max_steps))


@dataclass(frozen=True)
class LayerKind:
    """One named layer kind, resolved (module docstring). ``pe``/``pe_options`` ``None``: the model's."""

    name: str
    pe: str | None = None
    pe_options: Mapping[str, Any] | None = field(default=None, compare=False)
    span: Span = Span()
    temperature: Temperature = Temperature()
    #: ``True`` a learned logit per head, ``"token"`` one per head and token from the layer input
    sinks: bool | str = False
    switch: Switch | None = None
    knobs: Knobs = Knobs()

    @property
    def own_pe(self) -> bool:
        return self.pe is not None or self.pe_options is not None or self.switch is not None


#: the kind of every layer of a place without a schedule: the model's PE, full span, nothing else
DEFAULT_KIND = LayerKind("default")


def _kind_mapping(where: str, raw: Any, valid: set[str], example: str) -> Mapping[str, Any]:
    """``raw`` as a mapping with a ``kind`` (a bare string is the kind), refusing any key outside
    ``valid`` in one line."""
    if isinstance(raw, str):
        raw = {"kind": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}={raw!r} must be a mapping such as {example}.")
    extra = sorted(set(raw) - valid)
    if extra:
        raise ConfigError(f"{where} has unknown key(s) {extra}; valid: {', '.join(sorted(valid))}.")
    return raw


def _span(name: str, raw: Any) -> Span:
    where = f"model.layer_kinds.{name}.span"
    if raw is None:
        return Span()
    raw = _kind_mapping(where, raw, {"kind", "window"}, "{kind: sliding, window: 64}")
    kind = raw.get("kind", "full")
    if kind not in SPAN_KINDS:
        raise ConfigError(f"{where}.kind={kind!r} is unknown; valid: {', '.join(SPAN_KINDS)}.")
    window = raw.get("window")
    if kind == "full":
        if window is not None:
            raise ConfigError(
                f"{where}.window={window!r} has no effect for kind=full; drop it, or use sliding."
            )
        return Span()
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise ConfigError(
            f"{where}.window={window!r} must be a positive integer up to {MAX_WINDOW} (the {kind} width; a "
            "window longer than every sequence is span: full), e.g. window=64."
        )
    return Span(kind, window)


def _temperature(name: str, raw: Any) -> Temperature:
    where = f"model.layer_kinds.{name}.temperature"
    if raw is None:
        return Temperature()
    valid = {"kind", *MAX_TEMPERATURE}
    raw = _kind_mapping(where, raw, valid, "{kind: llama4, floor_scale: 8192}")
    kind = raw.get("kind", "none")
    if kind not in TEMPERATURE_KINDS:
        raise ConfigError(f"{where}.kind={kind!r} is unknown; valid: {', '.join(TEMPERATURE_KINDS)}.")
    values = {k: v for k, v in raw.items() if k != "kind"}
    ignored = sorted(set(values) - set(TEMPERATURE_SETTINGS[kind]))
    if ignored:
        reads = ", ".join(TEMPERATURE_SETTINGS[kind]) or "no setting"
        raise ConfigError(
            f"{where}.{ignored[0]}={values[ignored[0]]!r} has no effect for kind={kind} (it reads {reads}); "
            f"drop it, or use the kind that reads it ({_reader(ignored[0])})."
        )
    for key, value in values.items():
        top = MAX_TEMPERATURE[key]
        low = "1" if key in AT_LEAST_ONE else "0 (exclusive)"
        number = not isinstance(value, bool) and isinstance(value, int | float)
        if (
            not number
            or not math.isfinite(value)
            or not 0 < value <= top
            or (key in AT_LEAST_ONE and value < 1)
        ):
            raise ConfigError(
                f"{where}.{key}={value!r} must be a number from {low} to {top:g}: a negative, zero or "
                "overflowing query temperature trains to NaN or flips attention; Llama 4 uses "
                "floor_scale=8192, attn_scale=0.1, logn scale=1/log(training length)."
            )
    return Temperature(kind, **{k: float(v) for k, v in values.items()})


def _switch(name: str, raw: Any) -> Switch | None:
    where = f"model.layer_kinds.{name}.switch"
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}={raw!r} must be a mapping such as {{at_step: 1000, pe: nope}}.")
    extra = sorted(set(raw) - set(SWITCH_KEYS))
    if extra:
        raise ConfigError(f"{where} has unknown key(s) {extra}; valid: {', '.join(SWITCH_KEYS)}.")
    pe, options = raw.get("pe"), raw.get("pe_options")
    if not isinstance(pe, str):
        raise ConfigError(f"{where}.pe={pe!r} must name the PE the kind switches to (e.g. pe: nope).")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"{where}.pe_options={options!r} must be a mapping of the PE's options.")
    step, fraction = raw.get("at_step"), raw.get("at_fraction")
    if (step is None) == (fraction is None):
        raise ConfigError(f"{where} needs one of at_step or at_fraction (e.g. at_fraction: 0.9), not both.")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"{where}.at_step={step!r} must be a training step >= 0, e.g. at_step=1000.")
    number = not isinstance(fraction, bool) and isinstance(fraction, int | float)
    if fraction is not None and (not number or not 0 <= fraction <= 1):
        raise ConfigError(f"{where}.at_fraction={fraction!r} must be a number from 0 to 1, e.g. 0.9.")
    return Switch(pe, dict(options or {}), step, float(fraction) if fraction is not None else None)


def _reader(key: str) -> str:
    return "kind=" + next(k for k, keys in TEMPERATURE_SETTINGS.items() if key in keys)


def parse_kind(name: str, raw: Any) -> LayerKind:
    """One ``model.layer_kinds`` entry -> :class:`LayerKind`; :class:`ConfigError` for a bad one."""
    where = f"model.layer_kinds.{name}"
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}={raw!r} must be a mapping of {', '.join(KIND_KEYS)}.")
    extra = sorted(set(raw) - set(KIND_KEYS))
    if extra:
        raise ConfigError(f"{where} has unknown key(s) {extra}; valid: {', '.join(KIND_KEYS)}.")
    pe, options = raw.get("pe"), raw.get("pe_options")
    if pe is not None and not isinstance(pe, str):
        raise ConfigError(f"{where}.pe={pe!r} must be a PE name or an import path module:Class.")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"{where}.pe_options={options!r} must be a mapping of the PE's options.")
    sinks = raw.get("sinks", False)
    if not isinstance(sinks, bool) and sinks != "token":
        raise ConfigError(
            f"{where}.sinks={sinks!r} must be true (a learned logit per head), token (per head and token, "
            "from the layer input) or false."
        )
    return LayerKind(
        name,
        pe,
        dict(options) if options is not None else None,
        _span(name, raw.get("span")),
        _temperature(name, raw.get("temperature")),
        sinks,
        _switch(name, raw.get("switch")),
        parse_knobs(where, raw),
    )


def parse_kinds(raw: Mapping[str, Any] | None) -> dict[str, LayerKind]:
    """``model.layer_kinds`` -> name -> :class:`LayerKind`."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"model.layer_kinds={raw!r} must be a mapping: kind name -> settings.")
    for name in raw:
        if not isinstance(name, str) or not KIND_NAME.match(name):
            raise ConfigError(
                f"model.layer_kinds has a kind named {name!r}: a kind name is 1 to 64 letters, digits, _ or "
                "- (starting with a letter or _; no dot or slash: it names the kind's modules and files); "
                f"rename it, e.g. {re.sub(r'[^A-Za-z0-9_-]', '_', str(name))[:64] or 'local'!r}."
            )
    return {name: parse_kind(name, entry) for name, entry in raw.items()}


def layer_plan(
    kinds: Mapping[str, LayerKind], layers: Mapping[str, Any] | None, place: str, depth: int
) -> tuple[LayerKind, ...] | None:
    """The kind of each of the ``depth`` layers of ``place``, or ``None`` (no schedule: the default)."""
    layers = layers or {}
    pattern_key = "pattern" if place == "decoder" and "pattern" in layers else f"{place}_pattern"
    names, key = None, None
    if layers.get(place) is not None:
        names, key = layers[place], place
        if layers.get(pattern_key) is not None:
            raise ConfigError(
                f"model.layers.{place} and model.layers.{pattern_key} both lay out the {place} layers; "
                "keep one."
            )
    elif layers.get(pattern_key) is not None:
        names, key = layers[pattern_key], pattern_key
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, list | tuple) or not names:
        raise ConfigError(f"model.layers.{key}={names!r} must be a non-empty list of layer kind names.")
    unknown = [n for n in names if n not in kinds]
    if unknown:
        valid = ", ".join(kinds) or "none defined (model.layer_kinds is empty)"
        raise ConfigError(
            f"model.layers.{key} names unknown layer kind {unknown[0]!r}; valid: {valid}; "
            "define it under model.layer_kinds."
        )
    if key == place and len(names) != depth:
        raise ConfigError(
            f"model.layers.{key} has {len(names)} entries but the {place} has {depth} layers; list "
            f"{depth} kinds, or use model.layers.{'pattern' if place == 'decoder' else place + '_pattern'} "
            "to repeat a shorter pattern."
        )
    if len(names) > depth:
        raise ConfigError(
            f"model.layers.{key} has {len(names)} entries, more than the {depth} {place} layers; "
            f"shorten the pattern or add layers."
        )
    return tuple(kinds[names[i % len(names)]] for i in range(depth))


def check_layers_keys(layers: Mapping[str, Any] | None, places: tuple[str, ...]) -> None:
    """Refuse ``model.layers`` keys that are unknown or name a place the model kind lacks."""
    if layers is None:
        return
    if not isinstance(layers, Mapping):
        raise ConfigError(f"model.layers={layers!r} must be a mapping such as {{pattern: [local, global]}}.")
    for key, value in layers.items():
        if key not in LAYERS_KEYS:
            raise ConfigError(f"model.layers.{key} is not a layers setting; valid: {', '.join(LAYERS_KEYS)}.")
        place = "decoder" if key == "pattern" else key.removesuffix("_pattern")
        if value is not None and place not in places:
            raise ConfigError(
                f"model.layers.{key} lays out {place} layers, which a model.kind=decoder model does not "
                "have; use model.layers.pattern or model.layers.decoder."
            )


def check_kind_here(kind: LayerKind, place: str, pe_hooks: frozenset[str], pe_name: str) -> None:
    """Refuse a kind that cannot act at ``place`` with its PE (hooks ``pe_hooks``)."""
    where = f"model.layer_kinds.{kind.name}"
    if kind.own_pe and "embed" in pe_hooks:
        raise ConfigError(
            f"{where}.pe={pe_name!r} is added to the embeddings, not applied inside a layer; use a "
            "rotary or bias PE per layer kind (or pe: nope), and set embedding PEs with model.pe."
        )
    if place == "cross" and not kind.span.full:
        raise ConfigError(
            f"{where}.span.kind={kind.span.kind!r} is used by a cross-attention layer, where queries and "
            "keys are different sequences (no index distance); use span: {kind: full} for cross layers."
        )
    if place == "cross" and kind.temperature.active:
        raise ConfigError(
            f"{where}.temperature is used by a cross-attention layer; position temperatures are for "
            "self-attention layers: drop it from the cross layers' kind."
        )
