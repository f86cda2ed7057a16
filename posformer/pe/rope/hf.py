"""HF ``rope_scaling`` / ``rope_parameters`` dicts, accepted verbatim as ``model.pe_options.scaling``.

A Llama/Qwen/Phi config's ``rope_scaling`` can be copy-pasted: :func:`normalize_scaling` maps HF's
names onto posformer's (:mod:`posformer.pe.rope.scaling`) before validation, and leaves a posformer
dict as it is. HF's names and their posformer counterparts:

==================================== =======================================================
HF                                   posformer
==================================== =======================================================
``rope_type`` / ``type``             ``type`` (``default`` -> none, ``dynamic`` -> ``dynamic_ntk``;
                                     ``linear``, ``yarn``, ``llama3``, ``longrope`` as they are)
``original_max_position_embeddings`` ``original_max_len``
``mscale``, ``mscale_all_dim``       folded into ``attention_factor`` as HF does (YaRN)
``short_factor``, ``long_factor``    kept, as tuples (hashable cache keys)
``rope_theta``                       must equal the PE's ``base`` (set ``model.pe_options.base``)
``truncate``                         only ``true`` (HF's default; posformer's YaRN always truncates)
==================================== =======================================================

``factor``, ``attention_factor``, ``beta_fast``, ``beta_slow``, ``low_freq_factor`` and
``high_freq_factor`` mean the same in both. Any other key is refused with the list of valid ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from posformer.errors import ConfigError

#: HF rope type -> posformer scaling type (None: unscaled)
HF_TYPES: dict[str, str | None] = {
    "default": None,
    "none": None,
    "linear": "linear",
    "dynamic": "dynamic_ntk",
    "yarn": "yarn",
    "llama3": "llama3",
    "longrope": "longrope",
}
#: keys that mean the same in posformer and HF
SHARED_KEYS = frozenset(
    {"factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"}
)
NATIVE_KEYS = SHARED_KEYS | {"type", "original_max_len", "short_factor", "long_factor"}
HF_KEYS = SHARED_KEYS | {
    "rope_type",
    "type",
    "original_max_position_embeddings",
    "short_factor",
    "long_factor",
    "mscale",
    "mscale_all_dim",
    "rope_theta",
    "truncate",
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """HF's YaRN ``get_mscale``: ``0.1 · mscale · ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def normalize_scaling(
    cfg: Mapping[str, Any] | None, pe_name: str = "rope", *, base: float | None = None
) -> dict[str, Any] | None:
    """posformer's scaling dict for ``cfg`` (posformer's or HF's names); ``None`` for no scaling.

    Raises :class:`ConfigError` naming the key for unknown keys or types, a ``rope_theta`` that
    differs from ``base``, or ``truncate: false``.
    """
    if not cfg:
        return None
    cfg = dict(cfg)
    unknown = sorted(set(cfg) - HF_KEYS - NATIVE_KEYS)
    if unknown:
        raise ConfigError(
            f"pe={pe_name!r}: scaling has unknown key(s) {', '.join(unknown)}; valid: "
            f"{', '.join(sorted(NATIVE_KEYS))} (or HF's {', '.join(sorted(HF_KEYS - NATIVE_KEYS))})."
        )
    if "rope_type" in cfg and "type" in cfg and cfg["rope_type"] != cfg["type"]:
        raise ConfigError(
            f"pe={pe_name!r}: scaling.rope_type={cfg['rope_type']!r} and scaling.type={cfg['type']!r} "
            "disagree; give one of them."
        )
    kind = cfg.pop("rope_type", None) or cfg.get("type")
    cfg.pop("type", None)
    # posformer's own names (and unknown ones, which validate_scaling reports) pass through
    out_type = HF_TYPES.get(kind, kind) if kind is not None else None
    theta = cfg.pop("rope_theta", None)
    if theta is not None and base is not None and float(theta) != float(base):
        raise ConfigError(
            f"pe={pe_name!r}: scaling.rope_theta={theta} differs from the PE's base={base}; set "
            f"model.pe_options.base={theta} (the rotary base is not a scaling option)."
        )
    if cfg.pop("truncate", True) is not True:
        raise ConfigError(
            f"pe={pe_name!r}: scaling.truncate=false is not supported (posformer's YaRN rounds the "
            "correction range like HF's default truncate=true); drop the key."
        )
    if "original_max_position_embeddings" in cfg:
        cfg["original_max_len"] = int(cfg.pop("original_max_position_embeddings"))
    mscale, mscale_all = cfg.pop("mscale", None), cfg.pop("mscale_all_dim", None)
    if out_type == "yarn" and cfg.get("attention_factor") is None and mscale and mscale_all:
        s = float(cfg.get("factor", 1.0))
        cfg["attention_factor"] = _yarn_mscale(s, mscale) / _yarn_mscale(s, mscale_all)
    for key in ("short_factor", "long_factor"):
        if key in cfg:
            cfg[key] = tuple(float(v) for v in cfg[key])
    if out_type is None:
        return None
    return {"type": out_type, **cfg}
