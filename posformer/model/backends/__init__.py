"""Attention backends: one function per way of computing ``softmax(q·kᵀ/√Dh + bias)·v``, and the one
decision that picks among them.

:func:`choose` maps the facts of one call — what the PE does (``ctx.pe``), the masks, the positions,
the device, the grad mode, the lengths, the user's choice and switches (:class:`BackendPolicy`) — to a
backend name, by an ordered list of rules: the first rule that holds wins. :data:`BACKENDS` maps the
name to a plain function ``run(q, k, v, ctx, layer, dropout_p) -> (B, H, Tq, Dh)``, which never
declines. Backends read the PE only through ``ctx.pe.caps`` (its hooks and the form of its bias,
:mod:`posformer.pe.forms`, which they match on) and the context's public methods, never a PE's name or
class.

===============  ==================================================================================
``shortcut``     the PE's own exact attention (:class:`~posformer.pe.shortcut.AttentionShortcut`: Shaw, CoPE)
``fused``        SDPA with no mask or ``is_causal``
``explicit``     explicit fp32 softmax for the ``value`` hook and soft-capped scores, in query blocks
``flex``         FlexAttention: the elementwise bias as ``score_mod``, masks as one ``BlockMask``
``keycol``       SDPA with a bias of the key alone as head-dim columns (forget gates, causal ALiBi)
``offset``       an ``Offsets`` bias at contiguous positions: Hankel views of one offset vector
``masked``       the catch-all: one materialised float (or bool) mask per query block
``remapped``     a position map (``eval.position_map``): each region's scores at its positions, fp32 softmax
===============  ==================================================================================

Adding a backend: a module with a ``run`` of the signature above, an entry in :data:`BACKENDS`, and a
rule in :func:`choose` at the place where it should take precedence. Ablations switch backends off
per model (``model.attention_policy = BackendPolicy(off=frozenset({"offset"}))``): the policy travels
into every :class:`~posformer.model.context.AttentionContext` the model makes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posformer.model.backends import explicit, flex, fused, keycol, masked, offset, remapped, shortcut
from posformer.model.backends.masked import BiasedAttention
from posformer.model.context import AttentionContext, BackendPolicy

#: ``run(q (B, H, Tq, Dh), k, v (B, H, Tk, Dh), ctx, layer, dropout_p) -> (B, H, Tq, Dh)``
Run = Callable[[Tensor, Tensor, Tensor, AttentionContext, int, float], Tensor]

#: every backend by name (the rules of :func:`choose` say when each runs)
BACKENDS: dict[str, Run] = {
    "shortcut": shortcut.run,
    "fused": fused.run,
    "explicit": explicit.run,
    "flex": flex.run,
    "keycol": keycol.run,
    "offset": offset.run,
    "masked": masked.run,
    "remapped": remapped.run,
}
#: the backends that take every call of their kind (a value term; everything else): never switched off
CATCH_ALL = frozenset({"explicit", "masked", "remapped"})


def choose(q: Tensor, k: Tensor, ctx: AttentionContext, *, dropout_p: float, device_type: str) -> str:
    """The backend for attention of ``q`` (B, H, Tq, Dh) over ``k`` (B, H, Tk, Dh): the first rule that holds.

    ``device_type`` is ``q.device.type`` (a parameter so the decision table can be printed for CUDA
    on any machine). Reads host facts only, except a positions check (``ctx.contiguous``,
    ``ctx.uses_offset_vector``) when the caller did not make the positions itself.
    """
    off = ctx.policy.off
    tq, tk = q.shape[2], k.shape[2]
    pe = ctx.pe
    if ctx.position_map is not None and pe is not None:  # 0. a position map: each region's scores
        return "remapped"
    rows_masked = ctx.key_padding_mask is not None or ctx.segment_ids is not None  # padding, documents
    plain = ctx.span.full and not ctx.sinks  # every key (no window or chunks), no sink column
    if ctx.softcap or ctx.probe is not None:  # 0. capped scores, a probe: the explicit softmax writes them
        return "explicit"
    # 1. the PE's own exact kernel (Shaw's, CoPE's), where it offers it for this device, grad mode,
    #    masks and length (CoPE's: with gradients or masks on the CPU only; Shaw's from 16-24 k tokens):
    #    index distances (positions 0 … T-1, or packed documents restarting), padding or documents but
    #    not both, full span, no sinks, where the model has the device's causal log-sum-exp kernel (not
    #    CUDA with sdpa)
    if (
        "shortcut" not in off
        and pe is not None
        and pe.caps.attention_shortcut
        and pe.offers_attention(device_type, grad=torch.is_grad_enabled(), masked=rows_masked, length=tq)
        and shortcut.causal_lse_kernel(device_type, ctx.policy, q.shape[-1]) is not None
        and not dropout_p
        and (ctx.key_padding_mask is None or ctx.segment_ids is None)
        and plain
        and tq == tk
        and ctx.index_offsets
    ):
        return "shortcut"
    # 2. no bias, no value term, nothing masked but causality (full span, no sinks): fused SDPA
    if (
        "fused" not in off
        and not ctx.has_bias
        and not ctx.has_value
        and not rows_masked
        and plain
        and (not ctx.causal or tq == 1 or tq == tk)
    ):
        return "fused"
    # 3. a value term needs the probabilities: the explicit softmax
    if ctx.has_value:
        return "explicit"
    # 4. FlexAttention where it can run and pays (the rules are flex.wanted's, one per line), unless it
    #    failed for this model under auto (policy.fallback); sinks need its log-sum-exp, which the
    #    compiled CPU kernel does not return (torch 2.13): SDPA takes those
    no_lse = ctx.sinks and device_type == "cpu" and ctx.policy.flex_compiled
    if (
        ctx.policy.flex_usable
        and flex.wanted(q, k, ctx, dropout_p=dropout_p, device_type=device_type)
        and not no_lse
    ):
        return "flex"
    # 5. a bias of the key alone (the softmax cancels the query's part) in float32 or bf16: head-dim
    #    columns of SDPA, any visibility as its boolean mask (a sink's logit is not relative to the row,
    #    so it would see the cancelled part). Cached steps only as before (float32 forget gates): the
    #    columns copy the cache each step. Causal ALiBi's (key positions): on CUDA only (the fused kernel
    #    instead of a mask; on the CPU's packed rows it ran 0.99x the masked path: the CPU's numerics stay)
    key_bias = keycol.source(ctx)
    if (
        "keycol" not in off
        and key_bias is not None
        and q.dtype in keycol.DTYPES
        and not ctx.sinks
        and (
            (key_bias == "features" and q.dtype == torch.float32)
            or (tq == tk and (key_bias == "features" or device_type == "cuda"))
        )
    ):
        return "keycol"
    # 6. a bias over offsets at contiguous positions: views of one vector, no (Tq, Tk) tensor (a
    # sliding window folds into the vector; sinks need a column of their own: masked)
    if "offset" not in off and ctx.uses_offset_vector and not ctx.sinks:
        return "offset"
    # 7. everything else: a materialised mask per query block
    return "masked"


def check_policy(policy: BackendPolicy) -> None:
    """Raise ``ValueError`` for a switch that names no backend or a catch-all."""
    for name in sorted(policy.off):
        if name not in BACKENDS or name in CATCH_ALL:
            valid = ", ".join(sorted(set(BACKENDS) - CATCH_ALL))
            raise ValueError(f"cannot switch attention backend {name!r} off: choose from {valid}")


__all__ = ["BACKENDS", "CATCH_ALL", "BackendPolicy", "BiasedAttention", "Run", "check_policy", "choose"]
