"""Context parallelism: one sequence split across processes, every PE included (Ulysses-style).

Each of ``P`` processes of a context-parallel group holds ``T/P`` consecutive tokens of the same rows:
rank ``r`` holds tokens ``[r·T/P, (r+1)·T/P)``. Everything outside attention (embeddings, feed-forward,
the output head, the loss) acts token by token and runs on the local slice. Around attention, an
all-to-all trades sequence for heads, ``(B, H, T/P, Dh) -> (B, H/P, T, Dh)``: each process then holds the
*whole* sequence for ``H/P`` heads, the attention backends run unchanged on it, and a second all-to-all
trades back (DeepSpeed-Ulysses, Jacobs et al. 2023).

Every PE runs split because positions stay global: the model makes the positions, padding and documents
of the whole sequence (each process gathers the slices it was given, :meth:`ContextParallel.gather`)
and builds the attention contexts over them, so a bias, a window, a chunk or a document boundary is the
one of the unsplit sequence. What differs per process is which heads it computes; the PE's outputs with
a head axis are cut to the local heads by :class:`HeadShard`, driven by what the PE's bias form states
(:mod:`posformer.pe.forms`), never by its name:

* a bias of positions alone (``Positions``, ``Offsets``) has all ``H`` heads on its axis 1: the
  elementwise ``bias_fn`` (``score_mod`` forms) is evaluated for the local head indices, any other bias
  is cut; ``key_position_bias`` (B|1, H, Tk) is cut likewise;
* a bias that reads tensors of the call (``PerCall``: q, k; ``Features``: the layer input's features)
  takes its heads from those tensors, which are already local;
* learned sinks (H,) are cut by the attention layer; rotations and query temperatures act before the
  exchange, on the local tokens at their global positions, for all heads.

A bias that reads the layer input (``Features``, ``PerCall(reads={"x"})``) gets its features from the
whole sequence's input (:meth:`ContextParallel.gather_input`: forget gates are running sums over the
sequence), cut to the local heads.

The group is an explicit object the model's ``forward(parallel=...)`` hands to its attention contexts
(``AttentionContext.parallel``); nothing here is global. With ``size == 1`` every exchange is the
identity and no ``torch.distributed`` call is made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from posformer.errors import ConfigError
from posformer.pe.forms import reads

if TYPE_CHECKING:
    from posformer.model.context import AttentionContext
    from posformer.pe.base import BiasAt, PositionalEncoding

__all__ = ["ContextParallel", "HeadShard", "check_split"]


def check_split(size: int, *, n_heads: int | None = None, length: int | None = None, what: str = "") -> None:
    """Refuse, in one line and before any work, a split that cannot run: ``n_heads`` or ``length`` (the
    whole sequence) not divisible by the group's ``size``."""
    if size < 1:
        raise ConfigError(f"context_parallel={size}: the processes per sequence must be at least 1.")
    if n_heads is not None and n_heads % size:
        raise ConfigError(
            f"context_parallel={size} splits attention by heads, but model.n_heads={n_heads} is not "
            f"divisible by {size}: choose n_heads as a multiple of {size} or another context_parallel."
        )
    if length is not None and length % size:
        where = f" ({what})" if what else ""
        raise ConfigError(
            f"context_parallel={size} splits every sequence into {size} equal slices, but the sequence "
            f"length {length}{where} is not divisible by {size}: use a multiple of {size} "
            f"(e.g. {length + size - length % size})."
        )


def _all_to_all(x: Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> Tensor:
    """Chunk ``scatter_dim`` of ``x`` into ``size`` parts, send part ``j`` to rank ``j``, and concatenate
    the parts received, in rank order, along ``gather_dim``."""
    send = torch.stack(x.chunk(size, scatter_dim))  # (P, ...): contiguous, part j for rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), gather_dim)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` with its gradient: the same exchange with the two dimensions swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.args = (group, size, scatter_dim, gather_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        group, size, scatter_dim, gather_dim = ctx.args
        return _all_to_all(grad.contiguous(), group, size, gather_dim, scatter_dim), None, None, None, None


def _all_gather(x: Tensor, group: Any, size: int, dim: int) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (bool travels as uint8)."""
    send = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
    parts = [torch.empty_like(send) for _ in range(size)]
    dist.all_gather(parts, send, group=group)
    out = torch.cat(parts, dim)
    return out.to(torch.bool) if x.dtype == torch.bool else out


class _GatherSequence(torch.autograd.Function):
    """:func:`_all_gather` along the sequence with its gradient: every rank's gradient of the whole
    sequence, summed (all-reduce), then this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int, rank: int) -> Tensor:
        ctx.args = (group, rank, x.shape[1])
        return _all_gather(x, group, size, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        group, rank, local = ctx.args
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad[:, rank * local : (rank + 1) * local], None, None, None


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group: ``size`` processes share each sequence; this one is ``rank``.

    Attributes:
        group: the ``torch.distributed`` process group of the processes that share a sequence (``None``:
            the default group; unused when ``size == 1``).
        rank: this process's rank in ``group``: it holds tokens ``[rank·T/P, (rank+1)·T/P)``.
        size: ``P``, the processes per sequence.
    """

    group: Any = None
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, group: Any = None) -> ContextParallel:
        """The group ``group`` (default: the whole world) as seen from this process."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    # ------------------------------------------------------------------ slices
    def local_range(self, local: int) -> tuple[int, int]:
        """The indices ``[start, end)`` in the whole sequence of this rank's ``local`` tokens."""
        return self.rank * local, (self.rank + 1) * local

    def heads(self, n_heads: int) -> slice:
        """The heads this rank attends with after the exchange (``n_heads / size`` of them)."""
        check_split(self.size, n_heads=n_heads)
        per = n_heads // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def split(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's slice of a whole sequence ``x`` along ``dim`` (e.g. (B, T) -> (B, T/P)); refuses a
        length not divisible by ``size``."""
        check_split(self.size, length=x.shape[dim])
        local = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * local, local)

    # ------------------------------------------------------------------ exchanges
    def seq_to_heads(self, x: Tensor) -> Tensor:
        """(B, H, T/P, F) local tokens, all heads -> (B, H/P, T, F) every token, local heads."""
        if self.size == 1:
            return x
        return _AllToAll.apply(x.contiguous(), self.group, self.size, 1, 2)

    def heads_to_seq(self, x: Tensor) -> Tensor:
        """(B, H/P, T, F) every token, local heads -> (B, H, T/P, F) local tokens, all heads."""
        if self.size == 1:
            return x
        return _AllToAll.apply(x.contiguous(), self.group, self.size, 2, 1)

    def gather(self, x: Tensor | None) -> Tensor | None:
        """The whole sequence of a per-token tensor given in slices, (B|1, T/P) -> (B|1, T), without a
        gradient (positions, padding, documents); ``None`` stays ``None``."""
        if x is None or self.size == 1:
            return x
        return _all_gather(x.detach(), self.group, self.size, 1)

    def gather_input(self, x: Tensor) -> Tensor:
        """The whole sequence of a layer input (B, T/P, D) -> (B, T, D), differentiable (the gradient of
        each rank's slice is the sum of every rank's gradient for it)."""
        if self.size == 1:
            return x
        return _GatherSequence.apply(x, self.group, self.size, self.rank)

    # ------------------------------------------------------------------ contexts
    def shard(self, ctx: AttentionContext, n_heads: int) -> AttentionContext:
        """``ctx`` (built over the whole sequence) for this rank: its PE behind a :class:`HeadShard` of
        the local heads, and this group, which the attention layer reads to exchange q, k, v."""
        pe = HeadShard(ctx.pe, self.heads(n_heads)) if ctx.pe is not None and self.size > 1 else ctx.pe
        return replace(ctx, pe=pe, parallel=self)


class HeadShard:
    """A PE seen by the attention of one rank: the outputs with a head axis cut to ``heads``.

    Everything else (capabilities, rotary tables, features, the PE's own attention, the value term, its
    parameters) is the PE's own: :meth:`__getattr__` hands it through. See the module docstring for which
    outputs are cut and why.
    """

    def __init__(self, pe: PositionalEncoding, heads: slice) -> None:
        self.pe, self.local_heads = pe, heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pe, name)

    def __repr__(self) -> str:
        return f"HeadShard({self.pe.name!r}, heads={self.local_heads.start}:{self.local_heads.stop})"

    @property
    def _positions_only(self) -> bool:
        """Whether the bias reads the positions alone (its heads are all ``H``; else the call's tensors')."""
        return not reads(self.pe.caps.bias)

    def bias(self, q_pos: Tensor, k_pos: Tensor, *, layer: int = 0, **call: Tensor) -> Tensor:
        """The PE's bias for the local heads: (B|1, H/P, Tq, Tk) float32."""
        if not self._positions_only:
            return self.pe.bias(q_pos, k_pos, layer=layer, **call)  # heads of the call's q, k or features
        if self.pe.caps.bias.score_mod:  # elementwise: only the local heads are computed
            h = self.local_heads
            heads = torch.arange(h.start, h.stop, device=q_pos.device).view(1, -1, 1, 1)
            return self.pe.bias_fn(layer)(heads, q_pos[:, None, :, None], k_pos[:, None, None, :])
        return self.pe.bias(q_pos, k_pos, layer=layer)[:, self.local_heads]

    def bias_fn(self, layer: int = 0) -> BiasAt:
        """The PE's elementwise bias with local head indices ``h`` (``0 … H/P-1``) read as global ones."""
        fn, first = self.pe.bias_fn(layer), self.local_heads.start

        def at(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
            return fn(h + first, q_pos, k_pos)

        return at

    def key_position_bias(self, k_pos: Tensor, *, layer: int = 0) -> Tensor:
        """The key part of a causal ``Offsets`` bias for the local heads: (B|1, H/P, Tk)."""
        return self.pe.key_position_bias(k_pos, layer=layer)[:, self.local_heads]
