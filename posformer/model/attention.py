"""Multi-head attention that calls the positional-encoding hooks.

The attention layer knows nothing about individual PEs; it reads ``pe.caps`` through the
:class:`~posformer.model.context.AttentionContext` of the forward:

* ``rotary`` rotates q and the *new* k (before they are cached), with tables built once per
  context (:meth:`AttentionContext.rotate`) (a PE with ``caps.rotary_depends_on_length``: the
  :class:`~posformer.model.cache.KVCache` is replayed when the length changes the tables);
* ``bias`` gives an additive score bias, folded with the causal and padding masks into one float
  mask for :func:`torch.nn.functional.scaled_dot_product_attention`;
* ``value`` adds a term from the attention probabilities (explicit softmax);
* a bias form that reads the layer input (``Features``, ``PerCall(reads={"x"})``:
  :mod:`posformer.pe.forms`): the PE's ``input_features`` of the layer input (new tokens; keys: cached +
  new) are handed to the context for the bias.

:func:`attend` asks :func:`posformer.model.backends.choose` which backend computes the call (the PE's
shortcut, fused SDPA, explicit softmax, FlexAttention, offset vector, materialised masks: one ordered
list of rules) and runs it.
Layout of the package:

``attention.py``  :class:`MultiHeadAttention` and :func:`attend` (this module)
``context.py``    :class:`AttentionContext`: positions, masks and caches of one forward
``backends/``     one module per attention backend; ``choose`` (the decision) and ``BACKENDS``
``cache.py``      :class:`LayerCache`, :class:`KVCache` (incremental decoding)
``positions.py``  every function that makes positions
``transformer.py`` the two models; ``config.py`` :class:`ModelConfig`

Speed notes are in ``docs/performance.md``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.errors import ConfigError
from posformer.model.backends import BACKENDS, BiasedAttention, choose, flex
from posformer.model.cache import LayerCache
from posformer.model.context import CAUSAL_BLOCK_ROWS, DEFAULT_CHUNK_BYTES, AttentionContext
from posformer.model.knobs import NO_KNOBS, Knobs
from posformer.pe.forms import reads

__all__ = [
    "CAUSAL_BLOCK_ROWS",
    "DEFAULT_CHUNK_BYTES",
    "AttentionContext",
    "BiasedAttention",
    "LayerCache",
    "MultiHeadAttention",
    "attend",
]

log = logging.getLogger("posformer.model")


def attend(
    q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, *, layer: int = 0, dropout_p: float = 0.0
) -> Tensor:
    """Attention of ``q`` (B, H, Tq, Dh) over ``k``, ``v`` (B, H, Tk, Dh) -> (B, H, Tq, Dh).

    ``q`` and ``k`` are already rotated; ``layer`` selects per-layer PE parameters. The backend is
    :func:`~posformer.model.backends.choose`'s, for ``q``'s device.
    """
    name = choose(q, k, ctx, dropout_p=dropout_p, device_type=q.device.type)
    if name not in FLEX_BACKED or ctx.policy.choice != "auto":
        return BACKENDS[name](q, k, v, ctx, layer, dropout_p)
    try:
        return BACKENDS[name](q, k, v, ctx, layer, dropout_p)
    except Exception as exc:
        if not flex.is_compile_failure(exc):
            raise
        _fall_back(ctx, name, exc)
    name = choose(q, k, ctx, dropout_p=dropout_p, device_type=q.device.type)
    return BACKENDS[name](q, k, v, ctx, layer, dropout_p)


#: backends that may run FlexAttention: ``flex``, and the shortcuts, whose CUDA kernel is compiled Flex
FLEX_BACKED = frozenset({"flex", "shortcut"})


def _fall_back(ctx: AttentionContext, backend: str, exc: BaseException) -> None:
    """Record that FlexAttention failed for this model (``auto``: its later calls take SDPA or the
    materialised paths) and say so in one warning line, once per model."""
    root = exc  # the compiler's own error, under dynamo's wrapper ("backend='inductor' raised:")
    for _ in range(6):
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None:
            break
        root = inner
    first = (str(root).strip().splitlines() or [type(root).__name__])[0][:240]
    wrapped = f"{type(exc).__name__} from " if root is not exc else ""
    reason = f"{wrapped}{type(root).__name__}: {first}"
    if ctx.policy.fallback.record(reason):
        log.warning(
            "FlexAttention failed in the %s backend (%s); this model's remaining attention calls take SDPA "
            "or the materialised paths (the same attention, slower); results.json records it as "
            "attention_fallback. model.attention_backend=sdpa skips Flex from the start.",
            backend,
            reason,
        )


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection (self) or Q + fused KV (cross).

    Args:
        d_model: model width D.
        n_heads: heads H (head width Dh = D / H).
        dropout: dropout on the attention probabilities.
        cross: cross-attention (queries from x, keys/values from ``memory``).
        bias: whether the projections have a bias.
        sinks: a learned sink logit per head in the softmax denominator (gpt-oss), initialised to 0;
            ``"token"``: a logit per head and query token, ``Linear(D, H)`` of the layer input (Inkling).
        knobs: QK-norm, the head-wise output gate, soft-capping, SSMax (:mod:`posformer.model.knobs`).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        cross: bool = False,
        bias: bool = True,
        sinks: bool | str = False,
        knobs: Knobs = NO_KNOBS,
    ):
        super().__init__()
        self.n_heads, self.head_dim, self.cross = n_heads, d_model // n_heads, cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks is True else None  # (H,)
        # modules of the knobs only where they are on: a model without them draws the same weights
        self.sink_proj = nn.Linear(d_model, n_heads, bias=False) if sinks == "token" else None
        self.output_gate = nn.Linear(d_model, n_heads, bias=False) if knobs.output_gate else None
        self.qk_norm = float(knobs.qk_norm or 0.0)
        self.ssmax_scale = nn.Parameter(torch.full((n_heads,), float(knobs.ssmax))) if knobs.ssmax else None

    def _qk_norm(self, t: Tensor, is_query: bool) -> Tensor:
        """QK-norm of queries or keys (B, H, T, Dh): unit length per head; the queries also times the scale
        ``g · sqrt(Dh)``, so the backends' ``1/sqrt(Dh)`` leaves the score ``g · q̂·k̂``."""
        if not self.qk_norm:
            return t
        unit = F.normalize(t, dim=-1)
        return unit * (self.qk_norm * self.head_dim**0.5) if is_query else unit

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # (B, T, D) -> (B, H, T, Dh)

    def forward(
        self,
        x: Tensor,
        ctx: AttentionContext,
        *,
        layer: int = 0,
        memory: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """``x`` (B, T, D) [, ``memory`` (B, S, D)] -> (B, T, D).

        With a ``cache``: self-attention appends the new (rotated) keys/values to it; cross-attention
        projects ``memory`` once and reuses it afterwards. With ``ctx.parallel``: :meth:`_forward_split`.
        """
        if ctx.parallel is not None:
            return self._forward_split(x, ctx, layer, memory, cache)
        if self.cross:
            q = self._heads(self.q_proj(x))  # (B, H, T, Dh)
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v
            else:
                k, v = (self._heads(t) for t in self.kv_proj(memory).chunk(2, dim=-1))  # (B, H, S, Dh) each
                k = ctx.rotate(self._qk_norm(k, False), ctx.k_pos, is_query=False)
                if cache is not None:
                    cache.k, cache.v = k, v
        else:
            q, k, v = (self._heads(t) for t in self.qkv_proj(x).chunk(3, dim=-1))  # (B, H, T, Dh) each
            new_pos = ctx.k_pos[:, -x.shape[1] :]  # (B|1, T): positions of the new keys
            k = ctx.rotate(self._qk_norm(k, False), new_pos, is_query=False)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, T_past + T, Dh)
        q = ctx.scale_queries(ctx.rotate(self._qk_norm(q, True), ctx.q_pos, is_query=True))  # temperature
        if self.ssmax_scale is not None:  # s_h · log n_i, n_i the keys query i sees: (B|1, H, T, 1)
            n = ctx.visible_counts(q.device)  # (B|1, 1, Tq, 1) float32
            q = q * (self.ssmax_scale.view(1, -1, 1, 1) * n.log()).to(q.dtype)
        if "x" in reads(ctx.bias_form):
            self._set_input_features(x, ctx, layer, memory, cache)
        if self.sinks is not None:
            ctx.set_sinks(layer, self.sinks)
        if self.sink_proj is not None:  # (B, T, H) -> (B, H, T): one logit per head and query token
            ctx.set_sinks(layer, self.sink_proj(x).transpose(1, 2))
        out = attend(q, k, v, ctx, layer=layer, dropout_p=self.dropout if self.training else 0.0)
        if self.output_gate is not None:  # head-wise sigmoid gate of the layer input: (B, H, T, 1)
            out = out * torch.sigmoid(self.output_gate(x)).transpose(1, 2).unsqueeze(-1).to(out.dtype)
        if cache is not None and not self.cross and ctx.cache_keep is not None:
            cache.keep_last(ctx.cache_keep)  # rolling cache: only the keys later queries can see
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, H, T, Dh) -> (B, T, H, Dh) -> (B, T, D)

    def _forward_split(
        self, x: Tensor, ctx: AttentionContext, layer: int, memory: Tensor | None, cache: LayerCache | None
    ) -> Tensor:
        """Self-attention of this rank's tokens ``x`` (B, T/P, D) -> (B, T/P, D) in a sequence split across
        the processes of ``ctx.parallel`` (:mod:`posformer.model.parallel`): q, k, v are projected,
        rotated and scaled at the tokens' global positions, exchanged for the whole sequence of H/P heads,
        attended by the usual backends over ``ctx`` (the whole sequence's positions and masks), and
        exchanged back."""
        cp = ctx.parallel
        if self.cross or memory is not None or cache is not None:
            raise ValueError("a split sequence runs self-attention without a cache (training and scoring)")
        knobs = [
            n
            for n, m in (
                ("sinks: token", self.sink_proj),
                ("output_gate", self.output_gate),
                ("ssmax", self.ssmax_scale),
            )
            if m is not None
        ] + (["qk_norm"] if self.qk_norm else [])
        if knobs or ctx.softcap:
            raise ConfigError(
                f"{', '.join(knobs) or 'softcap'} is not supported in a sequence split across processes; "
                "drop it or train without context parallelism."
            )
        s, e = cp.local_range(x.shape[1])
        heads = cp.heads(self.n_heads)
        q, k, v = (self._heads(t) for t in self.qkv_proj(x).chunk(3, dim=-1))  # (B, H, T/P, Dh) each
        k = ctx.rotate(k, ctx.k_pos[:, s:e], is_query=False)
        q = ctx.scale_queries(ctx.rotate(q, ctx.q_pos[:, s:e], is_query=True), start=s)
        if "x" in reads(ctx.bias_form):  # features of the whole sequence's input (running sums), local heads
            feats = ctx.pe.input_features(cp.gather_input(x), layer=layer)[:, heads]  # (B, H/P, T, F)
            ctx.set_features(layer, feats, feats)
        if self.sinks is not None:
            ctx.set_sinks(layer, self.sinks[heads])
        q, k, v = (cp.seq_to_heads(t) for t in (q, k, v))  # (B, H/P, T, Dh) each
        out = attend(q, k, v, ctx, layer=layer, dropout_p=self.dropout if self.training else 0.0)
        out = cp.heads_to_seq(out)  # (B, H/P, T, Dh) -> (B, H, T/P, Dh)
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, T/P, D)

    @staticmethod
    def _set_input_features(
        x: Tensor, ctx: AttentionContext, layer: int, memory: Tensor | None, cache: LayerCache | None
    ) -> None:
        """The PE's features of the queries' input ``x`` (B, T, D) and of the keys' input (``memory`` or
        cached + new tokens), (B, H, T, F) each, handed to ``ctx`` for the bias of this layer."""
        pe = ctx.pe
        if memory is not None:  # cross-attention: keys come from the memory
            ctx.set_features(layer, pe.input_features(x, layer=layer), pe.input_features(memory, layer=layer))
            return
        past = cache.feats if cache is not None else None
        q_feats = pe.input_features(x, layer=layer, past=past)
        k_feats = cache.append_features(q_feats) if cache is not None else q_feats
        ctx.set_features(layer, q_feats, k_feats)
