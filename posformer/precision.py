"""Position arithmetic in float32 under any autocast or weight dtype.

A bf16/fp16 run must see the positions of a float32 run: tables, distances and the counts made from
them are computed in float32 and cast only where the attention uses them. Two things break that
silently. Autocast runs every matmul and ``nn.Linear`` of its region in the half dtype, whatever the
dtypes the code names (``q.float() @ k.float().T`` is a bf16 matmul under bf16 autocast); and a model
cast to bf16 (``bf16-true``) hands a PE's MLP bf16 weights, to which its input is cast. An MLP over
distances then sees ``i - j`` rounded to 8 bits (bf16 keeps integers exactly only up to 256), and a
count of gates sums bf16 gates.

:func:`autocast_off` turns autocast off for a block of position arithmetic (outside autocast it
changes nothing: float32 runs stay bitwise the same); :func:`float32_call` runs a small module (an
MLP over distances) in float32 with its weights upcast, gradients reaching them through the casts;
:func:`without_autocast` makes a whole function such a region. Checked for every registered PE by
``tests/pe/test_pe_precision.py``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

F = TypeVar("F", bound=Callable[..., Any])


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """A region of ``device``'s type where autocast is off (a null context where the device type has no
    autocast, e.g. ``meta``)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def float32_call(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` computed in float32 with autocast off: ``x`` and any half-precision parameter are
    upcast (exactly), so the result is the float32 function of the module's weights. Float32 weights
    are used as they are (the same call as ``module(x.float())``)."""
    x = x.float()
    with autocast_off(x.device):
        params = dict(module.named_parameters())
        if all(p.dtype == torch.float32 for p in params.values()):
            return module(x)
        return functional_call(module, {name: p.float() for name, p in params.items()}, (x,))


def without_autocast(fn: F) -> F:
    """Decorator: ``fn`` runs with autocast off on the device of its first tensor argument (for a
    function of position arithmetic, or an autograd function's forward and backward, which must agree)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = next(a.device for a in args if isinstance(a, Tensor))
        with autocast_off(device):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
