"""Position tensors: contiguous, offset and randomized (Ruoss et al. 2023).

Randomized positional encodings ("Randomized Positional Encodings Boost Length Generalization of
Transformers", Ruoss et al. 2023): during training each sequence of length ``T`` gets the sorted
positions of a random ``T``-subset of ``[0, N_max)`` instead of ``0 … T-1``; evaluation uses the
ordinary positions. The model then sees every position up to ``N_max`` during training, so
evaluation lengths up to ``N_max`` use positions it has seen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posformer.errors import ConfigError


def contiguous_positions(
    batch: int, length: int, offset: int = 0, device: torch.device | None = None
) -> Tensor:
    """``offset … offset+length-1`` as (1, T) int64 (broadcast over the batch)."""
    del batch
    return torch.arange(offset, offset + length, device=device).unsqueeze(0)


def randomized_positions(
    batch: int,
    length: int,
    n_max: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Sorted positions sampled without replacement from ``[0, n_max)``: (B, T) int64.

    Each row is an independent sample (``torch.rand(...).topk`` gives a uniform subset).
    """
    if length > n_max:
        raise ConfigError(
            f"randomized positions: sequence length {length} exceeds positions.n_max={n_max}; raise n_max "
            f"to at least {length} (Ruoss et al. use N_max well above the longest evaluation length)."
        )
    scores = torch.rand(
        batch, n_max, generator=generator, device=device if generator is None else generator.device
    )
    idx = scores.topk(length, dim=1).indices  # (B, T) distinct, unsorted
    return idx.sort(dim=1).values.to(device)
