"""Backend: the PE's own exact attention (``caps.attention_shortcut``: Shaw's fused regions, CoPE's band).

:meth:`AttentionShortcut.attention <posformer.pe.shortcut.AttentionShortcut.attention>` computes a whole
layer's attention from fused kernels. The decision (:func:`posformer.model.backends.choose`, rule 1)
picks it only where it is exact and cheap to check: the PE offers it on this device and grad mode
(:meth:`~posformer.pe.shortcut.AttentionShortcut.offers_attention`:
Shaw's also trains; CoPE trains on the CPU through its own function), no dropout, as many queries as
keys at index distances (positions ``0 … T-1``, or packed documents at the positions the model made),
padding or packed documents (not both) only where the PE offers them — and where this module has the
device's causal attention with log-sum-exp (:func:`causal_lse_kernel`) for the PE to build on: the CPU
flash kernel; compiled FlexAttention on CUDA unless the user chose ``model.attention_backend=sdpa``
(never Flex), torch has no FlexAttention or the heads are smaller than its GPU kernel takes (16). Both
return gradients for the output *and* the log-sum-exp (the regions' merge differentiates through it):
Flex natively, the CPU flash kernel through :class:`_CpuFlashLSE`.

Padding and documents reach the PE as the context's elementwise visibility; each region the PE hands
the kernel gets its mask once per forward (:meth:`AttentionContext.cached_block_mask`, by the region's
tag): a float mask for the CPU kernel, a ``BlockMask`` for Flex. A padded query that sees no key at
all (left padding) is let see every key, and its row zeroed afterwards, as the explicit path does.
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
from posformer.pe.shortcut import CausalLSE, KeyVisible


class _CpuFlashLSE(torch.autograd.Function):
    """The CPU flash kernel with a gradient for its log-sum-exp too (aten's formula drops it).

    The kernel's backward forms ``dS_ij = P_ij (dP_ij - D_i)`` with ``D_i = dO_i · O_i`` (the rowsum of
    the output gradient times the output), and ``∂lse_i/∂s_ij = P_ij``; so an upstream ``g_i`` on the
    log-sum-exp is ``D_i -> D_i - g_i``. That is done without touching the kernel: one zero column is
    appended to q, k, v (the scores and ``dP`` do not change; the scale stays ``1/√Dh``), the output's
    extra column is ``-g_i`` and the output gradient's is 1, so the kernel's ``D_i`` is ``dO_i·O_i - g_i``.
    The extra gradient columns are dropped. Checked against float64 in ``tests/pe/test_shaw_training.py``.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        # mask: float (B|1, 1, T, T) or None, and causal either way (the kernel then skips the blocks
        # above the diagonal: 1.6x faster than the mask alone at T 2048)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, k, v, 0.0, True, attn_mask=mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = mask
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: Tensor | None, d_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        width = q.shape[-1]  # Dh
        scale = 1.0 / math.sqrt(width)  # the kernel's default (as aten computes it), kept at Dh + 1
        d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
        if d_lse is not None:  # (B, H, T): one extra column, see the class docstring
            q, k, v = (F.pad(x, (0, 1)) for x in (q, k, v))  # (B, H, T, Dh + 1)
            out = torch.cat([out, -d_lse.to(out.dtype).unsqueeze(-1)], -1)  # (B, H, T, Dh + 1)
            d_out = F.pad(d_out, (0, 1), value=1.0)  # (B, H, T, Dh + 1)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, True, attn_mask=ctx.mask, scale=scale
        )
        return (*(g[..., :width] for g in grads), None)


def cpu_causal_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: KeyVisible | None = None,
    tag: str = "",
    *,
    ctx: AttentionContext | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention on the CPU flash kernel: (B, H, T, Dh) each -> ((B, H, T, Dh), lse (B, H, T)),
    differentiable in both (:class:`_CpuFlashLSE`). With ``visible``: the float mask of causality and
    ``visible`` (kept in ``ctx`` under ``tag``, if given), and ``-inf`` for rows that see no key (the
    kernel returns 0 there)."""
    if visible is None:
        out, lse = _CpuFlashLSE.apply(q, k, v, None)
        return out, lse

    def build() -> tuple[Tensor, Tensor]:
        keep = region_keep(visible, q.shape[0], q.shape[2], k.shape[2], q.device)  # (B, 1, Tq, Tk)
        mask = q.new_zeros(keep.shape).masked_fill_(~keep, float("-inf"))  # (B, 1, Tq, Tk)
        return mask, keep.any(-1)  # (B, 1, Tq): rows that see some key

    tq, tk, key = q.shape[2], k.shape[2], f"{tag}:{q.dtype}"
    mask, seen = build() if ctx is None else ctx.cached_block_mask(tq, tk, q.device, build, key)
    out, lse = _CpuFlashLSE.apply(q, k, v, mask)
    return out, lse.masked_fill(~seen, float("-inf"))


def region_keep(visible: KeyVisible, batch: int, tq: int, tk: int, device: torch.device) -> Tensor:
    """(B, 1, Tq, Tk) bool: causality (key ``<= tk - tq +`` query) and ``visible`` of ``batch`` rows."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    q_idx = torch.arange(tq, device=device).view(1, 1, -1, 1)
    k_idx = torch.arange(tk, device=device).view(1, 1, 1, -1)
    return (k_idx <= q_idx + (tk - tq)) & visible(b, q_idx, k_idx)


def causal_lse_kernel(
    device_type: str, policy: BackendPolicy, head_dim: int, ctx: AttentionContext | None = None
) -> CausalLSE | None:
    """The :class:`~posformer.pe.shortcut.CausalLSE` a shortcut gets on ``device_type`` under ``policy`` for
    heads of ``head_dim``, or None (then no shortcut runs there); ``ctx`` (an :class:`AttentionContext`)
    keeps the masks of tagged visibilities for the forward."""
    if device_type == "cpu":
        return functools.partial(cpu_causal_lse, ctx=ctx)
    cuda_flex = device_type == "cuda" and policy.choice != "sdpa" and flex.available() and policy.flex_usable
    if not cuda_flex or not flex.head_dim_fits(head_dim, device_type):
        return None
    return functools.partial(flex.causal_with_lse, compiled=policy.flex_compiled, ctx=ctx)


def run(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, layer: int, dropout_p: float) -> Tensor:
    """(B, H, T, Dh) each -> (B, H, T, Dh)."""
    kernel = causal_lse_kernel(q.device.type, ctx.policy, q.shape[-1], ctx)
    if kernel is None:  # choose() never picks the shortcut then
        raise RuntimeError(f"no causal log-sum-exp kernel for {q.device.type} under {ctx.policy}")
    visible, has_keys = None, None  # None: causality alone, the kernels' own
    if ctx.key_padding_mask is not None or ctx.segment_ids is not None:
        visible = ctx.visible_fn()
    if ctx.key_padding_mask is not None:  # a padded query may see no key: it sees all, zeroed after
        visible, has_keys = _rows_without_keys_see_all(visible, ctx.key_padding_mask, ctx.causal)
    out = ctx.pe.attention(q, k, v, causal=ctx.causal, causal_lse=kernel, layer=layer, visible=visible)
    if has_keys is not None:
        out = out.masked_fill(~has_keys[:, None, :, None], 0.0)  # (B, H, T, Dh)
    return out


def _rows_without_keys_see_all(visible: KeyVisible, pad: Tensor, causal: bool) -> tuple[KeyVisible, Tensor]:
    """``visible`` with the queries that see no real key (``pad`` (B, T): left padding of causal rows,
    an all-padding row) seeing every key instead, and which queries see some real key, (B, T) bool."""
    has_keys = pad.cumsum(-1).gt(0) if causal else pad.any(-1, keepdim=True).expand_as(pad)  # (B, T)
    missing = ~has_keys

    def see(b: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        return visible(b, q_idx, k_idx) | missing[b, q_idx]

    return see, has_keys
