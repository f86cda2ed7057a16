"""Incremental-decoding state.

:class:`LayerCache` holds one attention layer's keys/values; :class:`KVCache` holds every layer's
(self, cross) pair plus the key positions and padding seen so far, and is what a model's
``new_cache()`` returns. :meth:`KVCache.extend` is the one place where a decoding step's positions
and padding are appended (decoder-only and encoder-decoder models both call it).

A PE whose rotation depends on the sequence length (``caps.rotary_depends_on_length``: dynamic NTK)
makes every cached entry stale once the grown length changes its tables, in every layer (deeper
layers' keys/values come from hidden states computed with the old tables): :meth:`KVCache.replay`
then empties the cache and hands back every token so far, which the model runs again in one forward,
so cached decoding equals the full forward. Past ``original_max_len`` that is one full forward per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from posformer.model.positions import append_positions

if TYPE_CHECKING:
    from posformer.pe.base import PositionalEncoding


@dataclass
class LayerCache:
    """Key/value cache of one attention layer: ``k``, ``v`` are (B, H, T, Dh).

    Self-attention keys/values are appended in place into buffers with spare capacity along T
    (doubled when full), so one decoding step copies only its new keys, not the whole cache.
    ``k``/``v`` are views of the first T slots. Cross-attention sets ``k``/``v`` once (the projected
    encoder memory) and reuses them. ``feats`` (B, H, T, F) are the layer-input features of a PE with
    ``Features`` bias form (forget gates), appended alongside ``k``/``v`` by :meth:`append_features`.
    A sliding-window or chunked layer keeps only the keys later queries can see (:meth:`keep_last`):
    a rolling cache, O(window) memory, its views slide along the buffer (compacted when full).
    """

    k: Tensor | None = None
    v: Tensor | None = None
    feats: Tensor | None = None
    _buf: tuple[Tensor, Tensor] | None = field(default=None, repr=False)  # (B, H, capacity, Dh) each
    _start: int = field(default=0, repr=False)  # buffer slot of k[:, :, 0]

    def _in_buffer(self) -> bool:
        """Whether ``k``/``v`` are still views of the spare-capacity buffers (from slot ``_start``)."""
        b, s = self._buf, self._start
        return (
            b is not None
            and self.k is not None
            and s < b[0].shape[2]
            and self.k.data_ptr() == b[0][:, :, s:].data_ptr()
            and (self.k.shape[:2] == b[0].shape[:2] and self.v.data_ptr() == b[1][:, :, s:].data_ptr())
        )

    def keep_last(self, n: int) -> None:
        """Drop all but the latest ``n`` keys/values (and features): a rolling window's cache."""
        if self.k is None or self.k.shape[2] <= n:
            return
        drop = self.k.shape[2] - n
        if self._in_buffer():
            self._start += drop
        self.k, self.v = self.k[:, :, drop:], self.v[:, :, drop:]
        if self.feats is not None:
            self.feats = self.feats[:, :, -n:] if n else self.feats[:, :, :0]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``, ``v`` (B, H, T, Dh); returns all cached keys/values (B, H, T_past + T, Dh)."""
        if self.k is None:
            self.k, self.v, self._buf, self._start = k, v, None, 0
            return k, v
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self.k.requires_grad):
            self.k = torch.cat((self.k, k), dim=2)  # differentiable path: no in-place writes
            self.v = torch.cat((self.v, v), dim=2)
            self._buf, self._start = None, 0
            return self.k, self.v
        n, t = self.k.shape[2], k.shape[2]
        s = self._start if self._in_buffer() else 0
        fits = self._in_buffer() and self._buf[0].shape[2] >= s + n + t and self._buf[0].dtype == k.dtype
        if not fits:  # a new buffer (or a compacted one), the cached keys at its start
            cap = max(2 * (n + t), 64)
            bk = self.k.new_empty(*self.k.shape[:2], cap, self.k.shape[3])  # (B, H, cap, Dh)
            bv = self.v.new_empty(*self.v.shape[:2], cap, self.v.shape[3])
            bk[:, :, :n], bv[:, :, :n] = self.k, self.v
            self._buf, s = (bk, bv), 0
        bk, bv = self._buf
        bk[:, :, s + n : s + n + t], bv[:, :, s + n : s + n + t] = k, v
        self.k, self.v, self._start = bk[:, :, s : s + n + t], bv[:, :, s : s + n + t], s  # (B, H, n + t, Dh)
        return self.k, self.v

    def append_features(self, feats: Tensor) -> Tensor:
        """Append the new tokens' input features (B, H, T, F); returns all of them (B, H, T_past + T, F)."""
        self.feats = feats if self.feats is None else torch.cat((self.feats, feats), dim=2)
        return self.feats

    def reorder(self, index: Tensor) -> None:
        """Keep/reorder batch rows ``index`` (B',) (beam search), keeping the spare capacity."""
        if self.feats is not None and self.feats.shape[0] > 1:
            self.feats = self.feats.index_select(0, index)
        if self.k is None or self.k.shape[0] == 1:
            return
        if self._in_buffer():
            n, s = self.k.shape[2], self._start
            self._buf = tuple(b.index_select(0, index) for b in self._buf)
            self.k, self.v = self._buf[0][:, :, s : s + n], self._buf[1][:, :, s : s + n]
        else:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


@dataclass
class KVCache:
    """Incremental-decoding state: per layer (self, cross) caches, the positions and padding seen so far.

    Attributes:
        layers: one (self-attention, cross-attention) :class:`LayerCache` pair per decoder layer.
        positions: key positions of every cached token (B|1, T_past), or ``None`` before the first step.
        padding: (B, T_past) bool, True = real token, or ``None`` while no step had a padding mask.
        ids: the cached tokens (B, T_past) (what :meth:`replay` runs again).
        rotary_key: the PE's ``rotary_key(length)`` the entries were computed with (PEs with
            ``caps.rotary_depends_on_length`` only: RoPE under a length-dependent scaling).
        top: a host bound on the largest cached position while every step took the default positions
            (``None``: unknown, e.g. positions given by the caller), so a step's range check reads nothing.
    """

    layers: list[tuple[LayerCache, LayerCache]]
    positions: Tensor | None = None
    padding: Tensor | None = None
    ids: Tensor | None = None
    rotary_key: Any = None
    top: int | None = None

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls([(LayerCache(), LayerCache()) for _ in range(n_layers)])

    @property
    def length(self) -> int:
        """Number of cached tokens T_past."""
        return 0 if self.positions is None else self.positions.shape[1]

    def extend(self, ids: Tensor, positions: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Record new tokens ``ids`` (B, T) at ``positions`` (B|1, T) with ``padding`` (B, T) | None.

        Returns the key positions (B|1, T_past + T) and key padding mask (B, T_past + T) | None of
        the self-attention over all cached and new tokens, and stores them. Once any step has a
        padding mask, the cache keeps one (earlier/later steps without a mask count as all real).
        """
        past_len = self.length
        k_pos = positions if self.positions is None else append_positions(self.positions, positions)
        if padding is not None or self.padding is not None:
            past = (
                self.padding
                if self.padding is not None
                else torch.ones(ids.shape[0], past_len, dtype=torch.bool, device=ids.device)
            )
            new = padding if padding is not None else torch.ones_like(ids, dtype=torch.bool)
            padding = torch.cat((past, new), 1)  # (B, T_past + T)
        self.positions, self.padding = k_pos, padding
        self.ids = ids if self.ids is None else torch.cat((self.ids, ids), 1)
        return k_pos, padding

    def replay(
        self, pe: PositionalEncoding | None, ids: Tensor, positions: Tensor, padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Before new tokens ``ids`` (B, T) at ``positions`` (B|1, T) are run: ``None`` when the cached
        entries stay valid, else (every token so far (B, T_all), their positions (B|1, T_all), padding
        (B, T_all) | None) with the cache emptied, to be run again in one forward.

        Only a PE with ``caps.rotary_depends_on_length`` can make the cache stale: when its
        ``rotary_key(length)`` at the grown length differs from the one the entries were computed with.
        """
        if pe is None or not pe.caps.rotary_depends_on_length:
            return None
        seen = [p for p in (positions, self.positions) if p is not None and p.numel()]
        key = pe.rotary_key(max((int(p.max()) + 1 for p in seen), default=1))  # the full forward's length
        if self.positions is None or key == self.rotary_key:
            self.rotary_key = key
            return None
        k_pos, pad = self.extend(ids, positions, padding)
        every = self.ids
        for sc, cc in self.layers:
            for c in (sc, cc):
                c.k = c.v = c.feats = c._buf = None
                c._start = 0
        self.positions = self.padding = self.ids = self.top = None
        self.rotary_key = key
        return every, k_pos, pad

    def reorder(self, index: Tensor) -> None:
        """Select/reorder batch rows (beam search): ``index`` (B',) of row indices."""

        def pick(t: Tensor | None) -> Tensor | None:
            if t is None or t.shape[0] == 1:
                return t
            return t.index_select(0, index)

        for sc, cc in self.layers:
            sc.reorder(index)
            cc.reorder(index)
        self.positions, self.padding, self.ids = pick(self.positions), pick(self.padding), pick(self.ids)
