"""Synthetic-task scoring: teacher-forced loss, token accuracy and exact match of one batch.

The batch layout is the data contract of ``docs/design.md``: decoder batches ``input_ids`` (B, T),
``labels`` (B, T) (``-100`` = not scored), ``attention_mask`` (B, T); encoder-decoder batches
``src_ids`` (B, S), ``src_mask``, ``tgt_ids`` (B, T), ``tgt_mask``, ``labels`` (B, T).
"""

from __future__ import annotations

from torch import Tensor, nn

from posformer.devices import module_device
from posformer.lit.modules import sequence_stats

#: the summed statistics :func:`score_task_batch` returns (callers add them up over batches)
TASK_TOTALS = ("nll_sum", "scored_tokens", "correct_tokens", "exact", "n_sequences")


def score_task_batch(
    model: nn.Module, batch: dict[str, Tensor], positions: Tensor | None = None
) -> dict[str, float]:
    """Teacher-forced loss/accuracy sums of one batch (keys :data:`TASK_TOTALS`).

    ``positions`` (B, T): the decoder's positions (e.g. randomized ones); ``None``: ``0 … T-1``.

    Scored by :func:`posformer.lit.modules.sequence_stats`, as training's evaluation is: a sequence is
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
    stats = sequence_stats(logits, batch["labels"])  # training's scorer: one definition per metric
    return {
        "nll_sum": float(stats["loss_sum"]),
        "scored_tokens": int(stats["n_tokens"]),
        "correct_tokens": int(stats["n_correct_tokens"]),
        "exact": int(stats["n_exact"]),
        "n_sequences": int(stats["n_sequences"]),
    }
