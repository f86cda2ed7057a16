"""Which positional encoding each attention layer uses: one construction path, one table.

A model has one attention *place* (decoder-only: ``decoder``) or three (encoder-decoder: ``encoder``,
``decoder``, ``cross``). At each place the model's PE (``model.pe``) acts where ``model.pe_apply`` says
(:meth:`~posformer.model.config.ModelConfig.pe_applies`), and the layers of a kind with a PE of its
own (``model.layer_kinds``, :mod:`posformer.model.schedule`) use that one. :func:`build_layer_pes`
builds every one of them through :func:`build_pe` (a place's model facts: width, heads, causal, depth)
and returns the table the model reads: :meth:`LayerPEs.place` for the embeddings, the range checks and
the decoding cache, :meth:`LayerPEs.layer` for each layer's attention context.

The model registers the instances as submodules under the names its checkpoints use
(:meth:`LayerPEs.modules`): ``pe`` (decoder-only), ``pe_enc``, ``pe_dec``, ``pe_cross`` (encoder-decoder),
and ``pes.<place>_<kind>`` for the kinds' own. Kinds with the same PE settings share one instance, and a
kind whose settings are the model's uses the place's PE, so a uniform schedule builds exactly the
modules of a model without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posformer.errors import ConfigError
from posformer.model.config import ModelConfig
from posformer.model.schedule import LayerKind
from posformer.pe import build_encoding, get_encoding_class
from posformer.pe.base import PositionalEncoding

#: each model kind's places, in the order their PEs are built, and the submodule name of each place's PE
PLACE_MODULES = {
    "decoder": {"decoder": "pe"},
    "encoder_decoder": {"encoder": "pe_enc", "decoder": "pe_dec", "cross": "pe_cross"},
}


@dataclass(frozen=True)
class LayerPEs:
    """The PEs of one model (module docstring). ``None`` wherever no PE acts.

    Attributes:
        places: place -> the model's PE there.
        kinds: (place, layer kind name) -> the PE of that kind's layers.
        own: ``<place>_<kind>`` -> a kind's own PE (the model's ``pes`` module dict).
    """

    places: dict[str, PositionalEncoding | None]
    kinds: dict[tuple[str, str], PositionalEncoding | None]
    own: dict[str, PositionalEncoding]

    def place(self, place: str) -> PositionalEncoding | None:
        """The model's PE at ``place`` (embeddings, position checks, the decoding cache)."""
        return self.places[place]

    def layer(self, place: str, kind: LayerKind) -> PositionalEncoding | None:
        """The PE of the layers of ``kind`` at ``place`` (their attention context)."""
        return self.kinds[(place, kind.name)]

    def modules(self, model_kind: str) -> list[tuple[str, nn.Module | None]]:
        """(submodule name, PE) to register, in order: each place's PE, then the kinds' own (one
        ``ModuleDict``, absent when no kind has a PE of its own)."""
        out: list[tuple[str, nn.Module | None]] = [
            (name, self.places[place]) for place, name in PLACE_MODULES[model_kind].items()
        ]
        return out + ([("pes", nn.ModuleDict(self.own))] if self.own else [])


#: PEs the config's check built (:func:`check_layer_pes`) whose construction drew nothing from torch's
#: RNG, by their settings: the next model built with the same settings takes the instance
_CHECKED: dict[str, PositionalEncoding] = {}


def build_pe(
    cfg: ModelConfig, place: str, name: str, options: dict[str, Any], check: bool = False
) -> PositionalEncoding:
    """The PE ``name`` with ``options`` for the layers of ``place``: the place's model facts (width, heads,
    causal in the decoder, the place's depth) and the PE's options. A model takes the instance the check
    built for the same settings when there is one; ``check``: built with torch's RNG forked, and kept
    for the model when its construction drew nothing (one that drew is built again at its place in the
    model's seeded stream, so a seed keeps its weights)."""
    shape = {"d_model": cfg.d_model, "n_heads": cfg.n_heads, "causal": place == "decoder"}
    shape["n_layers"] = cfg.depth(place)
    key = repr((name, sorted(options.items()), sorted(shape.items())))
    if not check:
        checked = _CHECKED.pop(key, None)
        return checked if checked is not None else build_encoding(name, **shape, **options)
    with torch.random.fork_rng(devices=[]):
        before = torch.get_rng_state()
        pe = build_encoding(name, **shape, **options)
        if torch.equal(before, torch.get_rng_state()):
            _CHECKED[key] = pe
    return pe


def check_layer_pes(cfg: ModelConfig) -> LayerPEs:
    """Every PE of a model of ``cfg``, built as the model builds them (their own checks speak) without
    changing torch's RNG; the model of these settings takes the instances that drew nothing from it."""
    _CHECKED.clear()  # one check's instances at a time
    check_pe_apply(cfg)
    return build_layer_pes(cfg, check=True)


def check_pe_apply(cfg: ModelConfig) -> None:
    """Refuse a ``model.pe_apply`` that applies the model's PE where it cannot act (an embedding PE in
    cross-attention) or nowhere (a PE with hooks)."""
    places = tuple(PLACE_MODULES[cfg.kind])
    hooks = get_encoding_class(cfg.pe).capabilities.hooks
    if not hooks:
        return
    if "embed" in hooks and cfg.pe_applies("cross"):
        raise ConfigError(
            f"model.pe_apply.cross=true has no effect for pe={cfg.pe!r}: it is added to the embeddings, "
            "not applied inside attention. Set model.pe_apply.cross=false."
        )
    if not any(cfg.pe_applies(p) for p in places):
        raise ConfigError(
            f"pe={cfg.pe!r} is applied nowhere: model.pe_apply={dict(cfg.pe_apply)} disables "
            f"{', '.join(places)}. Enable one of them, or use pe=nope for no positions."
        )


def build_layer_pes(cfg: ModelConfig, check: bool = False) -> LayerPEs:
    """Every PE of a model of ``cfg``: each place's (where ``model.pe_apply`` applies a PE with hooks), then
    each place's layer kinds' own, in the order the kinds first appear (module docstring). A PE without
    hooks (NoPE) is ``None``."""
    places = PLACE_MODULES[cfg.kind]
    with_hooks = bool(get_encoding_class(cfg.pe).capabilities.hooks)
    defaults = {
        place: build_pe(cfg, place, cfg.pe, cfg.pe_options, check)
        if with_hooks and cfg.pe_applies(place)
        else None
        for place in places
    }
    kinds: dict[tuple[str, str], PositionalEncoding | None] = {}
    own: dict[str, PositionalEncoding] = {}
    for place in places:
        for kind, pe, new in _kind_pes(cfg, place, defaults[place], check):
            kinds[(place, kind)] = pe
            if new:
                own[f"{place}_{kind}"] = pe
    return LayerPEs(defaults, kinds, own)


def _kind_pes(
    cfg: ModelConfig, place: str, default: PositionalEncoding | None, check: bool = False
) -> list[tuple[str, PositionalEncoding | None, bool]]:
    """(kind name, its PE, whether the kind built it) for each kind of ``place``'s plan, in the order the
    kinds first appear. A kind without its own PE uses the place's ``default``; kinds with the same PE
    settings share one instance, built when the first of them appears, and settings equal to the model's
    reuse ``default``."""
    built: dict[str, PositionalEncoding | None] = {}
    if default is not None:
        built[repr((cfg.pe, sorted(cfg.pe_options.items())))] = default
    out = []
    for kind in dict.fromkeys(cfg.plan(place)):
        if not kind.own_pe:
            out.append((kind.name, default, False))
            continue
        name, options = cfg.kind_pe(kind)
        key = repr((name, sorted(options.items()), *((kind.name,) if kind.switch else ())))  # switch: own
        new = key not in built
        if new:
            try:
                pe = build_pe(cfg, place, name, options, check)
            except ConfigError as exc:  # name the kind whose settings were refused
                raise ConfigError(f"model.layer_kinds.{kind.name} ({place} layers): {exc}") from None
            built[key] = pe if pe.caps.hooks else None
            if kind.switch is not None and check:
                check_switch(cfg, place, kind, pe)
        out.append((kind.name, built[key], new and built[key] is not None))
    return out


def _trainable(pe: PositionalEncoding | None) -> int:
    return sum(p.numel() for p in pe.parameters() if p.requires_grad) if pe is not None else 0


def switched_pe(cfg: ModelConfig, place: str, kind: LayerKind) -> PositionalEncoding | None:
    """The PE of ``kind``'s layers after its switch (``None``: a PE without hooks, NoPE)."""
    switch = kind.switch
    try:
        pe = build_pe(cfg, place, switch.pe, dict(switch.pe_options))
    except ConfigError as exc:
        raise ConfigError(f"model.layer_kinds.{kind.name}.switch ({place} layers): {exc}") from None
    return pe if pe.caps.hooks else None


def check_switch(cfg: ModelConfig, place: str, kind: LayerKind, before: PositionalEncoding) -> None:
    """Refuse a switch whose PEs have trainable parameters (the optimizer holds the parameters it was
    built with: a PE that leaves would keep stale state, one that arrives would never train)."""
    with torch.random.fork_rng(devices=[]):
        after = switched_pe(cfg, place, kind)
    for which, pe, name in (("from", before, kind.pe or cfg.pe), ("to", after, kind.switch.pe)):
        if _trainable(pe):
            raise ConfigError(
                f"model.layer_kinds.{kind.name}.switch {which} pe={name!r}: a PE with trainable parameters "
                f"({_trainable(pe)}) cannot switch during training (the optimizer holds the parameters it "
                "started with); switch between parameter-free PEs (rope -> nope, rope -> rope with "
                "pe_options.proportion)."
            )


def apply_switches(model: nn.Module, step: int, max_steps: int | None = None) -> list[str]:
    """The PEs of training step ``step`` in ``model`` (a posformer model: its ``cfg`` and ``layer_pes``):
    every layer kind with a switch (:class:`~posformer.model.schedule.Switch`; a fraction is of
    ``max_steps``) gets its switched PE from the switch's step on and its own before it, whatever the model
    had (a resumed run, a best checkpoint saved before the switch). Returns the ``<place>_<kind>`` names
    changed by this call. Host facts only (no tensor is read)."""
    before = model.__dict__.setdefault("_before_switch", {})  # name -> the kind's own PE, once switched
    changed = []
    for place in model.layer_pes.places:
        for kind in dict.fromkeys(model.cfg.plan(place)):
            name = f"{place}_{kind.name}"
            if kind.switch is None or (step >= kind.switch.step(max_steps)) == (name in before):
                continue
            if name in before:  # back to the kind's own PE
                pe = before.pop(name)
            else:
                before[name] = model.layer_pes.kinds[(place, kind.name)]
                pe = switched_pe(model.cfg, place, kind)
                pe = pe.to(next(model.parameters()).device) if pe is not None else None
            _set_kind_pe(model, place, kind.name, pe)
            changed.append(name)
    return changed


def _set_kind_pe(model: nn.Module, place: str, kind: str, pe: PositionalEncoding | None) -> None:
    """The PE of ``kind``'s layers at ``place`` (the table, and the ``pes`` modules checkpoints hold)."""
    name = f"{place}_{kind}"
    model.layer_pes.kinds[(place, kind)] = pe
    model.layer_pes.own.pop(name, None)
    own = getattr(model, "pes", None)
    if own is not None and name in own:
        del own[name]
    if pe is not None:
        model.layer_pes.own[name] = pe
        if own is None:
            model.pes = own = nn.ModuleDict()
        own[name] = pe
