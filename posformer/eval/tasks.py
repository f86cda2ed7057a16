"""Synthetic-task scoring: teacher-forced loss, token accuracy and exact match of one batch.

The batch layout is the data contract of ``docs/design.md``: decoder batches ``input_ids`` (B, T),
``labels`` (B, T) (``-100`` = not scored), ``attention_mask`` (B, T); encoder-decoder batches
``src_ids`` (B, S), ``src_mask``, ``tgt_ids`` (B, T), ``tgt_mask``, ``labels`` (B, T).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from posformer.devices import module_device

#: the summed statistics :func:`score_task_batch` returns (callers add them up over batches)
TASK_TOTALS = ("nll_sum", "scored_tokens", "correct_tokens", "exact", "n_sequences")


def score_task_batch(
    model: nn.Module, batch: dict[str, Tensor], positions: Tensor | None = None
) -> dict[str, float]:
    """Teacher-forced loss/accuracy sums of one batch (keys :data:`TASK_TOTALS`).

    ``positions`` (B, T): the decoder's positions (e.g. randomized ones); ``None``: ``0 … T-1``.

    A sequence is exactly right when every scored label is the argmax prediction; sequences without
    a scored label do not count.
    """
    device = module_device(model)
    batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
    if "src_ids" in batch:
        logits = model(batch["src_ids"], batch["tgt_ids"], batch.get("src_mask"), batch.get("tgt_mask"))
    else:
        pos = None if positions is None else positions.to(device)
        attn = batch.get("attention_mask")
        logits = model(batch["input_ids"], positions=pos, attention_mask=attn)  # (B, T, V)
    labels = batch["labels"]  # (B, T)
    mask = labels != -100
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    correct = (logits.argmax(-1) == labels) & mask  # (B, T)
    has = mask.any(1)  # (B,)
    exact = ((correct | ~mask).all(1) & has).sum()
    return {
        "nll_sum": float(loss),
        "scored_tokens": int(mask.sum()),
        "correct_tokens": int(correct.sum()),
        "exact": int(exact),
        "n_sequences": int(has.sum()),
    }
