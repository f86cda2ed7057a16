"""Packed sequences (``data.pack=true``): several documents per training row, with segment ids.

A packed row holds consecutive documents; ``segment_ids`` (B, T) numbers them within the row (0, 1,
…), and the decoder-only model attends block-diagonally (causal within a document) with positions
restarting at every document, so each document is trained as if it were alone. No label crosses a
document: the last token of a document is not trained to predict the first token of the next
(-100 there). Validation and evaluation stay unpacked.

* Language modelling (``data=text``, ``data=corpus``, ``data=hub``): the training text is split into
  documents at ``data.doc_separator`` (default a blank line, ``"\\n\\n"``; empty documents are dropped;
  a dataset's rows are its documents), each is tokenised on its own, and the token store keeps them
  one after the other with where each ends (:class:`~posformer.data.sources.TextSource`,
  :mod:`posformer.data.store`); :class:`PackedWindows` cuts that stream into windows of
  ``block_size + 1`` tokens like the unpacked stream, each token's document read from the ends. A
  document longer than the rest of a row continues in the next row, where it starts again at
  position 0.
* Synthetic tasks: whole examples (``[BOS] prompt SEP answer EOS``) are packed greedily, in order,
  into rows of ``data.pack_length`` tokens (default: the longest training example; :func:`pack_rows`,
  :class:`PackedExamples`); the rest of a row is padding, a segment of its own with no labels.

Rows come out of the datasets as dicts of 1-D tensors of one length (``input_ids``, ``labels``,
``attention_mask`` all True, ``segment_ids``); the training loader stacks them with torch's
``default_collate`` (:meth:`BaseDataModule.train_dataloader` when ``pack`` is set).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from posformer.data.tokenizers import IGNORE_INDEX, PAD_ID
from posformer.errors import ConfigError

Row = dict[str, torch.Tensor]


def segment_labels(tokens: np.ndarray, docs: np.ndarray) -> Row:
    """A window of ``T + 1`` ``tokens`` and their document ids ``docs`` -> one packed row of ``T``.

    ``labels[t] = tokens[t + 1]`` when token ``t + 1`` is in the same document, else -100;
    ``segment_ids`` count from 0 within the row.
    """
    x, d = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(docs.astype(np.int64))
    labels = torch.where(d[1:] == d[:-1], x[1:], torch.full_like(x[1:], IGNORE_INDEX))
    return {
        "input_ids": x[:-1].clone(),
        "labels": labels,
        "attention_mask": torch.ones(len(x) - 1, dtype=torch.bool),
        "segment_ids": d[:-1] - d[0],
    }


# ----------------------------------------------------------------------------- language modelling
class PackedWindows(Dataset):
    """Windows of ``length + 1`` tokens of a packed stream (``tokens``: ``(N,)``, sliceable), starting
    every ``length`` tokens, as rows; ``ends`` ``(D,)``: where each document ends."""

    def __init__(self, tokens: Any, ends: np.ndarray, length: int) -> None:
        self.tokens, self.ends, self.length = tokens, np.asarray(ends, dtype=np.int64), int(length)
        self.count = max(0, (len(tokens) - 1) // self.length)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Row:
        if not 0 <= i < self.count:
            raise IndexError(i)
        s = i * self.length
        positions = np.arange(s, s + self.length + 1, dtype=np.int64)
        docs = np.searchsorted(self.ends, positions, side="right")  # each token's document
        return segment_labels(np.asarray(self.tokens[s : s + self.length + 1]), docs)


# ----------------------------------------------------------------------------------- synthetic tasks
def pack_rows(sizes: Sequence[int], length: int) -> list[list[int]]:
    """Greedy packing in order: indices of ``sizes`` grouped into rows of at most ``length`` tokens."""
    rows: list[list[int]] = []
    used = length + 1  # forces a first row
    for i, size in enumerate(sizes):
        if size > length:
            raise ConfigError(
                f"data.pack_length={length} is shorter than training example {i} ({size} tokens); raise "
                f"data.pack_length to at least {max(sizes)} or leave it null (the longest example)."
            )
        if used + size > length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += size
    return rows


class PackedExamples(Dataset):
    """Rows of whole examples of ``dataset``, each turned into (input_ids, labels) by ``encode``.

    ``encode(example) -> (input_ids (n,), labels (n,))``; a row is padded to ``length`` tokens with
    ``PAD`` in a segment of its own (no labels).
    """

    def __init__(
        self,
        dataset: Any,
        sizes: Sequence[int],
        length: int,
        encode: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.dataset, self.length, self.encode = dataset, int(length), encode
        self.rows = pack_rows(sizes, self.length)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:
        ids, labels, segs = [], [], []
        for seg, j in enumerate(self.rows[i]):
            x, y = self.encode(self.dataset[j])
            ids.append(x)
            labels.append(y)
            segs.append(torch.full_like(x, seg))
        pad = self.length - sum(len(x) for x in ids)
        if pad:
            ids.append(torch.full((pad,), PAD_ID, dtype=torch.long))
            labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
            segs.append(torch.full((pad,), len(self.rows[i]), dtype=torch.long))
        return {
            "input_ids": torch.cat(ids),
            "labels": torch.cat(labels),
            "attention_mask": torch.ones(self.length, dtype=torch.bool),
            "segment_ids": torch.cat(segs),
        }
