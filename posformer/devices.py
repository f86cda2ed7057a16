"""Which device and precision a run uses: ``trainer.accelerator`` / ``trainer.precision`` made concrete.

The default trainer (``configs/trainer/auto.yaml``) asks for ``accelerator: auto`` and
``precision: auto``; :func:`resolve_device` turns them into what Lightning gets:

=====================================  ===============  =============
machine                                accelerator      precision
=====================================  ===============  =============
CUDA, bf16 in hardware (Ampere, ROCm)  ``cuda``         ``bf16-mixed``
CUDA, older GPU (Volta, Turing)        ``cuda``         ``16-mixed``
no CUDA                                ``cpu``          ``32-true``
=====================================  ===============  =============

Any other value is passed through unchanged (``trainer=cpu``, ``trainer=gpu``, ``trainer.precision=
16-true``, ...); ``precision: auto`` with an explicit accelerator follows the same table. An explicit
``gpu``/``cuda`` accelerator on a machine without CUDA is one :class:`~posformer.errors.ConfigError`
line (:func:`cuda_problem`). Training (:mod:`posformer.training`) and ``posformer-eval``
(:mod:`posformer.eval.run`, :mod:`posformer.eval.translate`) resolve through this module before the
Trainer / Fabric is built; the run's ``config.yaml`` keeps what was asked (``auto``), the model line on
the console and ``results.json`` say what was used (:func:`describe_device`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from posformer.errors import ConfigError

__all__ = [
    "AUTO",
    "CUDA_ACCELERATORS",
    "Device",
    "activation_dtype",
    "compute_dtype",
    "cpu_bf16_note",
    "cuda_problem",
    "describe_device",
    "device_name",
    "resolve_device",
    "resolve_trainer",
    "module_device",
    "torch_device",
    "torch_device_name",
]

#: the value of ``trainer.accelerator`` / ``trainer.precision`` that this module decides
AUTO = "auto"
#: accelerator names that mean a CUDA device (Lightning accepts both)
CUDA_ACCELERATORS = ("gpu", "cuda")


class Device(NamedTuple):
    """The concrete ``accelerator`` and ``precision`` given to Lightning (never ``auto``)."""

    accelerator: str
    precision: str


def cuda_problem(accelerator: Any) -> str | None:
    """The one-line error for a CUDA accelerator on a machine without CUDA, else ``None``."""
    if str(accelerator) not in CUDA_ACCELERATORS or torch.cuda.is_available():
        return None
    return (
        f"trainer.accelerator={accelerator} but no CUDA device is available (torch.cuda.is_available() is "
        "False); use trainer=auto (CUDA when there is one, else the CPU) or trainer=cpu."
    )


def resolve_device(accelerator: Any = AUTO, precision: Any = AUTO) -> Device:
    """``(accelerator, precision)`` with ``auto`` replaced as the module docstring's table says.

    Raises :class:`ConfigError` for ``gpu``/``cuda`` without a CUDA device. Values other than
    ``auto`` are returned unchanged (as strings; an integer precision such as ``32`` too).
    """
    accelerator = str(accelerator if accelerator is not None else AUTO)
    precision = str(precision if precision is not None else AUTO)
    problem = cuda_problem(accelerator)
    if problem:
        raise ConfigError(problem)
    if accelerator == AUTO:
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == AUTO:
        if accelerator in CUDA_ACCELERATORS:
            # native bf16 only (compute capability >= 8, or ROCm): emulated bf16 is slower than fp16
            native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
            precision = "bf16-mixed" if native_bf16 else "16-mixed"
        else:
            precision = "32-true"
    return Device(accelerator, precision)


def cpu_bf16_note(device: Device) -> str:
    """One warning line for bf16 autocast on the CPU (usually slower than fp32 there); ``""`` otherwise."""
    if device.accelerator != "cpu" or not device.precision.startswith("bf16"):
        return ""
    return (
        f"trainer.precision={device.precision} on the CPU: bf16 autocast is usually slower than fp32 on CPUs "
        "(few have bf16 matrix units); use trainer.precision=32-true unless you measured otherwise."
    )


def resolve_trainer(trainer: Mapping[str, Any] | None) -> Device:
    """:func:`resolve_device` of a config's ``trainer`` section (missing keys: ``auto``)."""
    trainer = trainer or {}
    return resolve_device(trainer.get("accelerator", AUTO), trainer.get("precision", AUTO))


def _device_indices(devices: Any) -> list[int]:
    """The CUDA device indices ``trainer.devices`` selects (an int count, -1/``auto``: all, or a list)."""
    if isinstance(devices, list | tuple):
        return [int(d) for d in devices]
    if isinstance(devices, str) and "," in devices:
        return [int(d) for d in devices.split(",") if d.strip()]
    if devices in (-1, "-1", AUTO, None):
        return list(range(max(torch.cuda.device_count(), 1)))
    return list(range(max(int(devices), 1)))


def torch_device_name(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)`` for a CUDA device (index 0 when it has none), else ``str(device)``."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else 0
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def device_name(device: Device, devices: Any = 1) -> str:
    """``cuda:0 (NVIDIA H200)``, ``cpu``; for more than one of ``trainer.devices``:
    ``2 x cuda (NVIDIA H200)``, ``2 x cpu``."""
    if device.accelerator in CUDA_ACCELERATORS:
        indices = _device_indices(devices)
        if len(indices) == 1:
            return torch_device_name(torch.device("cuda", indices[0]))
        return f"{len(indices)} x cuda ({torch.cuda.get_device_name(indices[0])})"
    n = devices if isinstance(devices, int) and devices > 1 else 1
    return device.accelerator if n == 1 else f"{n} x {device.accelerator}"


def describe_device(device: Device, devices: Any = 1) -> str:
    """``device cuda:0 (NVIDIA H200), precision bf16-mixed`` / ``device cpu, precision 32-true``
    (:func:`device_name` of ``trainer.devices``)."""
    return f"device {device_name(device, devices)}, precision {device.precision}"


def describe_attention(choice: str, accelerator: str) -> str:
    """The attention backend of the model line: ``model.attention_backend`` and, for ``auto``, what it
    runs on this accelerator (``auto -> flex`` on CUDA; ``auto -> sdpa`` elsewhere: SDPA and the
    materialised paths); a PE's own exact kernel or a bias form may still pick another path per call
    (``docs/performance.md``)."""
    if choice != "auto":
        return choice
    return "auto -> flex" if accelerator in CUDA_ACCELERATORS else "auto -> sdpa"


# ---------------------------------------------------------------- peak throughput (MFU)
#: the environment variable giving one device's peak FLOP/s for the MFU (e.g. 989e12), on any device
PEAK_FLOPS_ENV = "POSFORMER_PEAK_FLOPS"
#: dense bf16/fp16 tensor-core peak FLOP/s of known GPUs (the vendors' data sheets, without sparsity), by
#: a part of the device name; used for 16-bit precisions on CUDA when POSFORMER_PEAK_FLOPS is not set
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_flops(accelerator: str, precision: str, device_index: int = 0) -> float | None:
    """One device's peak FLOP/s for the MFU: :data:`PEAK_FLOPS_ENV` when set (a positive number, else one
    :class:`ConfigError` line), else a known GPU's 16-bit peak (:data:`GPU_PEAK_FLOPS`) for a 16-bit
    precision on CUDA; ``None`` (the MFU is "n/a") otherwise, the CPU included."""
    given = os.environ.get(PEAK_FLOPS_ENV)
    if given:
        try:
            value = float(given)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"{PEAK_FLOPS_ENV}={given!r} is not a positive number of FLOP/s; set one device's peak, e.g. "
                f"{PEAK_FLOPS_ENV}=989e12 (H100 bf16), or unset it."
            )
        return value
    if accelerator not in CUDA_ACCELERATORS or "16" not in str(precision) or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device_index)
    return next((v for k, v in GPU_PEAK_FLOPS.items() if k in name), None)


# ---------------------------------------------------------------- tensors' devices
def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (the CPU for a module without either).

    Tensors made *for* a module (probes, positions, windows of a token stream) go there, so code that
    runs on the CPU runs unchanged on CUDA. A parameter-free module (ALiBi, NoPE) has no device of its
    own: callers that know the model's device pass it instead.
    """
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def torch_device(spec: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``, checked.

    Raises :class:`~posformer.errors.ConfigError` in one line for a device this machine does not have.
    """
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


def compute_dtype(precision: Any, accelerator: Any = "cuda") -> torch.dtype:
    """The dtype a model computes its attention in under a Lightning ``precision`` (``16-mixed``: float16
    autocast, bfloat16 on the CPU, where Lightning substitutes it; ``bf16-true``: bfloat16 weights;
    ``32-true``: float32, ...)."""
    text = str(precision)
    if text == "16-mixed" and str(accelerator) == "cpu":
        return torch.bfloat16
    if text.startswith("16") or text.endswith("float16"):  # 16-mixed, 16-true, transformer-engine-float16
        return torch.float16
    if text.startswith("bf16") or text.startswith("transformer-engine"):
        return torch.bfloat16
    return torch.float64 if text.startswith("64") else torch.float32


def activation_dtype(device_type: str, weights: torch.dtype) -> torch.dtype:
    """The dtype of a model's activations on ``device_type`` now: the autocast dtype inside an autocast
    region, else its ``weights``' dtype."""
    autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if autocast else weights  # (the meta device has none)
