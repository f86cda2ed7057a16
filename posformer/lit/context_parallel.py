"""Training and scoring with sequences split across processes: the pieces a Lightning step needs.

The processes form a mesh of ``data × context`` (:func:`context_mesh`): the ``context`` processes of one
row of the mesh share every sequence of the same batches (rank ``r`` of them holds tokens
``[r·T/P, (r+1)·T/P)``, :func:`split_batch`), the ``data`` rows see different batches. The model runs
split through :mod:`posformer.model.parallel`; what changes in a step is how its sums are reduced:

* :func:`sequence_loss`: the loss over the whole sequence, its token count summed over the context
  group, so a split step trains the same model as an unsplit one;
* :func:`split_stats`: :func:`posformer.metrics.sequence_stats` of the whole rows, summed over the
  context group, and counted once per data row of the mesh (on context rank 0), so the world-wide sum of
  evaluation statistics is that of the unsplit batches;
* :func:`split_accuracy`: the token accuracy of the whole rows (what a training step logs);
* :func:`shared_positions`: randomized positions of the whole rows, drawn once per context group
  (broadcast from its rank 0), this rank's slice.

``trainer.context_parallel=P`` turns this on in a training run (:class:`posformer.lit.PosformerModule`
builds the mesh in ``setup``); :func:`check_context_parallel` refuses, before any work, what cannot
run split.

Every reduction is a collective on tensors of the step's device: nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from posformer.errors import ConfigError
from posformer.metrics import SUMS
from posformer.model.parallel import ContextParallel, check_split
from posformer.model.positions import randomized_positions

__all__ = [
    "check_context_parallel",
    "context_mesh",
    "sequence_loss",
    "shared_positions",
    "split_accuracy",
    "split_batch",
    "split_stats",
]


def check_context_parallel(
    context: int,
    *,
    world: int | None,
    model: Mapping[str, Any],
    task_type: str,
    length: int | None,
) -> None:
    """Refuse, in one line and before any work, a ``trainer.context_parallel=context`` that cannot run:
    not dividing the ``world`` processes (``None``: not known before launch), an encoder-decoder model,
    attention dropout (the split run cannot draw the unsplit run's masks), heads or the training rows'
    width ``length`` (``data.block_size``) not divisible by ``context``, or data whose rows have no
    fixed width (``task_type`` other than ``lm``)."""
    if context == 1:
        return
    where = "trainer.context_parallel"
    if world is not None and world % context:
        raise ConfigError(
            f"{where}={context} must divide the {world} processes (trainer.devices x num_nodes): use a "
            f"divisor of {world}, or {context} x N devices."
        )
    if model.get("kind") != "decoder":
        raise ConfigError(
            f"{where}={context} splits the sequences of a decoder-only model; model.kind="
            f"{model.get('kind')!r} is not supported yet: use {where}=1 (plain data parallelism)."
        )
    if float(model.get("attn_dropout") or 0.0) > 0:
        raise ConfigError(
            f"{where}={context} cannot drop attention probabilities as one process would (each process "
            f"draws the masks of its heads): set model.attn_dropout=0 or {where}=1."
        )
    kinds = [kd or {} for kd in [*(model.get("layer_kinds") or {}).values(), model.get("attention_knobs")]]
    split_off = [k for k in ("qk_norm", "output_gate", "softcap", "ssmax") if any(kd.get(k) for kd in kinds)]
    split_off += ["sinks: token"] * any(kd.get("sinks") == "token" for kd in kinds)
    if split_off:
        raise ConfigError(
            f"{where}={context} does not split attention with {', '.join(split_off)} yet: drop it or use "
            f"{where}=1."
        )
    if task_type != "lm":
        raise ConfigError(
            f"{where}={context} splits rows of one fixed width; the {task_type!r} data's rows vary in "
            "width: use language-modelling data (data=text, corpus or hub: rows of data.block_size tokens)."
        )
    check_split(context, n_heads=int(model["n_heads"]), length=length, what="data.block_size")


def context_mesh(context: int, device_type: str) -> tuple[Any, ContextParallel]:
    """The ``(data, context)`` device mesh of the initialised world and this process's context group.

    Ranks ``d·context … d·context + context - 1`` share sequences (data row ``d``); refused in one line
    when the world is not a multiple of ``context``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if context < 1 or world % context:
        raise ConfigError(
            f"context_parallel={context} must divide the {world} processes (devices x num_nodes): "
            f"use a divisor of {world}, or {context} x N devices."
        )
    mesh = init_device_mesh(device_type, (world // context, context), mesh_dim_names=("data", "context"))
    return mesh, ContextParallel.of(mesh.get_group("context"))


def split_batch(batch: Mapping[str, Any], cp: ContextParallel) -> dict[str, Any]:
    """This rank's slice of every per-token tensor (B, T) -> (B, T/P) of a decoder batch (``input_ids``,
    ``labels``, ``attention_mask``, ``segment_ids``); anything else is kept. Refuses ``T`` not divisible
    by ``P`` in one line."""
    width = batch["input_ids"].shape[1]
    check_split(cp.size, length=width, what="the batch's width: data.seq_len or the packed row")
    return {
        k: cp.split(v) if isinstance(v, Tensor) and v.dim() == 2 and v.shape[1] == width else v
        for k, v in batch.items()
    }


def _sum(x: Tensor, cp: ContextParallel) -> Tensor:
    """``x`` summed over the context group (no gradient)."""
    x = x.detach().clone()
    if cp.size > 1:
        dist.all_reduce(x, group=cp.group)
    return x


def sequence_loss(
    logits: Tensor,
    labels: Tensor,
    cp: ContextParallel,
    *,
    label_smoothing: float = 0.0,
    world_mean: bool = True,
) -> tuple[Tensor, Tensor]:
    """Cross-entropy over the whole split sequence: ``logits`` (B, T/P, V), ``labels`` (B, T/P) of this rank.

    Returns ``(loss, whole)``: ``loss`` to backpropagate, this rank's scored tokens' sum over the
    sequence's scored tokens (summed over the group), times ``P`` when ``world_mean`` (a data-parallel
    wrapper averages the gradients over every process, ``P`` of which share each sequence: the average
    is then over the data rows, each row's gradient that of its unsplit loss); ``whole``, the detached
    mean loss of the whole sequences, the same on every rank of the group (what an unsplit step logs).
    """
    local = F.cross_entropy(
        logits.float().flatten(0, 1),
        labels.flatten(),
        ignore_index=-100,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    count = _sum((labels != -100).sum().to(local.dtype), cp).clamp(min=1)
    loss = local / count * (cp.size if world_mean else 1)
    return loss, _sum(local, cp) / count


@torch.no_grad()
def split_stats(logits: Tensor, labels: Tensor, cp: ContextParallel) -> dict[str, Tensor]:
    """:func:`~posformer.metrics.sequence_stats` of the whole rows from this rank's slice: ``logits``
    (B, T/P, V), ``labels`` (B, T/P). Token sums are summed over the group; a row is scored or exact by
    all its slices; the result is counted on context rank 0 only (zeros elsewhere), so summing over every
    process counts each row once."""
    scored = labels != -100  # (B, T/P)
    loss_sum = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    correct = (logits.argmax(-1) == labels) & scored
    per_row = torch.stack([scored.sum(1), (scored & ~correct).sum(1)]).double()  # (2, B): scored, wrong
    per_row = _sum(per_row, cp)
    tokens = _sum(torch.stack([loss_sum.double(), scored.sum().double(), correct.sum().double()]), cp)
    has = per_row[0] > 0
    out = dict(
        zip(
            SUMS,
            (*tokens.unbind(), has.sum().double(), (has & (per_row[1] == 0)).sum().double()),
            strict=True,
        )
    )
    return {k: v if cp.rank == 0 else torch.zeros_like(v) for k, v in out.items()}


@torch.no_grad()
def split_accuracy(logits: Tensor, labels: Tensor, cp: ContextParallel) -> Tensor:
    """Token accuracy (0-d) of the whole rows from this rank's ``logits`` (B, T/P, V) and ``labels``
    (B, T/P): correct and scored tokens summed over the group, the same on every rank of it."""
    scored = labels != -100
    counts = _sum(torch.stack([((logits.argmax(-1) == labels) & scored).sum(), scored.sum()]), cp)
    return counts[0] / counts[1].clamp(min=1)


def shared_positions(
    batch: int,
    length: int,
    n_max: int,
    cp: ContextParallel,
    device: torch.device,
    draw: Callable[..., Tensor] = randomized_positions,
) -> Tensor:
    """This rank's slice (B, T/P) of randomized positions (``draw``'s: randomized integers, or a sampler's)
    for whole rows of ``length`` tokens: every rank draws (so their generators stay in step), context rank
    0's draw is broadcast to the group."""
    positions = draw(batch, length, n_max, device=device)  # (B, T)
    if cp.size > 1:
        dist.broadcast(positions, src=dist.get_global_rank(cp.group, 0), group=cp.group)
    return cp.split(positions)
