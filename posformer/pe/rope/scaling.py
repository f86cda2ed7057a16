"""Context-extension scalings for rotary PEs (selected with ``pe.scaling.type``).

A plain registry dict ``ROPE_SCALINGS`` maps a name to a function
``f(rope, cfg, seq_len, device) -> (inv_freq float64 (R/2,), attention_factor)``. Notation: ``θ_i =
base^(-2i/R)`` are the unscaled frequencies, ``s = factor``, ``L = original_max_len`` (the training
context), ``R`` the rotary dims.

``linear``       Position interpolation (Chen et al. 2023): ``θ'_i = θ_i / s`` (positions squeezed by s).
``ntk``          NTK-aware base scaling (bloc97 2023): ``base' = base · s^(R/(R-2))``.
``dynamic_ntk``  NTK with ``s`` chosen per length (Emozilla 2023): for ``T > L``,
                 ``base' = base · (s·T/L - (s-1))^(R/(R-2))``; unchanged for ``T <= L``.
``yarn``         YaRN (Peng et al. 2023): per-frequency blend of interpolation and extrapolation
                 with a linear ramp ``γ_i`` between the dims that rotate ``beta_fast`` and
                 ``beta_slow`` times within ``L``: ``θ'_i = θ_i/s · (1-γ_i) + θ_i · γ_i``; cos/sin
                 (hence the logits' temperature) scaled by ``0.1 ln s + 1``.
``llama3``       Llama 3.1 scaling: wavelengths ``λ_i = 2π/θ_i`` longer than ``L/low_freq_factor``
                 are divided by ``s``, shorter than ``L/high_freq_factor`` kept, and the band in
                 between smoothly interpolated.
``longrope``     LongRoPE (Ding et al. 2024; HF's ``longrope``): per-dimension factors,
                 ``θ'_i = θ_i / λ_i`` with ``λ = long_factor`` for sequences longer than ``L`` and
                 ``short_factor`` otherwise (so it depends on the length); cos/sin scaled by
                 ``sqrt(1 + ln s / ln L)`` (1 for ``s <= 1``) unless ``attention_factor`` is given.

HF ``rope_scaling`` dicts are accepted verbatim (:mod:`posformer.pe.rope.hf` maps their names).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from posformer.errors import ConfigError

ScalingFn = Callable[[Any, dict, int, "torch.device | None"], tuple[Tensor, float]]


def _ntk_exponent(rope: Any) -> float:
    r = rope.rotary_dim
    return r / (r - 2) if r > 2 else 1.0


def _inv_freq(base: float, rotary_dim: int, device: torch.device | None) -> Tensor:
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
    return base ** (-i / rotary_dim)


def linear(rope: Any, cfg: dict, seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    return rope.base_inv_freq(device) / cfg["factor"], 1.0


def ntk(rope: Any, cfg: dict, seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    base = rope.base * cfg["factor"] ** _ntk_exponent(rope)
    return _inv_freq(base, rope.rotary_dim, device), 1.0


def dynamic_ntk(rope: Any, cfg: dict, seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    s, L = cfg["factor"], cfg["original_max_len"]
    if seq_len <= L:
        return rope.base_inv_freq(device), 1.0
    base = rope.base * (s * seq_len / L - (s - 1)) ** _ntk_exponent(rope)
    return _inv_freq(base, rope.rotary_dim, device), 1.0


def yarn(rope: Any, cfg: dict, seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    s, L, r = cfg["factor"], cfg["original_max_len"], rope.rotary_dim
    beta_fast, beta_slow = cfg.get("beta_fast", 32.0), cfg.get("beta_slow", 1.0)

    def correction_dim(rotations: float) -> float:
        # the dim index whose wavelength fits `rotations` times into L
        return (r * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(rope.base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), r - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(r // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # γ_i: 1 for high-frequency dims (kept), 0 for low-frequency (interpolated)
    theta = rope.base_inv_freq(device)
    inv_freq = theta / s * (1 - extrapolate) + theta * extrapolate
    attention_factor = cfg.get("attention_factor") or (0.1 * math.log(s) + 1.0)
    return inv_freq, float(attention_factor)


def llama3(rope: Any, cfg: dict, seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    s, L = cfg["factor"], cfg["original_max_len"]
    low_ff, high_ff = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    theta = rope.base_inv_freq(device)
    wavelen = 2 * math.pi / theta
    low_wavelen, high_wavelen = L / low_ff, L / high_ff
    scaled = torch.where(wavelen > low_wavelen, theta / s, theta)
    smooth = (L / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / s + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def longrope(rope: Any, cfg: dict, seq_len: int, device: torch.device | None) -> tuple[Tensor, float]:
    L = cfg["original_max_len"]
    factors = cfg["long_factor" if seq_len > L else "short_factor"]  # (R/2,)
    ext = torch.tensor(factors, dtype=torch.float64, device=device)
    s = cfg.get("factor") or 1.0
    attention_factor = cfg.get("attention_factor") or (
        1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(L))
    )
    return rope.base_inv_freq(device) / ext, float(attention_factor)


ROPE_SCALINGS: dict[str, ScalingFn] = {
    "linear": linear,
    "ntk": ntk,
    "dynamic_ntk": dynamic_ntk,
    "yarn": yarn,
    "llama3": llama3,
    "longrope": longrope,
}
_NEEDS_ORIGINAL = {"dynamic_ntk", "yarn", "llama3", "longrope"}
#: scalings whose frequencies depend on the sequence length (a position's rotation changes as the
#: sequence grows): the PE declares ``caps.rotary_depends_on_length`` under them
LENGTH_DEPENDENT = frozenset({"dynamic_ntk", "longrope"})


def depends_on_length(cfg: dict | None) -> bool:
    """Whether the scaling ``cfg`` (``None``: unscaled) makes the rotation depend on the sequence length."""
    return bool(cfg) and cfg.get("type") in LENGTH_DEPENDENT


def validate_scaling(cfg: dict, pe_name: str = "rope", rotary_dim: int | None = None) -> None:
    """Raise :class:`ConfigError` for an unknown scaling type, a bad factor or bad longrope factor lists
    (checked against ``rotary_dim / 2`` entries when ``rotary_dim`` is given)."""
    kind = cfg.get("type")
    if kind in (None, "none"):
        return
    if kind not in ROPE_SCALINGS:
        raise ConfigError(
            f"pe={pe_name!r}: unknown scaling.type={kind!r}; valid: none, {', '.join(ROPE_SCALINGS)}."
        )
    if kind == "longrope":
        _validate_longrope(cfg, pe_name, rotary_dim)
    factor = cfg.get("factor")
    if kind == "longrope" and factor is None and cfg.get("attention_factor"):
        factor = 1.0  # HF derives it from the model config; the attention factor is given instead
    if not _number(factor) or not 1 <= factor <= MAX_FACTOR:
        raise ConfigError(
            f"pe={pe_name!r}: scaling.factor={factor!r} must be a number from 1 to 2**31 = {MAX_FACTOR} "
            "(target length / training length, e.g. 4; a larger one overflows the scaled frequencies "
            "to inf or 0)."
        )
    if kind in _NEEDS_ORIGINAL and not cfg.get("original_max_len"):
        raise ConfigError(
            f"pe={pe_name!r}: scaling.type={kind!r} needs scaling.original_max_len (the training context "
            "length, e.g. 512)."
        )
    _check_ranges(cfg, pe_name)


#: the largest scaling factor (and original_max_len): a target length of 2**31 positions from one
MAX_FACTOR = 2**31
#: the other numbers of a scaling: (smallest, largest, what it is); each must be finite
_RANGES: dict[str, tuple[float, float, str]] = {
    "original_max_len": (1, MAX_FACTOR, "the training context length, e.g. 512"),
    "low_freq_factor": (1e-6, 1e6, "e.g. 1"),
    "high_freq_factor": (1e-6, 1e6, "e.g. 4"),
    "beta_fast": (1e-6, 1e6, "e.g. 32"),
    "beta_slow": (1e-6, 1e6, "e.g. 1"),
    "attention_factor": (1e-6, 1e3, "a cos/sin multiplier, e.g. 1.1"),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_ranges(cfg: dict, pe_name: str) -> None:
    """Every number of the scaling finite and in its range (a 1e308 overflowed to inf or NaN in the
    frequencies, or made the attention factor 72), and llama3's band not empty."""
    for key, (low, high, example) in _RANGES.items():
        value = cfg.get(key)
        if value is None:
            continue
        if not _number(value) or not low <= value <= high:
            raise ConfigError(
                f"pe={pe_name!r}: scaling.{key}={value!r} must be a finite number from {low:g} to {high:g} "
                f"({example}); larger values overflow the scaled frequencies."
            )
    for key in ("short_factor", "long_factor"):
        bad = [v for v in cfg.get(key) or [] if not _number(v) or not 0 < v <= MAX_FACTOR]
        if bad:
            raise ConfigError(
                f"pe={pe_name!r}: scaling.{key} holds {bad[:3]!r}; every factor must be a finite number "
                f"above 0 and at most 2**31 = {MAX_FACTOR}."
            )
    if cfg.get("type") == "llama3":
        low, high = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
        if not low < high:
            raise ConfigError(
                f"pe={pe_name!r}: scaling.low_freq_factor={low!r} must be below scaling.high_freq_factor="
                f"{high!r} (the band between them is smoothed; equal ones divide by zero), e.g. 1 and 4."
            )


def _validate_longrope(cfg: dict, pe_name: str, rotary_dim: int | None) -> None:
    for key in ("short_factor", "long_factor"):
        values = cfg.get(key)
        if not isinstance(values, (list, tuple)) or not values or min(values) <= 0:
            raise ConfigError(
                f"pe={pe_name!r}: scaling.type='longrope' needs scaling.{key}, a list of positive factors "
                f"(one per rotary pair), got {values!r}."
            )
        if rotary_dim is not None and len(values) != rotary_dim // 2:
            raise ConfigError(
                f"pe={pe_name!r}: scaling.{key} has {len(values)} entries, but the PE rotates {rotary_dim} "
                f"dims = {rotary_dim // 2} pairs; give one factor per pair (or change d_model/n_heads/"
                "rotary_fraction to the checkpoint's head_dim)."
            )
    if cfg.get("factor") is None and not cfg.get("attention_factor"):
        raise ConfigError(
            f"pe={pe_name!r}: scaling.type='longrope' needs scaling.factor (HF: max_position_embeddings / "
            "original_max_position_embeddings, e.g. 131072 / 4096 = 32) or scaling.attention_factor."
        )


def apply_scaling(rope: Any, seq_len: int, device: torch.device | None) -> tuple[Tensor, float, tuple]:
    """Scaled (inv_freq, attention_factor, cache key) for a rotary PE with ``rope.scaling`` set."""
    cfg = rope.scaling
    kind = cfg.get("type")
    if kind in (None, "none"):
        return rope.base_inv_freq(device), 1.0, ()
    inv_freq, factor = ROPE_SCALINGS[kind](rope, cfg, seq_len, device)
    key: tuple = (kind, *sorted((k, v) for k, v in cfg.items() if k != "type"))
    if kind == "dynamic_ntk":
        key = (*key, max(seq_len, cfg["original_max_len"]))
    if kind == "longrope":  # short or long factors
        key = (*key, seq_len > cfg["original_max_len"])
    return inv_freq, factor, key
