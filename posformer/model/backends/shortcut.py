"""Backend: the PE's own exact attention (``caps.attention_shortcut``: Shaw's fused regions, CoPE's band).

:meth:`PositionalEncoding.attention` computes a whole layer's attention from fused kernels. The
decision (:func:`posformer.model.backends.choose`, rule 1) picks it only where it is exact and cheap
to check: the PE offers it on this device (:meth:`PositionalEncoding.offers_attention`), no
gradients, no dropout, no padding, no packed documents, as many queries as keys, and positions
``0 … T-1`` — and where this module has the device's causal attention with log-sum-exp
(:func:`causal_lse_kernel`) for the PE to build on: the CPU flash kernel; compiled FlexAttention on CUDA
unless the user chose ``model.attention_backend=sdpa`` (never Flex) or torch has no FlexAttention.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from posformer.model.backends import flex
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.pe.base import CausalLSE


def cpu_causal_lse(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention on the CPU flash kernel: (B, H, T, Dh) each -> ((B, H, T, Dh), lse (B, H, T))."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return out, lse


def causal_lse_kernel(device_type: str, policy: BackendPolicy) -> CausalLSE | None:
    """The :data:`~posformer.pe.base.CausalLSE` a shortcut gets on ``device_type`` under ``policy``, or
    None (then no shortcut runs there)."""
    if device_type == "cpu":
        return cpu_causal_lse
    if device_type != "cuda" or policy.choice == "sdpa" or not flex.available():
        return None
    return functools.partial(flex.causal_with_lse, compiled=policy.flex_compiled)


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """(B, H, T, Dh) each -> (B, H, T, Dh)."""
    kernel = causal_lse_kernel(q.device.type, ctx.policy)
    if kernel is None:  # choose() never picks the shortcut then
        raise RuntimeError(f"no causal log-sum-exp kernel for {q.device.type} under {ctx.policy}")
    return ctx.pe.attention(q, k, v, causal=ctx.causal, causal_lse=kernel, layer=layer)
