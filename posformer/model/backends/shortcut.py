"""Backend: the PE's own exact attention (``caps.attention_shortcut``: Shaw's fused regions, CoPE's band).

:meth:`PositionalEncoding.attention` computes a whole layer's attention from fused kernels. The
decision (:func:`posformer.model.backends.choose`, rule 1) picks it only where it is exact and cheap
to check: the PE offers it on this device and grad mode (:meth:`PositionalEncoding.offers_attention`:
Shaw's also trains; CoPE trains on the CPU through its own function), no dropout, no padding, no
packed documents, as many queries as keys, and positions ``0 … T-1`` — and where this module has the
device's causal attention with log-sum-exp (:func:`causal_lse_kernel`) for the PE to build on: the CPU
flash kernel; compiled FlexAttention on CUDA unless the user chose ``model.attention_backend=sdpa``
(never Flex) or torch has no FlexAttention. Both return gradients for the output *and* the
log-sum-exp (the regions' merge differentiates through it): Flex natively, the CPU flash kernel through
:class:`_CpuFlashLSE`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model.backends import flex
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.pe.base import CausalLSE


class _CpuFlashLSE(torch.autograd.Function):
    """The CPU flash kernel with a gradient for its log-sum-exp too (aten's formula drops it).

    The kernel's backward forms ``dS_ij = P_ij (dP_ij - D_i)`` with ``D_i = dO_i · O_i`` (the rowsum of
    the output gradient times the output), and ``∂lse_i/∂s_ij = P_ij``; so an upstream ``g_i`` on the
    log-sum-exp is ``D_i -> D_i - g_i``. That is done without touching the kernel: one zero column is
    appended to q, k, v (the scores and ``dP`` do not change; the scale stays ``1/√Dh``), the output's
    extra column is ``-g_i`` and the output gradient's is 1, so the kernel's ``D_i`` is ``dO_i·O_i - g_i``.
    The extra gradient columns are dropped. Checked against float64 in ``tests/test_shaw_training.py``.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: Tensor | None, d_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        width = q.shape[-1]  # Dh
        scale = 1.0 / math.sqrt(width)  # the kernel's default (as aten computes it), kept at Dh + 1
        d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
        if d_lse is not None:  # (B, H, T): one extra column, see the class docstring
            q, k, v = (F.pad(x, (0, 1)) for x in (q, k, v))  # (B, H, T, Dh + 1)
            out = torch.cat([out, -d_lse.to(out.dtype).unsqueeze(-1)], -1)  # (B, H, T, Dh + 1)
            d_out = F.pad(d_out, (0, 1), value=1.0)  # (B, H, T, Dh + 1)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, True, scale=scale
        )
        return tuple(g[..., :width] for g in grads)  # type: ignore[return-value]


def cpu_causal_lse(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention on the CPU flash kernel: (B, H, T, Dh) each -> ((B, H, T, Dh), lse (B, H, T)),
    differentiable in both (:class:`_CpuFlashLSE`)."""
    out, lse = _CpuFlashLSE.apply(q, k, v)
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
