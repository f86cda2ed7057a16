"""The positions a PE represents: its limits, the origin a forward may move, and the range check.

:class:`PositionRange` is a mixin of :class:`~posformer.pe.base.PositionalEncoding`: a table's length
(``max_positions``: learned), a limit of the compute dtype (``max_positions_in``: xPos' decay), the
origin a forward without a cache may subtract from its positions (``rotary_origin``: xPos, centred
past its range), the end of the error line (``range_fix``) and the check itself (``check_positions``),
which the model runs before any work, reading the positions only where their host bound reaches the
limit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.errors import PositionRangeError


class PositionRange:
    """The range half of the PE interface (the defaults: unlimited, origin 0)."""

    name: str | None

    @property
    def max_positions(self) -> int | None:
        """Largest number of positions this PE can represent (``None``: unbounded)."""
        return None

    def max_positions_in(self, dtype: torch.dtype, *, centred: bool = False) -> int | None:
        """:attr:`max_positions` computing in ``dtype``, or fewer where a table leaves its range (xPos).
        ``centred``: in a forward that moves its positions' origin by :meth:`rotary_origin`."""
        return self.max_positions

    def rotary_origin(self, length: int, dtype: torch.dtype) -> int:
        """The origin a forward without a cache subtracts from its positions ``0 … length-1`` before it
        builds the rotary tables (the same for its queries and keys): 0 for every PE but one whose
        scores depend on position differences only and whose tables leave ``dtype``'s range past
        :meth:`max_positions_in` (xPos). Such a PE represents the shifted positions ``(-n, n)``."""
        return 0

    def range_fix(self, dtype: torch.dtype | None, *, centred: bool = False) -> str:  # the line's end
        return "shorten the input, or use a PE without a length limit (e.g. rope, alibi, sinusoidal)"

    def check_positions(
        self,
        positions: Tensor,
        top: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        centred: bool = False,
    ) -> None:
        """Raise :class:`PositionRangeError` for ``positions`` out of this PE's range (in ``dtype``:
        :meth:`max_positions_in`; ``centred``: a forward that moves their origin, :meth:`rotary_origin`).
        ``top``: a host bound on their largest value (``T - 1`` for ``0 … T-1`` and packed documents); the
        tensor is read (on CUDA a host sync) only where ``top`` reaches the limit, or is unknown under a
        table's limit (a dtype's range alone is checked by ``top`` only)."""
        table = self.max_positions
        limit = table if dtype is None else self.max_positions_in(dtype, centred=centred)
        if limit is None or positions.numel() == 0 or (top < limit if top is not None else table is None):
            return
        top = int(positions.max())  # a bound is not the largest value (packed documents restart at 0)
        if top >= limit:
            where = "" if limit == table else f" in {str(dtype).removeprefix('torch.')}"
            raise PositionRangeError(
                f"pe={self.name!r} represents {limit} positions{where}, but the input needs position {top} "
                f"(sequence length {top + 1}): {self.range_fix(dtype, centred=centred)}."
            )
