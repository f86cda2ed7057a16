"""Optimisers, weight-decay parameter groups and learning-rate schedules.

Schedules are step-based :class:`torch.optim.lr_scheduler.LambdaLR` factors (callable objects, so
their settings are part of the scheduler's state):

``inverse_sqrt``  Vaswani et al. 2017, eq. (3): ``lr = multiplier · d_model^-0.5 ·
                  min(step^-0.5, step · warmup^-1.5)`` (``step`` counts from 1; ``optim.lr`` is
                  not used: the formula is the learning rate).
``cosine``        linear warm-up to ``optim.lr`` over ``warmup_steps``, then a cosine decay to
                  ``min_lr_ratio · optim.lr`` at ``total_steps``.
``constant``      linear warm-up, then ``optim.lr``.

``schedule.warmup_steps`` is a number of steps (int) or a fraction of the schedule's length (a float
in (0, 1): ``0.05`` = the first 5 % of ``total_steps``/``max_steps``), like Lightning's
``val_check_interval``. :func:`warmup_steps` turns it into steps; :func:`fit_to_run` makes a run
shorter than its warm-up or validation interval work (clamped, with one line saying so).

Half-precision weights (``trainer.precision=16-true``) keep Adam's state in float16, where the default
``eps=1e-9`` rounds to 0 and the update divides by ~0 (NaN at the first step). :func:`safe_eps` raises
``eps`` to the smallest normal number of the parameters' dtype (rounded up to a power of ten: 1e-4
for float16), with one warning line.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posformer.configs.schema import OPTIMIZERS, SCHEDULES  # the value sets, typed once in the schema
from posformer.errors import ConfigError
from posformer.model.knobs import freeze_all_but_temperatures, temperature_parameters
from posformer.pe.base import PositionalEncoding

log = logging.getLogger(__name__)


def parameter_groups(
    model: nn.Module, weight_decay: float, no_decay: Mapping[str, bool]
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decayed and a non-decayed group, named ``decay`` and
    ``no_decay`` (the learning-rate monitor's curves and the log say them).

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
    exempt.update(id(p) for _, p in temperature_parameters(model))  # SSMax scales: never decayed to 0
    decay, keep, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (keep if id(p) in exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if keep:
        groups.append({"params": keep, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def describe_groups(groups: Sequence[Mapping[str, Any]]) -> str:
    """``decay: 12 tensors, 98,304 parameters, weight decay 0.01; no_decay: ...``: the named groups."""
    return "; ".join(
        f"{g.get('name', f'group {i}')}: {len(g['params'])} tensors, "
        f"{sum(p.numel() for p in g['params']):,} parameters, weight decay {g['weight_decay']:g}"
        for i, g in enumerate(groups)
    )


def build_optimizer(
    model: nn.Module, optim: Mapping[str, Any], schedule: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """AdamW or Adam over :func:`parameter_groups`; the base lr is 1 for ``inverse_sqrt``. ``optim.fused``:
    torch's fused kernel (null: where :func:`fused_supported`, i.e. on CUDA)."""
    name = str(optim.get("name", "adamw")).lower()
    if name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={name!r} is unknown; valid: {', '.join(OPTIMIZERS)}.")
    if optim.get("temperatures_only"):
        names = freeze_all_but_temperatures(model)
        log.info("optim.temperatures_only: training %d temperature parameters alone", len(names))
    groups = parameter_groups(model, float(optim.get("weight_decay", 0.0)), optim.get("no_decay") or {})
    lr = 1.0 if schedule.get("name") == "inverse_sqrt" else float(optim["lr"])
    log.info("parameter groups: %s", describe_groups(groups))
    eps, warning = safe_eps(float(optim.get("eps", 1e-8)), [p for g in groups for p in g["params"]])
    if warning:
        log.warning(warning)
    kwargs: dict[str, Any] = {"lr": lr, "betas": tuple(optim.get("betas", (0.9, 0.999))), "eps": eps}
    fused = optim.get("fused")
    if fused is None:  # auto: one kernel for every parameter instead of a launch per tensor and op
        fused = fused_supported([p for g in groups for p in g["params"]])
    if fused:
        kwargs["fused"] = True
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    optimizer = cls(groups, **kwargs)
    optimizer.register_load_state_dict_pre_hook(keep_kernel_choice)
    return optimizer


#: the options of a torch optimiser that choose its kernel, not its arithmetic
KERNEL_OPTIONS = ("fused", "foreach")


def keep_kernel_choice(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with the kernel options of ``optimizer``'s groups (a ``load_state_dict`` pre-hook).

    torch restores every option of a saved group, so a run resumed from a checkpoint written with
    another kernel (a CPU run's ``foreach`` resumed on a GPU, ``optim.fused`` changed) would step with
    the checkpoint's kernel: not what the run asked for, and a fused run's NaN guard hands a
    ``found_inf`` to a ``foreach`` step, which refuses it. Set before torch loads the state, so that it
    also puts a fused kernel's step counts on the parameters' device."""
    saved = list(state_dict["param_groups"])  # as many as saved: torch refuses another count
    for i, group in enumerate(optimizer.param_groups[: len(saved)]):
        saved[i] = {**saved[i], **{key: group[key] for key in (*KERNEL_OPTIONS, "name") if key in group}}
    return {**state_dict, "param_groups": saved}


#: parameter dtypes torch's fused Adam/AdamW kernels take
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_supported(params: Sequence[torch.Tensor]) -> bool:
    """Whether the fused Adam/AdamW kernel takes these parameters: all on CUDA, floating point. On the
    CPU the optimiser stays the default (``foreach``), so CPU runs are bitwise unchanged. Lightning
    moves the model to its device before ``configure_optimizers``, so the parameters' device is the
    training device here."""
    return bool(params) and all(p.device.type == "cuda" and p.dtype in FUSED_DTYPES for p in params)


def unscales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales fp16 gradients inside its own step (torch's fused Adam/AdamW take
    the ``GradScaler``'s scale and ``found_inf`` as device tensors): Lightning then leaves them scaled
    until the step, where it would unscale every other optimiser's gradients before the
    ``on_before_optimizer_step`` hooks."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def grad_scaler(trainer: Any) -> torch.amp.GradScaler | None:
    """The fp16 mixed-precision ``GradScaler`` of ``trainer`` (``trainer.precision=16-mixed``), else None."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)


def safe_eps(eps: float, params: Sequence[torch.Tensor]) -> tuple[float, str]:
    """``(eps, "")`` when ``eps`` is representable (a normal number) in the dtype of every parameter,
    else ``(raised eps, one warning line)``: the smallest normal number of the lowest-precision dtype,
    rounded up to a power of ten."""
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if not dtypes:
        return eps, ""
    dtype = max(dtypes, key=lambda d: torch.finfo(d).tiny)
    tiny = torch.finfo(dtype).tiny
    if eps >= tiny:
        return eps, ""
    new = 10.0 ** math.ceil(math.log10(tiny))
    name = str(dtype).removeprefix("torch.")
    return new, (
        f"optim.eps={eps:g} is below the smallest normal {name} number ({tiny:.3g}), the dtype of the "
        f"weights and Adam's state under this precision: it would round to 0 and the update would divide "
        f"by ~0 (NaN). Using optim.eps={new:g} for this run; set optim.eps={new:g} to silence this, or train "
        "with trainer.precision=16-mixed / bf16-mixed (fp32 weights and optimizer state)."
    )


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


def schedule_length(schedule: Mapping[str, Any], max_steps: int) -> int:
    """Steps the schedule spans: ``total_steps`` (cosine) or ``max_steps``."""
    if schedule.get("name") == "cosine" and schedule.get("total_steps"):
        return int(schedule["total_steps"])
    return int(max_steps)


def is_warmup_fraction(value: Any) -> bool:
    """``warmup_steps`` given as a fraction of the run (a float in (0, 1))."""
    return isinstance(value, float) and 0.0 < value < 1.0


def warmup_steps(schedule: Mapping[str, Any], max_steps: int) -> int:
    """``schedule.warmup_steps`` in steps: an int as is, a fraction of :func:`schedule_length`
    rounded (at least 1)."""
    value = schedule.get("warmup_steps", 0) or 0
    if is_warmup_fraction(value):
        return max(1, round(value * schedule_length(schedule, max_steps)))
    return int(value)


#: warm-up of a run shorter than its configured warm-up: this fraction of the run
SHORT_RUN_WARMUP = 0.1


def fit_to_run(schedule: Mapping[str, Any], trainer: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Make ``schedule`` and the validation interval fit ``trainer.max_steps``.

    Returns ``(changes, message)``: ``changes`` maps dotted config keys to their new values
    (``schedule.warmup_steps`` resolved to steps; a warm-up as long as the schedule cut to
    ``SHORT_RUN_WARMUP`` of it; an integer ``trainer.val_check_interval`` above ``max_steps`` cut to
    ``max_steps``, so the run validates and keeps a best checkpoint); ``message`` is one line naming
    each clamped value and the fix ("" when nothing was clamped). Runs without a positive
    ``max_steps`` (epoch-based) are left as they are.
    """
    max_steps = trainer.get("max_steps", -1)
    if not isinstance(max_steps, int) or max_steps < 1 or trainer.get("fast_dev_run"):
        return {}, ""
    changes: dict[str, Any] = {}
    clamped: list[str] = []
    raw = schedule.get("warmup_steps", 0) or 0
    steps, length = warmup_steps(schedule, max_steps), schedule_length(schedule, max_steps)
    if steps >= length > 0 and not is_warmup_fraction(raw):
        new = max(1, round(SHORT_RUN_WARMUP * length)) if length > 1 else 0
        clamped.append(f"schedule.warmup_steps {raw} -> {new} ({SHORT_RUN_WARMUP:.0%} of {length} steps)")
        steps = new
    if steps != raw:
        changes["schedule.warmup_steps"] = steps
    vci = trainer.get("val_check_interval")
    if isinstance(vci, int) and not isinstance(vci, bool) and vci > max_steps:
        changes["trainer.val_check_interval"] = max_steps
        clamped.append(f"trainer.val_check_interval {vci} -> {max_steps} (validates at the end)")
    if not clamped:
        return changes, ""
    return changes, (
        f"short run (trainer.max_steps={max_steps}): clamped " + "; ".join(clamped) + ". Set them "
        "explicitly to silence this (schedule.warmup_steps also takes a fraction of the run, e.g. 0.05)."
    )


def schedule_factor(schedule: Mapping[str, Any], *, d_model: int, max_steps: int):
    """The LambdaLR factor function described by ``schedule``."""
    name = schedule.get("name", "constant")
    warmup = warmup_steps(schedule, max_steps)
    if name == "inverse_sqrt":
        return InverseSqrt(d_model, warmup, float(schedule.get("multiplier", 1.0)))
    if name == "cosine":
        total = schedule_length(schedule, max_steps)
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
