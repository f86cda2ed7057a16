"""Evaluation loaders that shard batches over ranks without padding.

Lightning's ``DistributedSampler`` pads the last shard with repeated samples, which would count
some sequences twice in per-length results. :class:`ShardedLoader` gives rank ``r`` every
``world_size``-th batch instead (all batches in a single process); the summed statistics of
:meth:`posformer.lit.PosformerModule.evaluate_batch` are then all-reduced, so results are exact.
(Exact resumption of training is the datamodule's job: see ``posformer/data/base.py``.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ShardedLoader:
    """Yields every ``world_size``-th batch of ``loader`` (all of them in a single process)."""

    def __init__(self, loader: Iterable):
        self.loader = loader

    def __len__(self) -> int:
        rank, world = _rank_world()
        n = len(self.loader)  # type: ignore[arg-type]
        return (n - rank + world - 1) // world

    def __iter__(self) -> Iterator:
        rank, world = _rank_world()
        for i, batch in enumerate(self.loader):
            if i % world == rank:
                yield batch

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, ... of the wrapped loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
