"""Attention knobs that change what positions do, per layer kind and model-wide (all off by default).

Set per layer kind (``model.layer_kinds.<kind>.<knob>``) or for every layer (``model.attention_knobs``;
a kind's own setting wins):

* ``qk_norm`` (Henry et al. 2020; x-transformers ``qk_norm``): queries and keys L2-normalised per head
  before the rotation, the score ``g · q̂·k̂`` with a fixed scale ``g`` (``true``: 10, x-transformers'
  ``qk_norm_scale``; or a number);
* ``output_gate`` (Qiu et al. 2025, "Gated attention for large language models", head-wise G1): the
  attention output of head ``h`` times ``sigmoid(w_h · x)``, ``x`` the layer's input (x-transformers
  ``gate_values=True, gate_values_headwise=True``);
* ``softcap`` (Gemma 2; x-transformers ``softclamp_logits``): scores ``c · tanh(s / c)`` after the
  bias, before the masks (explicit softmax);
* ``ssmax`` (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention"): queries times
  ``s_h · log n_i`` with a learned ``s_h`` per head, ``n_i`` the number of keys query ``i`` sees under
  its masks (causal, window or chunk, document, padding: :meth:`AttentionContext.visible_counts`);
  ``true``: ``s_h`` starts at 1, a number sets its start (1 / log(training length) keeps the
  training-length softmax).

A ``temperatures_only`` fine-tuning run (``train.temperatures_only``) trains the ``ssmax`` parameters
alone (:func:`temperature_parameters`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError

KNOB_KEYS = ("qk_norm", "output_gate", "softcap", "ssmax")
#: ``qk_norm: true``: x-transformers' fixed scale of the normalised scores
QK_NORM_SCALE = 10.0
#: ``ssmax: true``: the start of every head's learned scale
SSMAX_INIT = 1.0
#: the name every SSMax parameter ends with (what ``temperatures_only`` trains)
TEMPERATURE_PARAMETER = "ssmax_scale"


@dataclass(frozen=True)
class Knobs:
    """One layer's knobs; ``None`` is unset (the model-wide setting, else off). Numbers are resolved:
    ``qk_norm`` the score scale, ``softcap`` the cap, ``ssmax`` the start of ``s_h``."""

    qk_norm: float | None = None
    output_gate: bool | None = None
    softcap: float | None = None
    ssmax: float | None = None

    def over(self, model_wide: Knobs) -> Knobs:
        """These settings, the model-wide ones where unset."""
        return Knobs(*(_pick(getattr(self, f.name), getattr(model_wide, f.name)) for f in fields(self)))

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


#: every knob off (a layer without knobs)
NO_KNOBS = Knobs()


def _pick(own: Any, wide: Any) -> Any:
    return wide if own is None else own


def _positive(where: str, key: str, value: Any, default: float, example: str) -> float:
    """``false``: 0 (off, also over a model-wide setting); ``true``: ``default``; else a positive number."""
    if value is False:
        return 0.0
    if value is True:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"{where}.{key}={value!r} must be true, false or a positive number, e.g. {example}."
        )
    return float(value)


def parse_knobs(where: str, raw: Mapping[str, Any]) -> Knobs:
    """The knob keys of ``raw`` (a layer kind's mapping or ``model.attention_knobs``) -> :class:`Knobs`;
    :class:`ConfigError` in one line for a bad value."""
    gate = raw.get("output_gate")
    if gate is not None and not isinstance(gate, bool):
        raise ConfigError(f"{where}.output_gate={gate!r} must be true or false.")
    cap = raw.get("softcap")
    if cap is True:
        raise ConfigError(f"{where}.softcap=True needs the cap, a positive number, e.g. softcap=50.")
    return Knobs(
        qk_norm=_positive(where, "qk_norm", raw["qk_norm"], QK_NORM_SCALE, "qk_norm=10")
        if "qk_norm" in raw
        else None,
        output_gate=gate,
        softcap=_positive(where, "softcap", cap, 0.0, "softcap=50") if cap is not None else None,
        ssmax=_positive(where, "ssmax", raw["ssmax"], SSMAX_INIT, "ssmax=0.2") if "ssmax" in raw else None,
    )


def model_knobs(raw: Mapping[str, Any] | None) -> Knobs:
    """``model.attention_knobs`` -> :class:`Knobs`, refusing unknown keys in one line."""
    if not raw:
        return Knobs()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"model.attention_knobs={raw!r} must be a mapping such as {{qk_norm: true}}.")
    extra = sorted(set(raw) - set(KNOB_KEYS))
    if extra:
        raise ConfigError(f"model.attention_knobs has unknown key(s) {extra}; valid: {', '.join(KNOB_KEYS)}.")
    return parse_knobs("model.attention_knobs", raw)


def temperature_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's temperature parameters (the ``ssmax`` scales of its attention layers)."""
    return [(n, p) for n, p in model.named_parameters() if n.endswith(TEMPERATURE_PARAMETER)]


def freeze_all_but_temperatures(model: nn.Module) -> list[str]:
    """``temperatures_only``: every parameter but the temperatures stops training; returns their names.
    :class:`ConfigError` when the model has none (no layer with ``ssmax``)."""
    names = [n for n, _ in temperature_parameters(model)]
    if not names:
        raise ConfigError(
            "train.temperatures_only=true trains the SSMax temperatures, but this model has none; set "
            "model.attention_knobs.ssmax=true (or ssmax on a layer kind), or drop temperatures_only."
        )
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    return names


def count_visible(
    keep: Callable[..., Tensor | None] | None, tq: int, tk: int, device: torch.device
) -> Tensor:
    """SSMax's ``n``: how many of ``tk`` keys each of ``tq`` queries sees, at least 1, as float32
    (B|1, 1, Tq, 1). ``keep(s, e, tk, device)``: the context's visibility of query rows ``[s, e)``
    (B|1, 1, e - s, tk), counted in blocks of rows; ``None``: every key is visible."""
    if keep is None:
        counts = torch.full((1, 1, tq), float(tk), device=device)
    else:
        step = max(1, 2**22 // max(tk, 1))
        rows = [keep(s, min(s + step, tq), tk, device).sum(-1) for s in range(0, tq, step)]
        counts = torch.cat(rows, -1).float() if rows else torch.zeros(1, 1, 0, device=device)
    return counts.clamp_min(1.0).unsqueeze(-1)
