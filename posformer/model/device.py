"""Where a module lives: the one helper that answers "which device do new tensors for this go on"."""

from __future__ import annotations

import torch
from torch import nn


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (the CPU for a module without either).

    Tensors made *for* a module (probes, positions, windows of a token stream) go there, so code that
    runs on the CPU runs unchanged on CUDA. A parameter-free module (ALiBi, NoPE) has no device of its
    own: callers that know the model's device pass it instead.
    """
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def resolve_device(spec: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``, checked.

    Raises :class:`~posformer.errors.ConfigError` in one line for a device this machine does not have.
    """
    from posformer.errors import ConfigError

    text = str(spec).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device={spec!r} is not a device; use auto, cpu, cuda or cuda:N.") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={spec!r} is not supported; use auto, cpu, cuda or cuda:N.")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(
                f"device={spec!r} is not available: this machine has {count} CUDA device(s); "
                "use device=auto or device=cpu."
            )
    return device
