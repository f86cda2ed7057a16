"""Training-free position remapping at evaluation: the distance a query at position ``i`` sees a key at ``j``.

A *position map* replaces the relative distance ``d = i - j`` (of the explicit positions, causal ``d >= 0``)
by a remapped one. Each map is a few *regions*: region ``r`` gives every query a position ``q_r(i)`` and
every key a position ``k_r(j)``, and a pair ``(i, j)`` takes the region :meth:`PositionMap.region` picks;
its remapped distance is ``q_r(i) - k_r(j)``. Attention then computes each region's scores with the
PE's own hooks at those positions (rotary: queries and keys rotated at ``q_r``, ``k_r``; bias: the
bias of ``(q_r(i), k_r(j))``) and keeps, per pair, its region's score
(:mod:`posformer.model.backends.remapped`). So RoPE and every bias of positions (T5, ALiBi, FIRE,
KERPLE) take any map; a PE whose positions act elsewhere is refused in one line
(:func:`map_problem`).

=============  ====================================================================================
``selfextend`` Jin et al. 2024, "LLM Maybe LongLM" (group ``G``, neighbour window ``W``):
               ``d < W``: ``(i, j)``; else ``(i // G + W - W // G, j // G)``
``dca``        Dual Chunk Attention, An et al. 2024 (chunk ``s``, local window ``w``, ``c = s + w``):
               keys at ``j mod s``; queries at ``i mod s`` in the key's chunk, at
               ``min(i mod s + s, c - 1)`` in the next chunk, at ``c - 1`` beyond
``rerope``     Su 2023, ReRoPE (window ``w``): ``d < w``: ``(i, j)``; else the distance ``w``, as ``(w, 0)``
``string``     shifted STRING, An et al. 2024, "Why does the effective context length of LLMs fall short?"
               (shift ``S``, local window ``W < S``): ``d < S``: ``(i, j)``; else ``(i - S + W, j)``
=============  ====================================================================================

Maps read positions only (integers or floats), so cached decoding, whose queries continue the cache's
positions, sees the distances the full forward sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.pe.base import PositionalEncoding
from posformer.pe.forms import reads

#: one region: query positions (B|1, Tq) and key positions (B|1, Tk)
Region = tuple[Tensor, Tensor]


def _floor(x: Tensor, n: int) -> Tensor:
    return torch.div(x, n, rounding_mode="floor")


def _past(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Region 1 where the distance ``q - k`` is at least ``window``, else 0: (B, Tq, Tk) int64."""
    return ((q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)) >= window).long()


def _const(like: Tensor, value: int) -> Tensor:
    return torch.full_like(like, value)


@dataclass(frozen=True)
class PositionMap:
    """A remapping of query/key positions into regions (module docstring)."""

    kind: ClassVar[str] = ""
    #: the options and their meaning, for the one-line errors
    options: ClassVar[dict[str, str]] = {}

    def regions(self, q_pos: Tensor, k_pos: Tensor) -> list[Region]:
        """Each region's query positions (B|1, Tq) and key positions (B|1, Tk)."""
        raise NotImplementedError

    def region(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The region of every pair: int64 (B|1, Tq, Tk)."""
        raise NotImplementedError

    def distance(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The remapped distance of every pair, ``q_r(i) - k_r(j)`` of its region: (B|1, Tq, Tk)."""
        which = self.region(q_pos, k_pos)
        out = None
        for r, (q, k) in enumerate(self.regions(q_pos, k_pos)):
            d = q.unsqueeze(-1) - k.unsqueeze(-2)
            out = d.expand_as(which) if out is None else torch.where(which == r, d, out)
        return out

    @property
    def label(self) -> str:
        """``kind(option=value,...)`` for tables."""
        return f"{self.kind}({','.join(f'{f.name}={getattr(self, f.name)}' for f in fields(self))})"

    def check(self) -> None:
        """Refuse bad options in one line."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"eval.position_map: {self.kind} {f.name}={value!r} must be a positive integer "
                    f"({self.options[f.name]})."
                )


@dataclass(frozen=True)
class SelfExtend(PositionMap):
    group: int = 4
    window: int = 64
    kind: ClassVar[str] = "selfextend"
    options: ClassVar[dict[str, str]] = {
        "group": "G: grouped positions are i // G",
        "window": "W: keys closer than W keep their positions",
    }

    def regions(self, q_pos: Tensor, k_pos: Tensor) -> list[Region]:
        g, w = self.group, self.window
        return [(q_pos, k_pos), (_floor(q_pos, g) + (w - w // g), _floor(k_pos, g))]

    def region(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return _past(q_pos, k_pos, self.window)


@dataclass(frozen=True)
class DualChunk(PositionMap):
    chunk_size: int = 192
    local_window: int = 64
    kind: ClassVar[str] = "dca"
    options: ClassVar[dict[str, str]] = {
        "chunk_size": "s: keys are at j mod s",
        "local_window": "w: the pretrained length is s + w",
    }

    def regions(self, q_pos: Tensor, k_pos: Tensor) -> list[Region]:
        s, c = self.chunk_size, self.chunk_size + self.local_window
        keys = torch.remainder(k_pos, s)
        inner = torch.remainder(q_pos, s)
        return [(inner, keys), ((inner + s).clamp(max=c - 1), keys), (_const(q_pos, c - 1), keys)]

    def region(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        apart = _floor(q_pos, self.chunk_size).unsqueeze(-1) - _floor(k_pos, self.chunk_size).unsqueeze(-2)
        return apart.clamp(0, 2).long()


@dataclass(frozen=True)
class ReRoPE(PositionMap):
    window: int = 128
    kind: ClassVar[str] = "rerope"
    options: ClassVar[dict[str, str]] = {"window": "w: distances from w on are w"}

    def regions(self, q_pos: Tensor, k_pos: Tensor) -> list[Region]:
        return [(q_pos, k_pos), (_const(q_pos, self.window), _const(k_pos, 0))]

    def region(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return _past(q_pos, k_pos, self.window)


@dataclass(frozen=True)
class String(PositionMap):
    shift: int = 128
    window: int = 16
    kind: ClassVar[str] = "string"
    options: ClassVar[dict[str, str]] = {
        "shift": "S: distances from S on are shifted down by S - W",
        "window": "W < S: the distance S becomes W",
    }

    def check(self) -> None:
        super().check()
        if self.window >= self.shift:
            raise ConfigError(
                f"eval.position_map: string window={self.window} must be below shift={self.shift} (the "
                f"distance S becomes W); e.g. shift={2 * self.window}."
            )

    def regions(self, q_pos: Tensor, k_pos: Tensor) -> list[Region]:
        return [(q_pos, k_pos), (q_pos - (self.shift - self.window), k_pos)]

    def region(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return ((q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)) >= self.shift).long()


#: every map by its ``kind``
POSITION_MAPS: dict[str, type[PositionMap]] = {m.kind: m for m in (SelfExtend, DualChunk, ReRoPE, String)}


def parse_position_map(raw: Any) -> PositionMap | None:
    """``eval.position_map`` (``None``, a kind, or ``{kind: ..., <option>: ...}``) -> a checked map."""
    if raw is None or raw == "none":
        return None
    if isinstance(raw, str):
        raw = {"kind": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"eval.position_map={raw!r} must be a kind or a mapping such as {{kind: selfextend, group: 4}}."
        )
    kind = raw.get("kind")
    if kind not in POSITION_MAPS:
        raise ConfigError(f"eval.position_map.kind={kind!r} is unknown; valid: {', '.join(POSITION_MAPS)}.")
    cls = POSITION_MAPS[kind]
    extra = sorted(set(raw) - {"kind", *cls.options})
    if extra:
        raise ConfigError(
            f"eval.position_map: {kind} has no option {extra[0]!r}; valid: {', '.join(cls.options)}."
        )
    pm = cls(**{k: v for k, v in raw.items() if k != "kind"})
    pm.check()
    return pm


def map_problem(pe: PositionalEncoding) -> str | None:
    """Why ``pe`` cannot take a remapped distance (``None``: it can), read from its declarations."""
    caps = pe.caps
    if "embed" in caps.hooks:
        return "adds absolute positions to the embeddings, where no query/key distance exists"
    if caps.attention_shortcut or "value" in caps.hooks:
        return "computes its own attention or a value term from the probabilities, not scores of positions"
    if caps.bias is not None and reads(caps.bias):
        return f"has a bias that reads {'/'.join(sorted(reads(caps.bias)))} besides the positions"
    if caps.rotary_depends_on_length:
        return "has a rotation that depends on the sequence length"
    return None


def check_position_map(
    pm: PositionMap, pes: list[PositionalEncoding | None], model_kind: str, model_pe: str
) -> None:
    """Refuse, in one line, a position map for a model that is not decoder-only, one of whose decoder
    self-attention PEs ``pes`` cannot take it (:func:`map_problem`), or where it would change nothing."""
    if model_kind != "decoder":
        raise ConfigError(
            f"eval.position_map={pm.label} remaps causal self-attention distances of decoder-only models; "
            f"model.kind={model_kind!r} is not one: evaluate it without eval.position_map."
        )
    readers = list(dict.fromkeys(pe for pe in pes if pe is not None))
    for pe in readers:
        problem = map_problem(pe)
        if problem is not None:
            raise ConfigError(
                f"eval.position_map={pm.label} cannot apply to pe={pe.name!r}: it {problem}; evaluate it "
                "without eval.position_map (PEs of positions inside attention take one: rope, t5, alibi, "
                "fire, kerple)."
            )
    if not any(pe.caps.in_attention for pe in readers):
        raise ConfigError(
            f"eval.position_map={pm.label} has no effect on pe={model_pe!r}: no layer reads positions inside "
            "attention; evaluate it without eval.position_map."
        )
