"""Evaluation loaders that shard batches over ranks without padding.

Lightning's ``DistributedSampler`` pads the last shard with repeated samples, which would count
some sequences twice in per-length results. :class:`ShardedLoader` gives rank ``r`` every
``world_size``-th batch instead (all batches in a single process); the summed statistics of
:meth:`posformer.lit.PosformerModule.evaluate_batch` are then all-reduced, so results are exact.

With sequences split across processes (``context`` processes per sequence,
:mod:`posformer.lit.context_parallel`), the loaders shard by *data* rank: global rank ``r`` is data rank
``r // context`` of ``world // context``, and the ``context`` processes of a data rank get the same
batches (each then takes its slice of every row).
(Exact resumption of training is the datamodule's job: see ``posformer/data/base.py``.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

from posformer.errors import DataError


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _data_rank_world(context: int) -> tuple[int, int]:
    """This process's data rank and the number of data ranks: ``context`` processes share each batch."""
    rank, world = _rank_world()
    return rank // context, max(world // context, 1)


class ShardedLoader:
    """Yields every ``world_size``-th batch of ``loader`` (all of them in a single process); with
    ``context`` processes per sequence, every ``world_size / context``-th batch of its data rank."""

    def __init__(self, loader: Iterable, context: int = 1):
        self.loader = loader
        self.context = int(context)

    def __len__(self) -> int:
        rank, world = _data_rank_world(self.context)
        n = len(self.loader)  # type: ignore[arg-type]
        if 0 < n < world:  # the same on every rank, so every rank raises (no rank waits in a collective)
            raise DataError(
                f"{n} evaluation batch(es) cannot be shared by {world} processes (each needs at least one): "
                "raise data.n_val, lower data.batch_size (or data.eval_batch_size), or use fewer devices."
            )
        return (n - rank + world - 1) // world

    def __iter__(self) -> Iterator:
        rank, world = _data_rank_world(self.context)
        for i, batch in enumerate(self.loader):
            if i % world == rank:
                yield batch

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, ... of the wrapped loader
        if name in ("loader", "context"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class ResumableLoader(ShardedLoader):
    """The training loader: exact mid-epoch resumption and per-rank sharding.

    Lightning stores ``state_dict()`` of stateful training loaders in every checkpoint and calls
    ``load_state_dict()`` before the first ``iter()`` after a resume. The state is the number of
    batches the loop *trained on* in the current epoch (``consumed``, set by the training module at
    each batch start, so pre-fetched batches do not count). On resume the next iteration skips them:
    in the sampler when it supports it (``posformer.data.ResumableSampler.skip``: no data is loaded),
    otherwise by drawing and dropping batches. The epoch itself is the sampler's (Lightning calls
    ``sampler.set_epoch``, reached through attribute forwarding).

    Under distributed training every rank walks the same (deterministic) batch sequence, keeps every
    ``world_size``-th batch and stops after ``len(loader) // world_size`` batches, so all ranks take the
    same number of steps.
    """

    def __init__(self, loader: Iterable, context: int = 1):
        super().__init__(loader, context)
        self.consumed = 0
        self._skip = 0

    def __len__(self) -> int:
        _, world = _data_rank_world(self.context)
        return len(self.loader) // world  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int]:
        return {"consumed": int(self.consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state.get("consumed", 0))

    def __iter__(self) -> Iterator:
        rank, world = _data_rank_world(self.context)
        skip, self._skip = self._skip, 0
        self.consumed = skip
        try:
            limit = len(self.loader) // world  # type: ignore[arg-type]
        except TypeError:  # an iterable without a length
            limit = None
        sampler = getattr(self.loader, "sampler", None)
        batch_size = getattr(self.loader, "batch_size", None)
        start = 0  # global batch index of the first batch the loader yields
        if skip and hasattr(sampler, "skip") and batch_size:
            sampler.skip = skip * world * batch_size  # whole shards: keeps the rank alignment
            start = skip * world
        index = start // world  # this rank's batch index
        for i, batch in enumerate(self.loader, start=start):
            if i % world != rank:
                continue
            if limit is not None and index >= limit:
                break
            if index >= skip:
                yield batch
            index += 1
