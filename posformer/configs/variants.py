"""Named variants: a PE with its options, or a model preset (a per-layer schedule), under a name the user
chooses, and the one place a run's label is computed (:func:`run_label`).

A variant is the ``variant`` section of the training config: ``+variant=<file>`` from the ``variant``
group (``configs/variant/``: rope, prope, irope, alibi, nope, t5, fire; a user's own with
``--config-dir``), or inline, ``+variant={name:my,pe:alibi,pe_options:{biased_heads:2}}``::

    name: prope                 # the label of the run everywhere: progress, tables, figures, TensorBoard
    pe: rope                    # optional: replaces model.pe, and model.pe_options by pe_options
    pe_options: {proportion: 0.25}   # without pe: merged over model.pe_options
    model: {layers: {pattern: [...]}}   # optional: merged over the model section

:func:`apply_variant` applies it to the composed config before it is read, so ``config.yaml`` holds the
model the run trains and the variant it came from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from posformer.errors import ConfigError
from posformer.model.config import describe_schedule

__all__ = ["VARIANT_KEYS", "apply_variant", "run_label", "variant_name"]

#: the keys a variant may set
VARIANT_KEYS = ("name", "pe", "pe_options", "model")
#: a variant name: what it may hold (it names a TensorBoard folder and a table row)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` (mappings key by key, anything else replaced); plain values."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def check_variant(variant: Any) -> dict[str, Any] | None:
    """``variant`` (``None``, or a mapping with a ``name``) as a plain dict; else one :class:`ConfigError`."""
    if variant is None:
        return None
    example = "e.g. +variant=prope, or +variant={name:my,pe:alibi}"
    if not isinstance(variant, Mapping):
        raise ConfigError(f"variant={variant!r} is not a mapping; give a file or a mapping, {example}.")
    unknown = sorted(set(map(str, variant)) - set(VARIANT_KEYS))
    if unknown:
        raise ConfigError(
            f"variant.{unknown[0]} is not a variant key (valid: {', '.join(VARIANT_KEYS)}); model settings "
            f"go under variant.model, e.g. +variant.model.{unknown[0]}=..."
        )
    name = variant.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"variant.name={name!r} is not a name (limit: letters, digits and . _ + -, starting with a "
            f"letter or digit); name the variant, {example}."
        )
    for key in ("pe_options", "model"):
        if variant.get(key) is not None and not isinstance(variant[key], Mapping):
            raise ConfigError(f"variant.{key}={variant[key]!r} is not a mapping; e.g. variant.{key}={{...}}.")
    if variant.get("pe") is not None and not isinstance(variant["pe"], str):
        raise ConfigError(f"variant.pe={variant['pe']!r} is not a PE name; e.g. variant.pe=alibi.")
    return {"name": name, **variant}  # the name first (config.yaml)


def apply_variant(given: Mapping[str, Any]) -> dict[str, Any]:
    """The composed config (plain values) with its ``variant`` applied to ``model``: ``pe`` replaces
    ``model.pe`` and ``model.pe_options`` (by ``pe_options``, or none), ``pe_options`` alone is merged over
    ``model.pe_options``, ``model`` over the model section; no variant: ``given`` as it is."""
    out = dict(given)
    variant = check_variant(out.get("variant"))
    if variant is None:
        return out
    out["variant"] = variant
    model = dict(out.get("model") or {})
    if variant.get("pe") is not None:
        model["pe"], model["pe_options"] = variant["pe"], dict(variant.get("pe_options") or {})
    elif variant.get("pe_options"):
        model["pe_options"] = _merge(model.get("pe_options") or {}, variant["pe_options"])
    out["model"] = _merge(model, variant.get("model") or {})
    return out


def variant_name(variant: Any) -> str | None:
    """The name of a variant (a mapping, a name) or ``None``."""
    if isinstance(variant, Mapping):
        variant = variant.get("name")
    return str(variant) if variant else None


def run_label(model: Mapping[str, Any], variant: Any = None) -> str:
    """A run's label: its variant's name when it has one; else its PE (a per-layer schedule:
    ``rope×3+nope×1``, :func:`~posformer.model.config.describe_schedule`)."""
    return variant_name(variant) or describe_schedule(model)
