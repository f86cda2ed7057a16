"""``posformer-eval`` with every window split across processes: ``eval.context_parallel=P``.

One long window may not fit one process; with ``P`` processes each holds ``L/P`` of its tokens
(:mod:`posformer.model.parallel`: positions stay global, attention trades tokens for heads). The
evaluation then runs in ``P`` processes started by :func:`spawn` (``torch.multiprocessing``, gloo on the
CPU, NCCL on CUDA with one GPU per process): each loads the checkpoints and data and walks the same
windows in the same order; every window's inputs, targets and scored mask are sliced per rank
(:func:`split_window`), the model runs with ``parallel=cp``, and the loss sums, token counts and the
per-position curve are added over the group once per row (:func:`combine`), so the numbers are those of
one process. A window whose length is not a multiple of ``P`` (the shorter last chunk of ``nonoverlap``)
is scored whole by rank 0 alone. Rank 0 alone writes the results files.

:func:`check_eval_split` refuses, in one line and before any checkpoint is loaded, what cannot run split:
``P`` above the processes available (CUDA devices; CPU cores), a length or the heads not divisible by
``P``, an encoder-decoder or task checkpoint, the ``streaming`` mode (a KV cache is read unsplit).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from posformer import errors
from posformer.devices import CUDA_ACCELERATORS
from posformer.errors import ConfigError
from posformer.model.parallel import ContextParallel, check_split

__all__ = ["available_processes", "check_eval_split", "combine", "spawn", "split_window"]

KEY = "eval.context_parallel"


def available_processes(accelerator: str) -> int:
    """How many processes can share a window: the CUDA devices, or the CPU cores."""
    if accelerator in CUDA_ACCELERATORS:
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_eval_split(
    context: int,
    *,
    accelerator: str,
    lengths: Iterable[int],
    checkpoints: Mapping[str, Mapping[str, Any]],
    modes: Iterable[str] = (),
) -> None:
    """Refuse, in one line, an ``eval.context_parallel=context`` that cannot run: more processes than
    :func:`available_processes`, a mode other than ``nonoverlap``/``sliding``, a length of ``lengths``
    not divisible by ``context``, or a checkpoint (``checkpoints``: path -> its saved
    ``hyper_parameters``) that is not a decoder-only language model or whose heads do not divide."""
    if context == 1:
        return
    have = available_processes(accelerator)
    if context > have:
        what = "CUDA devices" if accelerator in CUDA_ACCELERATORS else "CPU cores"
        raise ConfigError(
            f"{KEY}={context} needs {context} processes, one per device, but this machine has {have} "
            f"{what}: use {KEY}<={max(have, 1)}."
        )
    unsplit = [m for m in modes if m not in ("nonoverlap", "sliding")]
    if unsplit:
        raise ConfigError(
            f"{KEY}={context} splits the windows of the nonoverlap and sliding modes; eval.modes has "
            f"{unsplit} (a cache read token by token): drop it, or use {KEY}=1."
        )
    for length in lengths:
        check_split(context, length=int(length), what=f"eval.lengths has {length}")
    for path, hp in checkpoints.items():
        model, data = dict(hp.get("model") or {}), dict(hp.get("data") or {})
        if model.get("kind", "decoder") != "decoder" or data.get("task_type", "lm") != "lm":
            kind = model.get("kind") if model.get("kind", "decoder") != "decoder" else data.get("task_type")
            raise ConfigError(
                f"{KEY}={context} splits the windows of decoder-only language models; {path} is a "
                f"{kind!r} checkpoint: evaluate it with {KEY}=1."
            )
        if model.get("n_heads") is not None:
            try:
                check_split(context, n_heads=int(model["n_heads"]))
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------------- scoring
def split_window(cp: ContextParallel | None, *tensors: Tensor) -> tuple[bool, int, int, tuple[Tensor, ...]]:
    """This rank's part of a batch of windows: ``tensors`` (B, T) each -> (B, T/P) when ``cp`` splits
    them (``P > 1`` and ``T`` a multiple of ``P``), else whole. Returns ``(split, start, end, parts)``:
    ``[start, end)`` the window positions held here."""
    T = tensors[0].shape[1]
    if cp is None or cp.size == 1 or T % cp.size:
        return False, 0, T, tensors
    start, end = cp.local_range(T // cp.size)
    return True, start, end, tuple(cp.split(t) for t in tensors)


def counts_here(cp: ContextParallel | None, split: bool) -> bool:
    """Whether this rank scores a batch: every rank of a split one, rank 0 alone of a whole one."""
    return split or cp is None or cp.rank == 0


def combine(cp: ContextParallel | None, *sums: Tensor) -> tuple[Tensor, ...]:
    """``sums`` (each on the device, any shape) added over the group (one collective each); as they are
    without a group."""
    if cp is None or cp.size == 1:
        return sums
    out = []
    for s in sums:
        s = s.clone()
        dist.all_reduce(s, group=cp.group)
        out.append(s)
    return tuple(out)


# ---------------------------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    size: int,
    accelerator: str,
    port: int,
    threads: int,
    errors_out: Any,
    fn: Callable[..., None],
    args: tuple[Any, ...],
) -> None:
    """One process of :func:`spawn`: join the group, run ``fn(cp, *args)``; a posformer error is handed
    back to the launcher as ``(class name, message)``."""
    torch.set_num_threads(threads)
    cuda = accelerator in CUDA_ACCELERATORS
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        fn(ContextParallel.of(), *args)
    except errors.PosformerError as exc:
        errors_out.put((type(exc).__name__, str(exc)))
        raise
    finally:
        dist.destroy_process_group()


def spawn(size: int, accelerator: str, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Run ``fn(cp, *args)`` in ``size`` new processes forming one context-parallel group ``cp`` (rank
    ``r`` on CUDA device ``r``, or on the CPU with this process's threads shared out); returns when all
    have finished. A posformer error in one is raised here as the same class and message; ``fn`` must be
    importable (a module-level function) and ``args`` picklable."""
    ctx = mp.get_context("spawn")
    errors_out = ctx.SimpleQueue()
    threads = max(1, torch.get_num_threads() // size)
    try:
        mp.spawn(
            _worker,
            args=(size, accelerator, _free_port(), threads, errors_out, fn, args),
            nprocs=size,
            join=True,
        )
    except mp.ProcessRaisedException as exc:
        if not errors_out.empty():
            name, message = errors_out.get()
            raise getattr(errors, name, errors.PosformerError)(message) from None
        raise exc
