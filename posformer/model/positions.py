"""Position tensors: the one module where positions are made and checked.

Positions travel as an explicit tensor of shape ``(B, T)`` or ``(1, T)`` (broadcast over the
batch); integer dtypes are ordinary, offset or sparse positions, floating dtypes fractional ones.

* :func:`as_positions` normalises user input to 2-D;
* :func:`arange_positions`: ``0 … T-1`` (or from an offset) for a length;
* :func:`default_positions` / :func:`continued_positions` are the positions a model uses when it is
  given none (``0 … T-1``, or continuing a decoding cache);
* :func:`append_positions` joins cached and new key positions;
* :func:`is_arange` tells attention when the offset-vector fast path applies;
* :func:`document_positions`: positions that restart at every document of a packed row
  (``segment_ids``), so each document sees the positions it would have alone;
* :func:`randomized_positions` are the training positions of Ruoss et al. 2023 ("Randomized
  Positional Encodings Boost Length Generalization of Transformers"): each sequence of length ``T``
  gets the sorted positions of a random ``T``-subset of ``[0, N_max)`` instead of ``0 … T-1``;
  validation uses the ordinary positions, evaluation either (``eval.task_positions``; the reference
  code samples them in every forward, evaluation included). The model then sees every position up to
  ``N_max`` during training, so evaluation lengths up to ``N_max`` use positions it has seen.
* :func:`pose_positions`: PoSE (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via
  Positional Skip-wise Training"): the ``T`` positions of a row are cut into ``N`` chunks at random
  points, and chunk ``c`` is moved forward by a skip ``u_c`` (``u_0 = 0``, ``u_c`` uniform in
  ``[u_{c-1}, N_max - T]``), so contiguous pieces cover relative distances up to ``N_max - 1``;
* :func:`float_positions`: random fractional positions, the sorted values of ``T`` uniform draws from
  ``[0, N_max - 1]`` (float32): the continuous counterpart of the randomized integers.

This module imports nothing from ``posformer.pe``: PEs receive positions, they never make them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from posformer.errors import ConfigError

#: ``positions.sampler``: the training positions besides ``positions.randomized`` (``none``: ordinary)
POSITION_SAMPLERS = ("none", "pose", "float")

if TYPE_CHECKING:
    from posformer.model.cache import KVCache
    from posformer.pe.base import PositionalEncoding


def as_positions(positions: Tensor) -> Tensor:
    """Normalise positions (T,) or (B|1, T) to 2-D (B|1, T)."""
    if positions.dim() == 1:
        return positions.unsqueeze(0)
    if positions.dim() != 2:
        raise ValueError(f"positions must have shape (T,) or (B, T), got {tuple(positions.shape)}")
    return positions


def arange_positions(length: int, offset: int = 0, device: torch.device | str | None = None) -> Tensor:
    """Contiguous positions ``offset … offset+length-1`` as a (1, T) int64 tensor (broadcast over B)."""
    return torch.arange(offset, offset + length, device=device).unsqueeze(0)


def default_positions(ids: Tensor, offset: int = 0) -> Tensor:
    """Contiguous positions ``offset … offset+T-1`` for ``ids`` (B, T), as a (1, T) int64 tensor."""
    return arange_positions(ids.shape[1], offset, ids.device)


def continued_positions(ids: Tensor, cache: KVCache | None) -> Tensor:
    """Default positions of new tokens ``ids`` (B, T): (B|1, T).

    ``0 … T-1`` without a cache, else continuing from the last cached position of each row
    (``last + 1 …``; equals ``cache.length …`` for ordinary positions, and keeps an explicit offset
    going).
    """
    if cache is None or cache.positions is None:
        return default_positions(ids)
    last = cache.positions[:, -1:]  # (B|1, 1)
    return last + 1 + torch.arange(ids.shape[1], device=ids.device, dtype=last.dtype)


def append_positions(past: Tensor, new: Tensor) -> Tensor:
    """Cached positions (B|1, T_past) followed by new ones (B|1, T): (B|1, T_past + T).

    A batch of 1 on either side is broadcast to the other's batch.
    """
    if past.shape[0] != new.shape[0]:
        batch = max(past.shape[0], new.shape[0])
        past, new = past.expand(batch, -1), new.expand(batch, -1)
    return torch.cat((past, new), 1)


def is_arange(pos: Tensor) -> bool:
    """Whether ``pos`` (B|1, T) is one row of consecutive integers (``B == 1``, any start)."""
    if pos.shape[0] != 1 or pos.is_floating_point():
        return False
    t = pos.shape[1]
    if t <= 1:
        return True
    row = pos[0]
    return bool(
        int(row[-1]) - int(row[0]) == t - 1
        and torch.equal(row, torch.arange(int(row[0]), int(row[0]) + t, device=row.device, dtype=row.dtype))
    )


def document_positions(segment_ids: Tensor) -> Tensor:
    """Positions restarting at 0 at every document of packed rows: ``segment_ids`` (B, T) -> (B, T) int64.

    A document is a run of equal ids; a new one starts wherever the id changes from the previous
    token (``[[0, 0, 0, 1, 1, 2]] -> [[0, 1, 2, 0, 1, 0]]``).
    """
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must have shape (B, T), got {tuple(segment_ids.shape)}")
    idx = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)  # (B, T)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    # index of the first token of each token's document
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


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


def pose_positions(
    batch: int,
    length: int,
    n_max: int,
    chunks: int = 2,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """PoSE positions (module docstring): (B, T) int64, increasing, all below ``n_max``.

    Token ``t`` of a row is in chunk ``c(t)`` (the number of the row's ``chunks - 1`` cut points, drawn
    uniformly from ``[1, T - 1]``, at or before ``t``) and has position ``t + u_{c(t)}``.
    """
    if length > n_max:
        raise ConfigError(
            f"PoSE positions: sequence length {length} exceeds positions.n_max={n_max} (the target length "
            f"the chunks are spread over); raise n_max to at least {length}."
        )
    at = device if generator is None else generator.device
    slack = n_max - length  # the largest skip
    cuts = torch.randint(1, max(length, 2), (batch, chunks - 1), generator=generator, device=at)  # (B, N-1)
    draws = torch.rand(batch, chunks - 1, generator=generator, device=at, dtype=torch.float64)
    skips = [torch.zeros(batch, dtype=torch.int64, device=at)]
    for c in range(chunks - 1):  # u_c uniform in [u_{c-1}, slack]
        span = (slack - skips[-1] + 1).to(torch.float64)
        skips.append(skips[-1] + (draws[:, c] * span).floor().long().clamp(max=slack - skips[-1]))
    skip = torch.stack(skips, 1)  # (B, N)
    t = torch.arange(length, device=at)  # (T,)
    chunk = (cuts.unsqueeze(1) <= t.view(1, -1, 1)).sum(-1)  # (B, T): cut points at or before t
    return (t + skip.gather(1, chunk)).to(device)


def float_positions(
    batch: int,
    length: int,
    n_max: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Sorted uniform fractional positions in ``[0, n_max - 1]``: (B, T) float32."""
    at = device if generator is None else generator.device
    draws = torch.rand(batch, length, generator=generator, device=at, dtype=torch.float64) * (n_max - 1)
    return draws.sort(dim=1).values.float().to(device)


def position_limit(
    model: nn.Module, dtype: torch.dtype | None = None, *, centred: bool = False
) -> tuple[int, PositionalEncoding] | None:
    """The fewest positions any PE of ``model`` represents and that PE (``dtype``: computing in it, the
    PE's ``max_positions_in``; else its ``max_positions``); ``None``: no PE is limited. ``centred``: in
    forwards over ``0 … T-1`` without a cache (evaluation), whose origin a PE may move."""
    from posformer.pe.base import PositionalEncoding  # the PEs import this module

    pes = [m for m in model.modules() if isinstance(m, PositionalEncoding)]
    limits = [
        (pe.max_positions if dtype is None else pe.max_positions_in(dtype, centred=centred), pe) for pe in pes
    ]
    return min(((n, pe) for n, pe in limits if n is not None), key=lambda lim: lim[0], default=None)
