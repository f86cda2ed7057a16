"""The attention-shortcut mixin: a PE that computes a whole layer's attention from fused kernels.

Shaw's relative positions and CoPE force the explicit softmax path (a value term; a bias that reads
the queries and keys), yet at index distances each can compute the same attention from fused causal
attention plus a narrow explicit band (``posformer/pe/shaw.py``, ``posformer/pe/cope.py``). Such a PE
inherits :class:`AttentionShortcut` next to :class:`~posformer.pe.base.PositionalEncoding`::

    class ShawRelative(AttentionShortcut, PositionalEncoding): ...

and defines :meth:`~AttentionShortcut.attention` (and, where it does not pay everywhere,
:meth:`~AttentionShortcut.offers_attention`). The model hands it the device's fused kernel
(:class:`CausalLSE`; ``posformer.model.backends.shortcut``), so the PE imports no kernel of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

#: which keys a query sees, elementwise: ``(b, q_idx, k_idx) -> bool`` of batch rows and indices,
#: broadcast over their shapes (padding, packed documents; causality included or not)
KeyVisible = Callable[[Tensor, Tensor, Tensor], Tensor]


class CausalLSE(Protocol):
    """Causal fused attention with its log-sum-exp, handed to :meth:`AttentionShortcut.attention` by
    the model (the device's kernel): q, k, v (B, H, T, Dh), scale Dh^-0.5 -> (output (B, H, T, Dh) in
    q's dtype, natural-log log-sum-exp (B, H, T) float32), both differentiable.

    ``visible`` (in the call's own indices) hides more keys than causality; a query that then sees
    none gets output 0 and log-sum-exp ``-inf``. ``tag`` names the visibility for the forward (the
    same for every layer), so the kernel may build its mask once and reuse it.
    """

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, visible: KeyVisible | None = None, tag: str = ""
    ) -> tuple[Tensor, Tensor]: ...


class AttentionShortcut:
    """Mixin of a PE with its own exact attention (``caps.attention_shortcut``)."""

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        causal_lse: CausalLSE,
        layer: int = 0,
        visible: KeyVisible | None = None,
    ) -> Tensor:
        """The whole attention of one layer: ``q``, ``k``, ``v`` (B, H, T, Dh) (already rotated) ->
        (B, H, T, Dh).

        Called only where :meth:`offers_attention` says so (with gradients only where it says so for
        ``grad=True``, with padding or packed documents only where it says so for ``masked=True``),
        without dropout, for as many queries as keys whose position distances are their index
        distances (``0 … T-1``; packed documents restarting at 0). ``visible`` (:data:`KeyVisible`,
        causality included; None: every key, causality aside) hides padding and other documents; every
        query sees at least one key (the model zeroes the rows of queries that see none itself).
        ``causal_lse`` is the device's causal attention with its log-sum-exp (:class:`CausalLSE`; the
        CPU flash kernel, FlexAttention on CUDA; both differentiable), chosen by the model.
        """
        raise NotImplementedError

    def offers_attention(
        self, device_type: str, *, grad: bool = False, masked: bool = False, length: int | None = None
    ) -> bool:
        """Whether :meth:`attention` computes this instance's attention on ``device_type`` (``cpu``,
        ``cuda``), with gradients when ``grad`` (training), for padded or packed rows (its ``visible``)
        when ``masked``, for ``length`` tokens (None: unknown), where it pays: the attention backend
        decision asks before it picks the shortcut (and picks it only where the model has a
        ``causal_lse`` kernel for the device and the user's backend setting). Default: inference only,
        without masks, at any length."""
        return not grad and not masked
