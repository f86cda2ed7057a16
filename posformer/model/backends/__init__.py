"""Attention backends: one module per way of computing ``softmax(q·kᵀ/√Dh + bias)·v``.

:func:`posformer.model.attention.attend` tries :data:`BACKENDS` in order; the first backend whose
``applies(q, k, ctx, dropout_p)`` is true and whose ``run(q, k, v, ctx, layer, dropout_p)`` returns a
tensor (not ``None``) gives the result. Backends read the PE only through ``ctx.pe.caps`` and the
context's public methods, never a PE's name or class.

===============  ==================================================================================
``shortcut``     the PE's own exact :meth:`~posformer.pe.base.PositionalEncoding.attention` (no grad,
                 no dropout/padding, positions ``0 … T-1``); may decline
``fused``        SDPA with no mask or ``is_causal`` (no bias, no value hook, no padding)
``explicit``     explicit fp32 softmax for the ``value`` hook, in query blocks
``flex``         FlexAttention: an elementwise bias (``caps.elementwise_bias``) as ``score_mod``, the
                 causal/padding/document masks as a ``BlockMask``; CUDA (never while the PE's bias
                 parameters train), or CPU without gradients
                 (``ModelConfig.attention_backend``: ``auto`` / ``flex`` / ``sdpa``)
``offset``       ``caps.bias_offset_only`` with contiguous positions: Hankel views of one offset vector
``masked``       the catch-all: one materialised float (or bool) mask per query block, with
                 :class:`~posformer.model.backends.masked.BiasedAttention` for biases with gradients
===============  ==================================================================================

Adding a backend: a module with ``applies`` and ``run`` of the signatures above, and one
:class:`Backend` entry in :data:`BACKENDS` at the place where it should take precedence.
:func:`disabled` switches backends off for a block of code (ablations, benchmarks, tests); the two
catch-alls cannot be switched off.
``flex`` sits after ``explicit`` (it cannot return the probabilities the ``value`` hook needs) and
before ``offset``/``masked``, whose calls it takes over on CUDA; its ``applies`` checks the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from posformer.model.backends import explicit, flex, fused, masked, offset, shortcut
from posformer.model.backends.masked import BiasedAttention
from posformer.model.context import AttentionContext

#: ``applies(q (B, H, Tq, Dh), k (B, H, Tk, Dh), ctx, dropout_p) -> bool``
Applies = Callable[[Tensor, Tensor, AttentionContext, float], bool]
#: ``run(q, k, v, ctx, layer, dropout_p) -> (B, H, Tq, Dh)``, or ``None`` to let the next backend run
Run = Callable[[Tensor, Tensor, Tensor, AttentionContext, int, float], "Tensor | None"]


@dataclass(frozen=True)
class Backend:
    """One way of computing attention: when it ``applies`` and how to ``run`` it."""

    name: str
    applies: Applies
    run: Run


#: tried in order by :func:`posformer.model.attention.attend`; ``masked`` takes every call without a
#: ``value`` hook and ``explicit`` every call with one, so the last two cover everything
BACKENDS: tuple[Backend, ...] = (
    Backend("shortcut", shortcut.applies, shortcut.run),
    Backend("fused", fused.applies, fused.run),
    Backend("explicit", explicit.applies, explicit.run),
    Backend("flex", flex.applies, flex.run),
    Backend("offset", offset.applies, offset.run),
    Backend("masked", masked.applies, masked.run),
)

#: names of the backends :func:`attend` skips (set by :func:`disabled`)
DISABLED: set[str] = set()
#: the backends that take every call of their kind: never disabled
CATCH_ALL = frozenset({"explicit", "masked"})


@contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Skip the named backends inside the ``with`` block (``disabled("offset")``: the path without it)."""
    known = {b.name for b in BACKENDS}
    for name in names:
        if name not in known or name in CATCH_ALL:
            valid = ", ".join(sorted(known - CATCH_ALL))
            raise ValueError(f"cannot disable attention backend {name!r}: choose from {valid}")
    added = set(names) - DISABLED
    DISABLED.update(added)
    try:
        yield
    finally:
        DISABLED.difference_update(added)


__all__ = ["BACKENDS", "CATCH_ALL", "DISABLED", "Applies", "Backend", "BiasedAttention", "Run", "disabled"]
