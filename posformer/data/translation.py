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
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from posformer.data.base import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    PAD_ID,
    SPECIAL_TOKENS,
    BaseDataModule,
    check_int,
    check_model_kind,
    take_options,
)
from posformer.errors import ConfigError, DataError

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")

DEFAULTS: dict[str, Any] = {
    "source": "local",  # local | hub
    "path": None,  # local: directory holding {split}.{lang}[.gz]
    "src_lang": "de",
    "tgt_lang": "en",
    "splits": {"train": "train", "val": "val", "test": "test_2016_flickr"},  # our split -> file/hub split
    "hub_name": None,  # hub: e.g. wmt14
    "hub_config": None,  # hub: e.g. de-en
    "hub_revision": None,
    "vocab_size": 8000,  # joint BPE vocabulary (specials included)
    "min_frequency": 2,
    "max_len": 256,  # drop training pairs with a side longer than this (tokens incl. EOS)
    "n_train": None,  # use only the first n training pairs (quick runs)
    "max_tokens": 4096,  # padded tokens per batch, per side
    "eval_max_tokens": None,  # default: max_tokens
    "max_sentences": None,  # optional cap on pairs per batch
    "eval_lengths": None,  # eval_dataloaders: test set bucketed by source length (upper bounds)
    "num_workers": 0,
    "seed": 0,
    "cache_dir": None,
}


# ------------------------------------------------------------------------------------------ reading
def read_lines(path: str | os.PathLike) -> list[str]:
    """Lines of a plain or gzip text file (trailing newline stripped)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"translation data file {str(p)!r} does not exist; check data.path and the split/language "
            "names (files are {path}/{split}.{lang} or {path}/{split}.{lang}.gz)."
        )
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            return [line.rstrip("\n").rstrip("\r") for line in f]
    except UnicodeDecodeError:  # report the byte offset (the text stream's error position is per chunk)
        with opener(p, "rb") as f:
            raw = f.read()
        try:
            raw.decode("utf-8")
            offset = "?"
        except UnicodeDecodeError as exc:
            offset = str(exc.start)
        where = " of the decompressed text" if p.suffix == ".gz" else ""
        raise DataError(
            f"translation data file {str(p)!r} is not valid UTF-8: first bad byte at offset {offset}{where}; "
            "convert it, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`."
        ) from None


def find_file(directory: str | os.PathLike, split: str, lang: str) -> Path:
    """``{directory}/{split}.{lang}`` or its ``.gz``; a clear :class:`DataError` when neither exists."""
    base = Path(directory) / f"{split}.{lang}"
    for cand in (base, base.with_name(base.name + ".gz")):
        if cand.is_file():
            return cand
    if not Path(directory).is_dir():
        raise DataError(
            f"data.path={str(directory)!r} is not a directory; point it at the folder holding "
            f"{split}.{lang}[.gz] (e.g. ../shared/data/multi30k)."
        )
    present = sorted(p.name for p in Path(directory).iterdir())[:20]
    raise DataError(
        f"no file {base.name} or {base.name}.gz in {str(directory)!r} (split {split!r}, language "
        f"{lang!r}); it holds: {', '.join(present) or 'nothing'}. Fix data.splits or data.src_lang/"
        "tgt_lang."
    )


def read_parallel(src_path: str | os.PathLike, tgt_path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Aligned source/target sentences; different line counts raise a :class:`DataError` naming both."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"parallel files are not aligned: {str(src_path)!r} has {len(src)} lines but "
            f"{str(tgt_path)!r} has {len(tgt)}; both sides need one sentence per line, in order."
        )
    if not src:
        raise DataError(f"parallel files {str(src_path)!r} and {str(tgt_path)!r} are empty.")
    return src, tgt


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_hub_split(
    name: str, config: str | None, split: str, src_lang: str, tgt_lang: str, revision: str | None = None
) -> tuple[list[str], list[str], str]:
    """(source, target, fingerprint) of a hub translation dataset split (``translation`` column)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, revision=revision)
    except Exception as exc:  # noqa: BLE001 - network, missing dataset, missing split: all one message
        raise DataError(
            f"could not load the Hugging Face dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(exc).__name__}: {str(exc)[:300]}. The hub is needed the first time (it is then cached in "
            "HF_DATASETS_CACHE); offline, use data.source=local with data.path pointing at parallel text "
            "files."
        ) from None
    if "translation" not in ds.column_names:
        raise DataError(f"hub dataset {name!r} has columns {ds.column_names}, not a 'translation' column.")
    pairs = ds["translation"]
    try:
        src = [p[src_lang] for p in pairs]
        tgt = [p[tgt_lang] for p in pairs]
    except KeyError as exc:
        raise DataError(
            f"hub dataset {name!r}/{config!r} has no language {exc}; languages: "
            f"{sorted(pairs[0]) if pairs else []}. Fix data.src_lang/tgt_lang."
        ) from None
    return src, tgt, str(getattr(ds, "_fingerprint", ""))


# --------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Iterator[str] | Sequence[str], vocab_size: int, min_frequency: int = 2):
    """A joint byte-level BPE (HF ``tokenizers``) with the four special tokens at ids 0-3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:  # pragma: no cover - tokenizers puts specials first
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def _encode(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Texts -> (flat int32 ids, int64 offsets (n+1,)); no specials."""
    enc = tok.encode_batch(texts, add_special_tokens=False)
    lens = np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter((i for e in enc for i in e.ids), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


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
        self.src_lens = (np.diff(self.src_off)[self.index] + 1).astype(np.int64)  # + EOS
        self.tgt_lens = (np.diff(self.tgt_off)[self.index] + 1).astype(np.int64)  # + BOS / EOS

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.index[i])
        return {
            "src": self.src_flat[self.src_off[j] : self.src_off[j + 1]],
            "tgt": self.tgt_flat[self.tgt_off[j] : self.tgt_off[j + 1]],
            "idx": j,
        }


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
) -> list[list[int]]:
    """Cut pairs sorted by (target, source) length into batches of at most ``max_tokens`` padded
    tokens per side (a longer single pair gets a batch of its own). Ties are broken randomly from
    ``seed`` when ``shuffle`` so batches differ between seeds."""
    n = len(src_lens)
    order = (
        np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xBA7C]).permutation(n) if shuffle else np.arange(n)
    )
    order = order[np.lexsort((src_lens[order], tgt_lens[order]), axis=0)]
    batches: list[list[int]] = []
    cur: list[int] = []
    ms = mt = 0
    for i in order.tolist():
        s, t = int(src_lens[i]), int(tgt_lens[i])
        ns, nt, k = max(ms, s), max(mt, t), len(cur) + 1
        if cur and (k * ns > max_tokens or k * nt > max_tokens or (max_sentences and k > max_sentences)):
            batches.append(cur)
            cur, ns, nt = [], s, t
        cur.append(i)
        ms, mt = ns, nt
    if cur:
        batches.append(cur)
    return batches


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
            yield list(self.batches[b])

    def __len__(self) -> int:
        return len(self.batches)


# ------------------------------------------------------------------------------------------- module
class TranslationDataModule(BaseDataModule):
    """Parallel corpus with a joint BPE; batches follow the encoder-decoder contract (docs/design.md)."""

    task_type = "translation"

    def __init__(self, cfg: dict[str, Any], model_kind: str, seed: int) -> None:
        super().__init__()
        o = take_options(cfg, DEFAULTS, "data (translation)")
        self.options = o
        self.model_kind = check_model_kind(model_kind, ("encoder_decoder",), "translation")
        if o["source"] not in ("local", "hub"):
            raise ConfigError(f"data.source={o['source']!r}; valid: local (data.path), hub (data.hub_name).")
        if o["source"] == "local" and not o["path"]:
            raise ConfigError("data.source=local needs data.path: the directory holding {split}.{lang}[.gz].")
        if o["source"] == "hub" and not o["hub_name"]:
            raise ConfigError(
                "data.source=hub needs data.hub_name (e.g. wmt14) and data.hub_config (e.g. de-en)."
            )
        if o["src_lang"] == o["tgt_lang"]:
            raise ConfigError(
                f"data.src_lang and data.tgt_lang are both {o['src_lang']!r}; pick two languages."
            )
        missing = [s for s in SPLITS if s not in (o["splits"] or {})]
        if missing:
            raise ConfigError(
                f"data.splits={o['splits']} lacks {missing}; map each of train/val/test to a split name."
            )
        self.vocab_target = check_int("vocab_size", o["vocab_size"], len(SPECIAL_TOKENS) + 256)
        self.max_len = check_int("max_len", o["max_len"], 2)
        self.max_tokens = check_int("max_tokens", o["max_tokens"], 1)
        if self.max_tokens < self.max_len:
            raise ConfigError(
                f"data.max_tokens={self.max_tokens} is smaller than data.max_len={self.max_len}: the "
                f"longest training pair would not fit a batch; raise max_tokens to >= {self.max_len}."
            )
        self.eval_max_tokens = check_int("eval_max_tokens", o["eval_max_tokens"] or self.max_tokens, 1)
        self.max_sentences = (
            None if o["max_sentences"] is None else check_int("max_sentences", o["max_sentences"])
        )
        self.num_workers = check_int("num_workers", o["num_workers"], 0)
        self.shuffle_seed = int(seed)
        self.data_seed = int(o["seed"] if o["seed"] is not None else seed)
        self.src_lang, self.tgt_lang = o["src_lang"], o["tgt_lang"]
        self.eval_lengths = sorted(set(o["eval_lengths"] or []))  # posformer-train's post-training buckets
        self._texts: dict[str, tuple[list[str], list[str]]] = {}
        self._prepare()

    # ---- building
    def _raw(self, split: str) -> tuple[list[str], list[str]]:
        if split not in self._texts:
            o, name = self.options, self.options["splits"][split]
            if o["source"] == "local":
                src, tgt = read_parallel(
                    find_file(o["path"], name, self.src_lang), find_file(o["path"], name, self.tgt_lang)
                )
            else:
                src, tgt, _ = load_hub_split(
                    o["hub_name"], o["hub_config"], name, self.src_lang, self.tgt_lang, o["hub_revision"]
                )
            if split == "train" and o["n_train"] is not None:
                n = check_int("n_train", o["n_train"])
                src, tgt = src[:n], tgt[:n]
            self._texts[split] = (src, tgt)
        return self._texts[split]

    def _cache_key(self) -> str:
        o = self.options
        ident: dict[str, Any] = {
            k: o[k]
            for k in ("source", "src_lang", "tgt_lang", "splits", "vocab_size", "min_frequency", "n_train")
        }
        ident["format"] = FORMAT_VERSION
        import tokenizers

        ident["tokenizers"] = tokenizers.__version__
        if o["source"] == "local":
            ident["files"] = {
                f"{s}.{lang}": _file_digest(find_file(o["path"], o["splits"][s], lang))
                for s in SPLITS
                for lang in (self.src_lang, self.tgt_lang)
            }
        else:
            ident["hub"] = [o["hub_name"], o["hub_config"], o["hub_revision"]]
            ident["fingerprints"] = {
                s: load_hub_split(
                    o["hub_name"],
                    o["hub_config"],
                    o["splits"][s],
                    self.src_lang,
                    self.tgt_lang,
                    o["hub_revision"],
                )[2]
                for s in SPLITS
            }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def _prepare(self) -> None:
        from tokenizers import Tokenizer

        cache_root = self.options["cache_dir"]
        key = self._cache_key()
        cache = Path(cache_root).expanduser() / "translation" / key if cache_root else None
        tok_file = cache / "tokenizer.json" if cache else None
        if tok_file is not None and tok_file.is_file():
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        else:
            src, tgt = self._raw("train")
            self.tokenizer = train_tokenizer(
                iter(src + tgt), self.vocab_target, int(self.options["min_frequency"])
            )
            if cache is not None:
                cache.mkdir(parents=True, exist_ok=True)
                tmp = cache / f"tokenizer.json.{os.getpid()}"
                self.tokenizer.save(str(tmp))
                os.replace(tmp, tok_file)
        self.cache_path = cache
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.corpora: dict[str, ParallelCorpus] = {}
        for split in SPLITS:
            arrays = self._encoded(split, cache)
            corpus = ParallelCorpus(
                (arrays["src_flat"], arrays["src_off"]), (arrays["tgt_flat"], arrays["tgt_off"])
            )
            if split == "train":
                keep = np.nonzero(
                    (corpus.src_lens <= self.max_len)
                    & (corpus.tgt_lens <= self.max_len)
                    & (corpus.src_lens > 1)
                    & (corpus.tgt_lens > 1)
                )[0]
                if not len(keep):
                    raise DataError(
                        f"no training pair is at most data.max_len={self.max_len} tokens long; raise it."
                    )
                self.n_dropped = len(corpus) - len(keep)
                corpus = ParallelCorpus(corpus_arrays(corpus), corpus_arrays(corpus, tgt=True), keep)
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

    def _encoded(self, split: str, cache: Path | None) -> dict[str, np.ndarray]:
        file = cache / f"{split}.npz" if cache is not None else None
        if file is not None and file.is_file():
            with np.load(file) as z:
                return {k: z[k] for k in z.files}
        src, tgt = self._raw(split)
        (sf, so), (tf, to) = _encode(self.tokenizer, src), _encode(self.tokenizer, tgt)
        arrays = {"src_flat": sf, "src_off": so, "tgt_flat": tf, "tgt_off": to}
        if file is not None:
            tmp = file.with_name(f"{split}.{os.getpid()}.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, file)
        return arrays

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
        )

    def split_dataloader(
        self, split: str, max_tokens: int | None = None, limit: int | None = None
    ) -> DataLoader:
        """Length-sorted (not shuffled) batches of ``split`` (train/val/test); ``batch["idx"]`` gives
        each row's line number, to restore the corpus order. ``limit``: only the first ``limit`` rows."""
        corpus = self.corpora[split]
        if limit is not None and limit < len(corpus):
            corpus = ParallelCorpus(
                corpus_arrays(corpus), corpus_arrays(corpus, tgt=True), corpus.index[:limit]
            )
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
        bounds = sorted(set(lengths or self.options["eval_lengths"] or [int(corpus.src_lens.max())]))
        out, lo = {}, 0
        for hi in bounds:
            keep = np.nonzero((corpus.src_lens > lo) & (corpus.src_lens <= hi))[0]
            lo = hi
            if not len(keep):
                continue
            sub = ParallelCorpus(corpus_arrays(corpus), corpus_arrays(corpus, tgt=True), corpus.index[keep])
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

    def config_summary(self) -> dict[str, Any]:
        o = self.options
        return {
            "name": "translation",
            "source": o["source"],
            "path": o["path"],
            "hub_name": o["hub_name"],
            "hub_config": o["hub_config"],
            "src_lang": self.src_lang,
            "tgt_lang": self.tgt_lang,
            "splits": dict(o["splits"]),
            "vocab_size": self.vocab_size,
            "max_len": self.max_len,
            "max_tokens": self.max_tokens,
            "n_train": len(self.corpora["train"]),
            "n_dropped": self.n_dropped,
            "n_val": len(self.corpora["val"]),
            "n_test": len(self.corpora["test"]),
            "train_batches": len(self._train_batches),
            "train_length": self.train_length,
            "tokenizer_cache": str(self.cache_path) if self.cache_path else None,
        }


def corpus_arrays(corpus: ParallelCorpus, tgt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    return (corpus.tgt_flat, corpus.tgt_off) if tgt else (corpus.src_flat, corpus.src_off)


def _build(cfg: dict[str, Any], model_kind: str, seed: int) -> TranslationDataModule:
    return TranslationDataModule(cfg, model_kind, seed)


def _register() -> None:
    from posformer.data import register_dataset

    register_dataset("translation", _build)


_register()

__all__ = [
    "ParallelCorpus",
    "TokenBatchSampler",
    "TranslationDataModule",
    "collate_translation",
    "find_file",
    "read_lines",
    "read_parallel",
    "token_batches",
    "train_tokenizer",
]
