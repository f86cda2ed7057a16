"""Tokenised sentence pairs and their batching (the encoder-decoder side of posformer.data).

- :class:`ParallelCorpus`: one split (its sides tokenised by :mod:`posformer.data.pairs`: a flat
  stream and offsets each); row ``i`` -> ``{"src": x, "tgt": y, "idx": i}`` where
  ``src_lens``/``tgt_lens`` count the EOS (source) / BOS-or-EOS (target) the collate adds.
- :func:`collate_translation`: rows -> ``src = x EOS``, ``tgt_ids = BOS y``, ``labels = y EOS``
  (docs/design.md): ``src_ids``/``src_mask`` (B, S), ``tgt_ids``/``tgt_mask``/``labels`` (B, T),
  ``idx`` (B,).
- :func:`token_batches` / :class:`TokenBatchSampler`: token-based batching like fairseq's
  ``--max-tokens``: pairs sorted by length are cut into batches whose padded size is at most
  ``max_tokens`` tokens on each side; the batches are fixed once (per seed) and their order is a pure
  function of ``(seed, epoch)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from posformer.data.tokenizers import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID


class ParallelCorpus(Dataset):
    """One split, tokenised: row ``i`` -> ``{"src": x EOS, "tgt": y, "idx": i}`` (int64 arrays)."""

    def __init__(
        self,
        src: tuple[np.ndarray, np.ndarray],
        tgt: tuple[np.ndarray, np.ndarray],
        index: np.ndarray | None = None,
    ):
        self.src_flat, self.src_off = src
        self.tgt_flat, self.tgt_off = tgt
        n = len(self.src_off) - 1
        self.index = np.arange(n) if index is None else index
        self.src_lens = (np.diff(self.src_off)[self.index] + 1).astype(np.int32)  # + EOS
        self.tgt_lens = (np.diff(self.tgt_off)[self.index] + 1).astype(np.int32)  # + BOS / EOS

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.index[i])
        return {
            "src": self.src_flat[self.src_off[j] : self.src_off[j + 1]],
            "tgt": self.tgt_flat[self.tgt_off[j] : self.tgt_off[j + 1]],
            "idx": j,
        }


def corpus_arrays(corpus: ParallelCorpus, tgt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    return (corpus.tgt_flat, corpus.tgt_off) if tgt else (corpus.src_flat, corpus.src_off)


def subset(corpus: ParallelCorpus, index: np.ndarray) -> ParallelCorpus:
    """The rows ``index`` of the underlying arrays (line numbers, not positions in ``corpus``)."""
    return ParallelCorpus(corpus_arrays(corpus), corpus_arrays(corpus, tgt=True), index)


def collate_translation(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Rows -> encoder-decoder batch: src_ids/src_mask (B, S), tgt_ids/tgt_mask/labels (B, T), idx (B,)."""
    B = len(rows)
    S = max(len(r["src"]) for r in rows) + 1
    T = max(len(r["tgt"]) for r in rows) + 1
    src = torch.full((B, S), PAD_ID, dtype=torch.long)
    tgt = torch.full((B, T), PAD_ID, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for b, r in enumerate(rows):
        x, y = torch.as_tensor(r["src"], dtype=torch.long), torch.as_tensor(r["tgt"], dtype=torch.long)
        src[b, : len(x)] = x
        src[b, len(x)] = EOS_ID
        tgt[b, 0] = BOS_ID
        tgt[b, 1 : len(y) + 1] = y
        labels[b, : len(y)] = y
        labels[b, len(y)] = EOS_ID
    return {
        "src_ids": src,
        "src_mask": src != PAD_ID,
        "tgt_ids": tgt,
        "tgt_mask": labels != IGNORE_INDEX,
        "labels": labels,
        "idx": torch.tensor([r["idx"] for r in rows], dtype=torch.long),
    }


# ----------------------------------------------------------------------------------------- batching
def token_batches(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    max_sentences: int | None = None,
) -> list[np.ndarray]:
    """Cut pairs sorted by (target, source) length into batches of at most ``max_tokens`` padded
    tokens per side (a longer single pair gets a batch of its own). Ties are broken randomly from
    ``seed`` when ``shuffle`` so batches differ between seeds. Each batch is a view ``(b,)`` of one
    index array (8 bytes a pair, read in blocks: no Python object per pair)."""
    n = len(src_lens)
    order = (
        np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xBA7C]).permutation(n) if shuffle else np.arange(n)
    )
    order = order[np.lexsort((src_lens[order], tgt_lens[order]), axis=0)]
    cuts: list[int] = []  # where a batch starts in ``order`` (after the first)
    size = ms = mt = 0
    for start in range(0, n, 1 << 16):
        block = order[start : start + (1 << 16)]
        for j, (s, t) in enumerate(zip(src_lens[block].tolist(), tgt_lens[block].tolist(), strict=True)):
            ns, nt, k = max(ms, s), max(mt, t), size + 1
            if size and (k * ns > max_tokens or k * nt > max_tokens or (max_sentences and k > max_sentences)):
                cuts.append(start + j)
                size, ns, nt = 0, s, t
            size += 1
            ms, mt = ns, nt
    return np.split(order, cuts) if n else []


class TokenBatchSampler(Sampler[list[int]]):
    """Fixed length-grouped batches; their order is a pure function of ``(seed, epoch)``.

    Lightning calls ``set_epoch`` at every epoch start. ``skip`` (batches) applies to the next
    iteration only (exact resume without Lightning, see ``BaseDataModule.set_position``).
    """

    def __init__(
        self, batches: list[list[int]], seed: int, shuffle: bool = True, epoch: int = 0, skip: int = 0
    ):
        self.batches, self.seed, self.shuffle = batches, int(seed), shuffle
        self.epoch, self.skip = int(epoch), int(skip)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> list[int]:
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(len(self.batches)))
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, int(epoch), 0x5EED])
        return rng.permutation(len(self.batches)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for b in self.order()[skip:]:
            yield np.asarray(self.batches[b]).tolist()

    def __len__(self) -> int:
        return len(self.batches)
