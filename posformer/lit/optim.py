"""Optimisers, weight-decay parameter groups and learning-rate schedules.

Schedules are step-based :class:`torch.optim.lr_scheduler.LambdaLR` factors (callable objects, so
their settings are part of the scheduler's state):

``inverse_sqrt``  Vaswani et al. 2017, eq. (3): ``lr = multiplier · d_model^-0.5 ·
                  min(step^-0.5, step · warmup^-1.5)`` (``step`` counts from 1; ``optim.lr`` is
                  not used: the formula is the learning rate).
``cosine``        linear warm-up to ``optim.lr`` over ``warmup_steps``, then a cosine decay to
                  ``min_lr_ratio · optim.lr`` at ``total_steps``.
``constant``      linear warm-up, then ``optim.lr``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posformer.errors import ConfigError
from posformer.pe.base import PositionalEncoding

OPTIMIZERS = ("adamw", "adam")
SCHEDULES = ("inverse_sqrt", "cosine", "constant")


def parameter_groups(
    model: nn.Module, weight_decay: float, no_decay: Mapping[str, bool]
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decayed and a non-decayed group.

    ``no_decay`` flags: ``biases``, ``norms`` (LayerNorm weights and biases), ``embeddings`` (token
    embeddings and tied output projections) and ``pe`` (parameters of positional encodings).
    Shared (tied) parameters are counted once.
    """
    unknown = set(no_decay) - {"biases", "norms", "embeddings", "pe"}
    if unknown:
        raise ConfigError(
            f"optim.no_decay has unknown keys {sorted(unknown)}; valid: biases, norms, embeddings, pe."
        )
    exempt: set[int] = set()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, PositionalEncoding) and no_decay.get("pe", True):
            exempt.update(id(p) for p in module.parameters())
        elif (
            isinstance(module, nn.LayerNorm | nn.RMSNorm)
            and no_decay.get("norms", True)
            or isinstance(module, nn.Embedding)
            and no_decay.get("embeddings", False)
        ):
            exempt.update(id(p) for p in own)
    if no_decay.get("biases", True):
        exempt.update(id(p) for name, p in model.named_parameters() if name.endswith("bias"))
    decay, keep, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (keep if id(p) in exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if keep:
        groups.append({"params": keep, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module, optim: Mapping[str, Any], schedule: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """AdamW or Adam over :func:`parameter_groups`; the base lr is 1 for ``inverse_sqrt``."""
    name = str(optim.get("name", "adamw")).lower()
    if name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={name!r} is unknown; valid: {', '.join(OPTIMIZERS)}.")
    groups = parameter_groups(model, float(optim.get("weight_decay", 0.0)), optim.get("no_decay") or {})
    lr = 1.0 if schedule.get("name") == "inverse_sqrt" else float(optim["lr"])
    kwargs = {
        "lr": lr,
        "betas": tuple(optim.get("betas", (0.9, 0.999))),
        "eps": float(optim.get("eps", 1e-8)),
    }
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(groups, **kwargs)


@dataclass
class InverseSqrt:
    """Vaswani et al. 2017: ``multiplier · d^-0.5 · min(s^-0.5, s · warmup^-1.5)`` with ``s = step + 1``."""

    d_model: int
    warmup_steps: int
    multiplier: float = 1.0

    def __call__(self, step: int) -> float:
        s = step + 1
        warmup = max(self.warmup_steps, 1)
        return self.multiplier * self.d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)


@dataclass
class WarmupCosine:
    """Linear warm-up to 1, then a cosine from 1 to ``min_ratio`` at ``total_steps`` (flat after)."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class WarmupConstant:
    warmup_steps: int

    def __call__(self, step: int) -> float:
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else 1.0


def schedule_factor(schedule: Mapping[str, Any], *, d_model: int, max_steps: int):
    """The LambdaLR factor function described by ``schedule``."""
    name = schedule.get("name", "constant")
    warmup = int(schedule.get("warmup_steps", 0) or 0)
    if name == "inverse_sqrt":
        return InverseSqrt(d_model, warmup, float(schedule.get("multiplier", 1.0)))
    if name == "cosine":
        total = int(schedule.get("total_steps") or max_steps)
        return WarmupCosine(warmup, total, float(schedule.get("min_lr_ratio", 0.0)))
    if name == "constant":
        return WarmupConstant(warmup)
    raise ConfigError(f"schedule.name={name!r} is unknown; valid: {', '.join(SCHEDULES)}.")


def build_schedule(
    optimizer: torch.optim.Optimizer, schedule: Mapping[str, Any], *, d_model: int, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, schedule_factor(schedule, d_model=d_model, max_steps=max_steps)
    )
