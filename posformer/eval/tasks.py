"""Synthetic-task scoring: teacher-forced loss, token accuracy and exact match of one batch.

The batch layout is the data contract of ``docs/design.md``: decoder batches ``input_ids`` (B, T),
``labels`` (B, T) (``-100`` = not scored), ``attention_mask`` (B, T); encoder-decoder batches
``src_ids`` (B, S), ``src_mask``, ``tgt_ids`` (B, T), ``tgt_mask``, ``labels`` (B, T).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posformer.devices import module_device
from posformer.metrics import SUMS, sequence_stats


def task_batch_sums(
    model: nn.Module, batch: dict[str, Tensor], positions: Tensor | None = None
) -> dict[str, Tensor]:
    """Teacher-forced loss/accuracy sums of one batch (keys :data:`posformer.metrics.SUMS`) as 0-d
    float64 tensors on the model's device: nothing is read on the host, so a caller adds them up over
    batches and reads once (on a GPU, a read per batch would wait for it each time).

    ``positions`` (B, T): the decoder's positions (e.g. randomized ones); ``None``: ``0 … T-1``.

    Scored by :func:`posformer.metrics.sequence_stats`, as training's evaluation is: a sequence is
    exactly right when every scored label is the argmax prediction; sequences without a scored label
    do not count.
    """
    device = module_device(model)
    batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
    if "src_ids" in batch:
        logits = model(batch["src_ids"], batch["tgt_ids"], batch.get("src_mask"), batch.get("tgt_mask"))
    else:
        pos = None if positions is None else positions.to(device)
        attn = batch.get("attention_mask")
        logits = model(batch["input_ids"], positions=pos, attention_mask=attn)  # (B, T, V)
    return sequence_stats(logits, batch["labels"])  # training's scorer: one definition per metric


def read_totals(sums: dict[str, Tensor]) -> dict[str, float | int]:
    """:func:`task_batch_sums` (or their sums over batches) read on the host, in one read: ``loss_sum`` a
    float, the counts ints."""
    values = torch.stack([sums[k] for k in SUMS]).tolist()
    return {k: (v if k == "loss_sum" else int(v)) for k, v in zip(SUMS, values)}


def score_task_batch(
    model: nn.Module, batch: dict[str, Tensor], positions: Tensor | None = None
) -> dict[str, float | int]:
    """:func:`task_batch_sums` of one batch, read on the host (``loss_sum`` a float, the counts ints)."""
    return read_totals(task_batch_sums(model, batch, positions))
