"""Parallel corpora for machine translation (``data.name=translation``).

Sources:

* ``source: local`` — files ``{path}/{split}.{lang}`` (plain text or ``.gz``, one sentence per line),
  e.g. Multi30k: ``train.de.gz``/``train.en.gz``, ``val.*``, ``test_2016_flickr.*``;
* ``source: hub`` — a Hugging Face dataset with a ``translation`` column (``{lang: text}``), e.g.
  ``hub_name: wmt14``, ``hub_config: de-en`` (needs the hub or a filled HF cache; offline it raises a
  :class:`~posformer.errors.DataError` saying so).

Tokenisation: one joint byte-level BPE (HF ``tokenizers``; GPT-2 style ``ByteLevel`` pre-tokeniser and
decoder) trained on both sides of the training split, so source and target share one vocabulary (the
paper's shared source-target BPE). Byte-level BPE has no unknown tokens and detokenises exactly (up
to the leading space), so BLEU is computed by sacreBLEU on the raw, detokenised text. The tokenizer
and the encoded splits are cached under ``{cache_dir}/translation/<key>/``, where the key hashes
everything that changes them (file contents or hub name/config/revision/fingerprint, languages,
split names, vocab size, min frequency, format version).

Sequences (docs/design.md): ``src = x EOS``, ``tgt_ids = BOS y``, ``labels = y EOS``; PAD=0 BOS=1
EOS=2 (SEP=3 is reserved). Training pairs longer than ``max_len`` tokens (either side, EOS included)
are dropped; validation/test pairs are kept whole.

Batching: token-based, like fairseq's ``--max-tokens``: sentence pairs sorted by length are cut into
batches whose padded size is at most ``max_tokens`` tokens on each side (source and target); the
batches are fixed once (per ``seed``) and their order is reshuffled every epoch from ``(seed, epoch)``.
The paper's ~25000 source + 25000 target tokens per step = ``max_tokens`` × devices × gradient
accumulation.

Empty input is an error naming the files (line counts, sizes) and the minimum: a split needs at
least one sentence pair with text on both sides, and training at least one pair within ``max_len``.
A run keeps its tokenizer: ``save_tokenizer(run_dir)`` writes ``<run_dir>/tokenizer/tokenizer.json``
(loads as a ``bpe`` tokenizer, ``posformer.data.load_tokenizer_dir``).

Where things live: file reading :mod:`posformer.data.files`, hub splits :mod:`posformer.data.hub`,
the joint BPE :mod:`posformer.data.tokenizers`, corpora/collate/batching :mod:`posformer.data.parallel`;
their names stay importable from here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from posformer.data.base import BaseDataModule
from posformer.data.cache import read_cache_file, write_cache_file
from posformer.data.files import default_cache_dir, file_digest, find_file
from posformer.data.options import SPLITS, TranslationOptions, read_options
from posformer.data.pairs import (
    Pairs,
    check_pairs,
    encode_split,
    file_pairs,
    hub_pairs,
    load_hub_pairs,
    open_split,
    read_parallel,
)
from posformer.data.parallel import (
    ParallelCorpus,
    TokenBatchSampler,
    collate_translation,
    corpus_arrays,
    subset,
    token_batches,
)
from posformer.data.store import remove_tree
from posformer.data.tokenizers import EOS_ID, SPECIAL_TOKENS, BPETokenizer, train_joint_bpe
from posformer.errors import DataError

train_tokenizer = train_joint_bpe  # the former name

FORMAT_VERSION = 1


# ------------------------------------------------------------------------------------------- module
class TranslationDataModule(BaseDataModule):
    """Parallel corpus with a joint BPE; batches follow the encoder-decoder contract (docs/design.md)."""

    task_type = "translation"
    name = "translation"
    Options = TranslationOptions

    def __init__(self, cfg: TranslationOptions | Mapping[str, Any], model_kind: str, seed: int) -> None:
        super().__init__()
        o = self.options = read_options(TranslationOptions, cfg, model_kind)
        self.model_kind = model_kind
        self.vocab_target = o.vocab_size
        self.max_len = o.max_len
        self.max_tokens = o.max_tokens
        self.eval_max_tokens = o.eval_max_tokens or self.max_tokens
        self.max_sentences = o.max_sentences
        self.num_workers = o.num_workers
        self.shuffle_seed = int(seed)
        self.data_seed = int(o.seed if o.seed is not None else seed)
        self.src_lang, self.tgt_lang = o.src_lang, o.tgt_lang
        self.eval_lengths = sorted(set(o.eval_lengths or []))  # posformer-train's post-training buckets
        self._hub_splits: dict[str, tuple[Any, str]] = {}
        self._prepare()

    # ---- reading
    def _files(self, split: str) -> tuple[Path, Path]:
        o, name = self.options, self.options.splits[split]
        return find_file(o.path, name, self.src_lang), find_file(o.path, name, self.tgt_lang)

    def _hub(self, split: str) -> Any:
        """The hub split's dataset (memory-mapped) and its fingerprint, loaded once."""
        if split not in self._hub_splits:
            o = self.options
            name, config, revision = o.hub_name, o.hub_config, o.hub_revision
            self._hub_splits[split] = load_hub_pairs(name, config, o.splits[split], revision)
        return self._hub_splits[split]

    def _pairs(self, split: str) -> Callable[[], Pairs]:
        """The split's sentence pairs in batches (training: the first ``n_train``), checked once now: the
        sides align and at least one pair has text on both."""
        limit = self.options.n_train if split == "train" else None
        if self.options.source == "local":
            src, tgt = self._files(split)
            check_pairs(src, tgt)
            return lambda: file_pairs(src, tgt, limit)
        ds, _ = self._hub(split)
        where = self._where(split)
        read = lambda: hub_pairs(ds, self.src_lang, self.tgt_lang, where, limit)  # noqa: E731
        n = usable = 0
        for src, tgt in read():
            n += len(src)
            usable += sum(bool(a.strip() and b.strip()) for a, b in zip(src, tgt, strict=True))
        if not usable:
            raise DataError(
                f"{where} holds {n} sentence pairs, none with text on both sides; a split needs at least 1: "
                f"map data.splits.{split} to another split."
            )
        return read

    def _raw(self, split: str) -> tuple[list[str], list[str]]:
        """The split's sentences as lists (for :meth:`texts`: references of val/test)."""
        if self.options.source == "local":
            src, tgt = read_parallel(*self._files(split))
            n = self.options.n_train if split == "train" else None
            return src[:n], tgt[:n]
        batches = list(self._pairs(split)())
        return [s for b, _ in batches for s in b], [t for _, b in batches for t in b]

    def _where(self, split: str) -> str:
        """The files or hub split behind our ``split``, for messages."""
        o, name = self.options, self.options.splits[split]
        if o.source == "local":
            return f"{split} split ({Path(str(o.path)) / name}.{{{self.src_lang},{self.tgt_lang}}}[.gz])"
        return f"{split} split (hub {o.hub_name}/{o.hub_config} split {name!r})"

    def _usable_training_pairs(self, corpus: ParallelCorpus) -> np.ndarray:
        """Indices of training pairs with text on both sides and no side over ``max_len`` tokens."""
        nonempty = (corpus.src_lens > 1) & (corpus.tgt_lens > 1)
        short = (corpus.src_lens <= self.max_len) & (corpus.tgt_lens <= self.max_len)
        keep = np.nonzero(nonempty & short)[0]
        if not len(keep):
            sides = np.maximum(corpus.src_lens, corpus.tgt_lens)[nonempty]
            needed = int(sides.min()) if len(sides) else 0  # the max_len that keeps the shortest pair
            raise DataError(
                f"{self._where('train')}: no training pair is at most data.max_len={self.max_len} tokens "
                f"long with text on both sides ({len(corpus)} pairs: {int((~nonempty).sum())} with an empty "
                f"side, {int((nonempty & ~short).sum())} longer); at least 1 is needed: "
                + (f"raise data.max_len to >= {needed}." if needed else "add sentence pairs to the files.")
            )
        return keep

    def _cache_key(self) -> str:
        o = self.options
        ident: dict[str, Any] = {
            k: getattr(o, k)
            for k in ("source", "src_lang", "tgt_lang", "splits", "vocab_size", "min_frequency", "n_train")
        }
        ident["format"] = FORMAT_VERSION
        import tokenizers

        ident["tokenizers"] = tokenizers.__version__
        if o.source == "local":
            ident["files"] = {
                f"{s}.{lang}": file_digest(find_file(o.path, o.splits[s], lang))
                for s in SPLITS
                for lang in (self.src_lang, self.tgt_lang)
            }
        else:
            ident["hub"] = [o.hub_name, o.hub_config, o.hub_revision]
            ident["fingerprints"] = {s: self._hub(s)[1] for s in SPLITS}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def _prepare(self) -> None:
        from tokenizers import Tokenizer

        o = self.options
        cache_root = Path(o.cache_dir).expanduser() if o.cache_dir else default_cache_dir()
        cache = cache_root / "translation" / self._cache_key()
        self.cache_path = cache
        sources: dict[str, Callable[[], Pairs]] = {}
        loaded = read_cache_file(cache / "tokenizer.json", lambda f: Tokenizer.from_file(str(f)))
        if loaded is not None:
            self.tokenizer = loaded
        else:  # every split checked before the first write
            sources = {split: self._pairs(split) for split in SPLITS}
            texts = _both_sides(sources["train"])
            self.tokenizer = train_joint_bpe(texts, self.vocab_target, int(o.min_frequency))
            for split in SPLITS:  # encoded by a tokenizer now gone
                remove_tree(cache / split)
            write_cache_file(cache_root, cache / "tokenizer.json", self.tokenizer.to_str(pretty=True))
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.corpora: dict[str, ParallelCorpus] = {}
        for split in SPLITS:
            arrays = read_cache_file(cache / split, open_split)
            if arrays is None:
                sources[split] = sources.get(split) or self._pairs(split)
                encode_split(cache / split, self.tokenizer, sources[split], int(o.num_proc))
                arrays = open_split(cache / split)
            corpus = ParallelCorpus(arrays["src"], arrays["tgt"])
            if split == "train":
                keep = self._usable_training_pairs(corpus)
                self.n_dropped = len(corpus) - len(keep)
                corpus = subset(corpus, keep)
            self.corpora[split] = corpus
        train = self.corpora["train"]
        self.train_length = int(max(train.src_lens.max(), train.tgt_lens.max()))
        self.batch_size = max(1, self.max_tokens // max(1, int(np.median(train.tgt_lens))))  # nominal
        self._train_batches = token_batches(
            train.src_lens,
            train.tgt_lens,
            self.max_tokens,
            seed=self.data_seed,
            max_sentences=self.max_sentences,
        )

    # ---- API
    def train_dataset(self) -> ParallelCorpus:
        return self.corpora["train"]

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_translation(rows)

    def num_train_batches(self) -> int:
        return len(self._train_batches)

    def train_dataloader(self) -> DataLoader:
        sampler = TokenBatchSampler(
            self._train_batches,
            self.shuffle_seed,
            shuffle=True,
            epoch=self._resume_epoch,
            skip=self._resume_batch,
        )
        self._resume_batch = 0
        return self._batch_loader(self.corpora["train"], sampler)

    def _batch_loader(self, corpus: ParallelCorpus, sampler: Sampler[list[int]]) -> DataLoader:
        return DataLoader(
            corpus,
            batch_sampler=sampler,
            collate_fn=collate_translation,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pins_memory(),
        )

    def split_dataloader(
        self, split: str, max_tokens: int | None = None, limit: int | None = None
    ) -> DataLoader:
        """Length-sorted (not shuffled) batches of ``split`` (train/val/test); ``batch["idx"]`` gives
        each row's line number, to restore the corpus order. ``limit``: only the first ``limit`` rows."""
        corpus = self.corpora[split]
        if limit is not None and limit < len(corpus):
            corpus = subset(corpus, corpus.index[:limit])
        batches = token_batches(
            corpus.src_lens,
            corpus.tgt_lens,
            max_tokens or self.eval_max_tokens,
            shuffle=False,
            max_sentences=self.max_sentences,
        )
        return self._batch_loader(corpus, TokenBatchSampler(batches, 0, shuffle=False))

    def val_dataloader(self) -> DataLoader:
        return self.split_dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self.split_dataloader("test")

    def eval_dataloaders(self, lengths: list[int] | None = None) -> dict[int, DataLoader]:
        """Test pairs bucketed by source length: key ``L`` holds pairs with ``prev < |src| <= L``
        (default buckets: ``data.eval_lengths``, else the whole test set under its longest source)."""
        corpus = self.corpora["test"]
        bounds = sorted(set(lengths or self.options.eval_lengths or [int(corpus.src_lens.max())]))
        out, lo = {}, 0
        for hi in bounds:
            keep = np.nonzero((corpus.src_lens > lo) & (corpus.src_lens <= hi))[0]
            lo = hi
            if not len(keep):
                continue
            sub = subset(corpus, corpus.index[keep])
            batches = token_batches(sub.src_lens, sub.tgt_lens, self.eval_max_tokens, shuffle=False)
            out[int(hi)] = self._batch_loader(sub, TokenBatchSampler(batches, 0, shuffle=False))
        return out

    def texts(self, split: str) -> tuple[list[str], list[str]]:
        """Raw (source, reference) sentences of a split, in corpus order."""
        return self._raw(split)

    def encode(self, text: str) -> list[int]:
        """Text -> BPE ids (no specials)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Any) -> str:
        """Ids -> detokenised text; stops at EOS, drops PAD/BOS/-100."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i >= len(SPECIAL_TOKENS):
                out.append(int(i))
        return self.tokenizer.decode(out).strip()

    def run_tokenizer(self) -> BPETokenizer:
        return BPETokenizer(self.tokenizer)

    def tokenizer_info(self) -> dict[str, Any]:
        o = self.options
        source = o.path if o.source == "local" else f"hub:{o.hub_name}/{o.hub_config}"
        return {"data": "translation", "source": str(source), "joint": [self.src_lang, self.tgt_lang]}

    def config_summary(self) -> dict[str, Any]:
        o = self.options
        return {
            "name": "translation",
            "source": o.source,
            "path": o.path,
            "hub_name": o.hub_name,
            "hub_config": o.hub_config,
            "src_lang": self.src_lang,
            "tgt_lang": self.tgt_lang,
            "splits": dict(o.splits),
            "vocab_size": self.vocab_size,
            "max_len": self.max_len,
            "max_tokens": self.max_tokens,
            "n_train": len(self.corpora["train"]),
            "n_dropped": self.n_dropped,
            "n_val": len(self.corpora["val"]),
            "n_test": len(self.corpora["test"]),
            "train_batches": len(self._train_batches),
            "train_length": self.train_length,
            "tokenizer_cache": str(self.cache_path),
        }


def _both_sides(pairs: Callable[[], Pairs]) -> Iterator[str]:
    """Every source sentence, then every target sentence (the joint BPE's training text)."""
    for side in (0, 1):
        for batch in pairs():
            yield from batch[side]


__all__ = [
    "ParallelCorpus",
    "TokenBatchSampler",
    "TranslationDataModule",
    "collate_translation",
    "corpus_arrays",
    "find_file",
    "read_parallel",
    "token_batches",
    "train_tokenizer",
]
