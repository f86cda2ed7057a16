"""Rotary context extension at evaluation time (``eval.rope_scaling``).

Which PEs take a scaling is a capability (``caps.rotary_scalable``), never a PE name; the scaling is
set through the PE's public ``set_scaling`` (RoPE's).
``factor: auto`` resolves per evaluation length to ``length / original_max_len``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from posformer.errors import ConfigError
from posformer.eval.settings import Subject, train_len_max
from posformer.pe.base import PositionalEncoding


def rotary_modules(model: nn.Module) -> list[PositionalEncoding]:
    """The PEs of ``model`` whose rotary frequencies can be rescaled (``caps.rotary_scalable``)."""
    return [m for m in model.modules() if isinstance(m, PositionalEncoding) and m.caps.rotary_scalable]


def resolve_scaling(
    scaling: dict[str, Any] | None, length: int, train_len: int | None
) -> dict[str, Any] | None:
    """A concrete ``pe.scaling`` dict for evaluation length ``length``.

    ``original_max_len`` defaults to the training length; ``factor: auto`` becomes
    ``max(1, length / original_max_len)`` (scale exactly to the evaluation length).
    """
    if not scaling or scaling.get("type") in (None, "none"):
        return None
    out = dict(scaling)
    if not out.get("original_max_len"):
        if train_len is None:
            raise ConfigError(
                f"eval.rope_scaling={scaling} needs original_max_len (the training length), and the "
                "checkpoint does not record one; set eval.rope_scaling.original_max_len."
            )
        out["original_max_len"] = int(train_len)
    if out.get("factor") in ("auto", None):
        out["factor"] = max(1.0, length / out["original_max_len"])
    return out


def set_rope_scaling(model: nn.Module, scaling: dict[str, Any] | None) -> int:
    """Set ``scaling`` on every rotary PE of ``model`` (and drop their cos/sin caches).

    Returns the number of PEs changed; raises :class:`ConfigError` for an invalid scaling.
    """
    mods = rotary_modules(model)
    for pe in mods:
        pe.set_scaling(scaling)
    return len(mods)


def apply_length_scaling(subject: Subject, model: nn.Module, length: int) -> None:
    """Set ``subject.scaling`` resolved for ``length`` on ``model`` (nothing when the subject has none).

    Raises :class:`ConfigError` when a scaling is asked for but ``model`` has no rotary PE to scale.
    """
    if subject.scaling is None:
        return
    scaling = resolve_scaling(subject.scaling, length, train_len_max(subject.train_len))
    if set_rope_scaling(model, scaling) == 0:
        raise ConfigError(
            f"eval.rope_scaling={subject.scaling} was given, but {subject.label} (pe={subject.pe!r}) has no "
            "rotary PE to scale; evaluate it without rope_scaling."
        )
