"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer").

Each pair of query/key dimensions ``(x_a, x_b)`` of every head is rotated by the angle
``pos · θ_i`` with ``θ_i = base^(-2i/R)``, ``i = 0 … R/2-1``, where ``R = rotary_fraction · Dh`` is
the number of rotated dimensions (partial rotary leaves the last ``Dh - R`` dimensions untouched):

    x'_a = x_a cos(pos θ_i) - x_b sin(pos θ_i)
    x'_b = x_b cos(pos θ_i) + x_a sin(pos θ_i)

so that ``q'_m · k'_n`` depends on ``m - n`` only. Pair layouts:

``half`` (default; GPT-NeoX / HF Llama): pair ``i`` is ``(x_i, x_{i+R/2})``.
``interleaved`` (RoFormer, GPT-J, Meta's Llama reference): pair ``i`` is ``(x_{2i}, x_{2i+1})``.

Checkpoints of one layout need their q/k projections permuted to run in the other
(:func:`posformer.pe.rope.layout.convert_projection`). ``head_fraction < 1`` rotates only the first
``round(H · head_fraction)`` heads; the others attend without positions.

``proportion < 1`` is proportional RoPE (p-RoPE, Gemma 4; HF's ``rope_type="proportional"``): the
frequencies keep their exponents over all ``R`` rotated dims, ``θ_i = base^(-2i/R)``, but only the
first ``k = int(proportion · R // 2)`` (the fastest) rotate; the ``R/2 - k`` slowest are set to 0, so
their pairs pass through unrotated (cos 0 = 1, sin 0 = 0). ``rotary_fraction`` instead shortens
``R``, which respaces the exponents so the slowest rotated frequency stays ``≈ 1/base``
(``docs/encodings.md``, "p-RoPE versus rotary_fraction").

Angles are computed in float64 from the positions and stored as float32 cos/sin; a table for
integer positions is cached and keyed by device and everything the frequencies depend on (base,
rotary dims, scaling and, for dynamic scaling, the sequence length), so it is never stale.
Fractional positions (interpolation) are computed directly. ``scaling`` selects a
context-extension method from :data:`posformer.pe.rope.scaling.ROPE_SCALINGS`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from posformer.pe import register
from posformer.pe.base import Capabilities, PositionalEncoding, option_error


@register("rope")
class RotaryEncoding(PositionalEncoding):
    #: ``rotary_depends_on_length`` is an upper bound: instances keep it only under a scaling whose
    #: frequencies follow the sequence length (:data:`posformer.pe.rope.scaling.LENGTH_DEPENDENT`)
    paper = "Su et al. 2021"
    extrapolates = "a little (more with scaling)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
        layout: str = "half",
        scaling: dict[str, Any] | None = None,
        head_fraction: float = 1.0,
        proportion: float = 1.0,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        name = self.name or "rope"
        if not 0.0 < head_fraction <= 1.0:
            raise option_error(name, "head_fraction", head_fraction, "must be in (0, 1] (rotated heads)")
        #: the first ``rotary_heads`` heads rotate, the others attend without positions (NoPE heads)
        self.rotary_heads = max(1, int(round(n_heads * head_fraction)))
        if not 0.0 < rotary_fraction <= 1.0:
            raise option_error(name, "rotary_fraction", rotary_fraction, "must be in (0, 1]")
        rot = int(round(self.head_dim * rotary_fraction))
        if rot < 2 or rot % 2:
            raise option_error(
                name,
                "rotary_fraction",
                rotary_fraction,
                f"rotary dims = head_dim {self.head_dim} x {rotary_fraction} = {rot}, but rotary dims must "
                "be even and >= 2 (dimensions rotate in pairs); pick a head_dim (d_model/n_heads) or "
                "fraction that gives an even number",
            )
        if layout not in ("half", "interleaved"):
            raise option_error(name, "layout", layout, "use 'half' or 'interleaved'")
        if base <= 1:
            raise option_error(name, "base", base, "must be > 1")
        self.base = float(base)
        self.rotary_dim = rot
        #: p-RoPE: the first ``rotated_pairs`` frequencies rotate, the slower ``R/2 - rotated_pairs`` are 0
        self.rotated_pairs = _rotated_pairs(name, proportion, rot)
        self.layout = layout
        self._inv_freq: dict[tuple, Tensor] = {}
        self.set_scaling(scaling)

    def set_scaling(self, scaling: dict[str, Any] | None) -> None:
        """Use the context-extension ``scaling`` from now on (``None``: plain RoPE); validated first.

        Evaluation calls this to try a scaling on a trained model.
        """
        if scaling:
            from posformer.pe.rope.hf import normalize_scaling
            from posformer.pe.rope.scaling import validate_scaling

            scaling = normalize_scaling(scaling, self.name or "rope", base=self.base)  # HF's names too
            if scaling:
                validate_scaling(dict(scaling), self.name or "rope", rotary_dim=self.rotary_dim)
        self.scaling = dict(scaling) if scaling else None
        self.refresh_capabilities()  # rotary_depends_on_length follows the scaling

    def describe(self) -> Capabilities:
        """``rotary_depends_on_length`` under a length-dependent scaling (dynamic NTK, LongRoPE)."""
        from posformer.pe.rope.scaling import depends_on_length

        return replace(type(self).capabilities, rotary_depends_on_length=depends_on_length(self.scaling))

    # ------------------------------------------------------------------ frequencies
    def base_inv_freq(self, device: torch.device | None = None) -> Tensor:
        """Unscaled θ_i = base^(-2i/R), float64 (R/2,)."""
        key = ("inv_freq", str(device), self.base, self.rotary_dim)
        if key not in self._inv_freq:
            i = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=device)
            self._inv_freq = {key: self.base ** (-i / self.rotary_dim)}
        return self._inv_freq[key]

    def frequencies(self, seq_len: int, device: torch.device | None = None) -> tuple[Tensor, float, tuple]:
        """(inv_freq float64 (R/2,), attention factor, cache key) for sequences of ``seq_len``."""
        if not self.scaling:
            inv_freq, factor, key = self.base_inv_freq(device), 1.0, (self.base, self.rotary_dim)
        else:
            from posformer.pe.rope.scaling import apply_scaling

            inv_freq, factor, scaled = apply_scaling(self, seq_len, device)
            key = (self.base, self.rotary_dim, scaled)
        if self.rotated_pairs < self.rotary_dim // 2:  # p-RoPE: the slowest frequencies are zeroed
            k = self.rotated_pairs
            inv_freq = torch.cat((inv_freq[:k], inv_freq.new_zeros(len(inv_freq) - k)))  # (R/2,)
            key = (*key, ("proportion", self.rotated_pairs))
        return inv_freq, factor, key

    def rotary_key(self, length: int) -> tuple:
        """The frequencies' identity at ``length`` positions (changes with it under dynamic NTK only)."""
        return self.frequencies(length)[2]

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """float32 cos/sin of shape (B|1, 1, T, R/2) for ``positions`` (B|1, T).

        The angles are computed from the positions themselves (float64), on their device: no table
        sized by the largest position, so nothing is read back to the host — except the sequence
        length under a length-dependent scaling (``caps.rotary_depends_on_length``: dynamic NTK,
        LongRoPE), whose frequencies follow it.
        """
        seq_len = 1
        if self.caps.rotary_depends_on_length and positions.numel():
            seq_len = int(positions.max()) + 1
        inv_freq, factor, _ = self.frequencies(seq_len, positions.device)
        angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # (B|1, T, R/2)
        cos, sin = (angle.cos() * factor).float(), (angle.sin() * factor).float()
        return cos.unsqueeze(1), sin.unsqueeze(1)

    # ------------------------------------------------------------------ rotation
    def rotary_tables(self, positions: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor]:
        """float32 ``(C, S)`` of shape (B|1, 1, T, R) for ``positions`` (B|1, T).

        ``x' = x·C + swap(x)·S`` where ``swap`` exchanges the two members of every pair, so
        ``C = (cos, cos)`` and ``S = (-sin, sin)`` laid out like the pairs.
        """
        cos, sin = self.cos_sin(positions)  # (B|1, 1, T, R/2) each
        if self.layout == "half":
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)

    def _swap_pairs(self, rot: Tensor) -> Tensor:
        """(x_a, x_b) -> (x_b, x_a) for every pair of ``rot`` (..., R)."""
        if self.layout == "half":
            return rot.roll(self.rotary_dim // 2, dims=-1)  # (a, b) -> (b, a)
        return rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (B, H, T, R/2, 2) -> swapped -> (..., R)

    def apply_rotary(self, x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        """Rotate the first R dims of ``x`` (B, H, T, Dh) with ``tables`` from :meth:`rotary_tables`."""
        c, s = (t.to(x.dtype) for t in tables)
        h = self.rotary_heads
        if h < x.shape[1]:  # head subset: the other heads pass through
            return torch.cat((self.apply_rotary(x[:, :h], tables), x[:, h:]), dim=1)
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * c + self._swap_pairs(x) * s
        rot = x[..., :r]
        return torch.cat((rot * c + self._swap_pairs(rot) * s, x[..., r:]), dim=-1)


def _rotated_pairs(name: str, proportion: float, rotary_dim: int) -> int:
    """How many of the ``rotary_dim / 2`` frequencies rotate under p-RoPE ``proportion`` (HF's
    ``int(partial_rotary_factor · head_dim // 2)``); refused when outside (0, 1] or when none would."""
    if not 0.0 < proportion <= 1.0:
        rule = "must be in (0, 1] (the share of frequencies that rotate)"
        raise option_error(name, "proportion", proportion, rule)
    pairs = int(proportion * rotary_dim // 2)
    if pairs < 1:
        raise option_error(
            name,
            "proportion",
            proportion,
            f"rotates int({proportion} x {rotary_dim} // 2) = 0 of the {rotary_dim // 2} frequencies; use at "
            f"least {2 / rotary_dim:.4g}, or pe=nope for no positions",
        )
    return pairs
