"""Learned absolute positions (Gehring et al. 2017; used in BERT/GPT-2): ``x + E[pos]`` with
``E = nn.Embedding(max_len, d_model)``.

The model adds the table in units of the token embeddings' std (``ModelConfig.embedding_std``: 1 for
the 2017 recipe, sqrt(2/d) for decoder-only), so ``init_std=1`` (the default) starts the position
signal at the tokens' scale, like the unit-amplitude sinusoid it replaces. (Until the parity work with
x-transformers the default was 0.02: in a decoder-only model that is 1/50 of the tokens' scale, and the
table, multiplied by sqrt(2/d), learns slowly under Adam: +0.15 nats/char at 400 steps, seed 0;
docs/results.md.)

Positions at or past ``max_len`` raise :class:`~posformer.errors.PositionRangeError` naming both
numbers (no opaque index error). Under randomized-position training, size the table to ``N_max``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.errors import PositionRangeError
from posformer.pe import register
from posformer.pe.base import PositionalEncoding, option_error


@register("learned")
class LearnedEncoding(PositionalEncoding):
    paper = "Gehring et al. 2017"
    extrapolates = "no (fixed table)"

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        causal: bool = False,
        n_layers: int = 1,
        max_len: int = 1024,
        init_std: float = 1.0,
    ) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, causal=causal, n_layers=n_layers)
        if max_len < 1:
            raise option_error("learned", "max_len", max_len, "must be >= 1")
        self.max_len = int(max_len)
        self.table = nn.Embedding(self.max_len, d_model)
        nn.init.normal_(self.table.weight, std=init_std)

    @property
    def max_positions(self) -> int:
        return self.max_len

    def range_fix(self, dtype: torch.dtype | None, *, centred: bool = False) -> str:
        return (
            f"raise model.pe_options.max_len={self.max_len} to at least the sequence length, shorten the "
            "input, or use a PE without a length limit (e.g. rope, alibi, sinusoidal)"
        )

    def check_positions(
        self,
        positions: Tensor,
        top: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        centred: bool = False,
    ) -> None:
        """The table's range, and integer positions only (rows are looked up, not interpolated)."""
        super().check_positions(positions, top, dtype, centred=centred)
        if positions.is_floating_point():
            raise PositionRangeError(
                f"pe={self.name!r} looks positions up in a table and needs integer positions, "
                f"got dtype {positions.dtype}."
            )

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """The model has range-checked ``positions`` (:meth:`check_positions`) before this hook."""
        return x + self.table(positions).to(x.dtype)
