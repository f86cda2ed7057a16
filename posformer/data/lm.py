"""Language modelling on flat token streams: the windows, the stream cache and the shared datamodule.

:class:`LMDataModule` is the base of ``data=text`` (:mod:`posformer.data.text`) and ``data=hub``
(:mod:`posformer.data.hub`); a subclass says where the text comes from (``read_splits``,
``source_key``, ``source_name``, ``source_size``).

Pipeline: read the text -> split off the validation part -> train the tokenizer on the training part
(``char``: vocabulary of the whole text) -> encode both parts into flat token streams -> cache them
(``train.npy``, ``val.npy``, the tokenizer files, ``meta.json``) under ``<cache_dir>/text/<key>``,
where ``key`` hashes everything that changes the streams (the source, the tokenizer and its
vocabulary size, ``val_fraction``, ``encoding_errors``). Block size and evaluation lengths only
change how the streams are cut, so they are not part of the key. A split too short for one window
(``block_size + 1`` tokens) is an error naming the source, its size and the minimum.

Batches (decoder-only): ``input_ids``/``labels`` are a window of ``L + 1`` tokens shifted by one (every
position scored), ``attention_mask`` all True. Training: non-overlapping blocks of ``block_size``
(windows start every ``block_size`` tokens). ``eval_chunks(L, n_tokens)``: ``n_tokens // L``
non-overlapping windows from the start of the validation stream, so every length scores the same
tokens (when ``n_tokens`` is a multiple of the lengths). ``data.pack=true``: the training windows are
packed documents instead (cut at ``data.doc_separator``; :mod:`posformer.data.packing`), with
``segment_ids``; validation stays unpacked.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from posformer.data.base import BaseDataModule, check_int, eval_batch_size
from posformer.data.cache import (
    ACCESS_ERRNOS,
    cache_file_records,
    cache_write_error,
    check_cache_files,
    check_cache_writable,
)
from posformer.data.files import content_hash, default_cache_dir
from posformer.data.options import (
    LENGTHS,
    SEED,
    Option,
    checked_options,
    count,
    defaults_of,
    fraction,
    lengths,
)
from posformer.data.packing import LM_PACK_OPTIONS, packed_lm_dataset
from posformer.data.tokenizers import TOKENIZERS, load_tokenizer, train_tokenizer
from posformer.errors import DataError
from posformer.rules import one_of

CACHE_VERSION = 1
log = logging.getLogger("posformer.data")

#: the options of every language-model dataset (data=text, hub, corpus): default and rule
COMMON_OPTIONS: dict[str, Option] = {
    "tokenizer": Option("char", one_of(*TOKENIZERS)),  # char | byte | bpe
    "vocab_size": Option(4096, count(), when=lambda o: o.get("tokenizer") == "bpe"),  # bpe only
    "block_size": Option(256, count()),  # training length (tokens per training window)
    "val_fraction": Option(0.1, fraction("0.1")),
    "eval_lengths": Option([64, 128, 256, 512, 1024], LENGTHS, null=True),
    "eval_tokens": Option(16384, count()),  # scored tokens per evaluation length
    # cap on validation tokens scored by val_dataloader (None: all)
    "val_tokens": Option(None, count(null="the whole validation split"), null=True),
    # default batch_size, shrunk at long lengths (same tokens per batch)
    "eval_batch_size": Option(None, count(null="data.batch_size"), null=True),
    "batch_size": Option(32, count()),
    "num_workers": Option(0, count(0)),
    "encoding_errors": Option("strict", one_of("strict", "replace")),
    "seed": Option(None, SEED, null=True),  # data seed; None: the run seed
    "cache_dir": Option(None),
    **LM_PACK_OPTIONS,  # pack, doc_separator
}
COMMON_DEFAULTS: dict[str, Any] = defaults_of(COMMON_OPTIONS)


# ----------------------------------------------------------------------------------------- datasets
class WindowDataset(Dataset):
    """``count`` windows of ``length + 1`` tokens from ``stream``, starting every ``length`` tokens."""

    def __init__(self, stream: np.ndarray, length: int, count: int | None = None) -> None:
        self.stream, self.length = stream, int(length)
        available = max(0, (len(stream) - 1) // self.length)
        self.count = available if count is None else min(int(count), available)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = i * self.length
        return np.asarray(self.stream[start : start + self.length + 1], dtype=np.int64)


def collate_lm(rows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Windows of ``T + 1`` tokens -> input_ids (B, T), labels (B, T) shifted by one, attention_mask."""
    x = torch.from_numpy(np.stack(rows))
    inputs = x[:, :-1].contiguous()
    return {
        "input_ids": inputs,
        "labels": x[:, 1:].contiguous(),
        "attention_mask": torch.ones_like(inputs, dtype=torch.bool),
    }


# ------------------------------------------------------------------------------------------ module
class LMDataModule(BaseDataModule):
    """Shared by ``data=text`` and ``data=hub``: token streams -> windows."""

    task_type = "lm"
    name = "lm"
    OPTIONS: dict[str, Option] = COMMON_OPTIONS
    MODEL_KINDS = ("decoder",)
    defaults: dict[str, Any] = COMMON_DEFAULTS

    def __init__(self, cfg: dict[str, Any], model_kind: str, seed: int) -> None:
        super().__init__()
        o = checked_options(type(self), cfg, model_kind)
        self.block_size = o["block_size"]
        self.batch_size = o["batch_size"]
        self._eval_batch = o["eval_batch_size"]
        self.num_workers = o["num_workers"]
        self.eval_tokens = o["eval_tokens"]
        self.val_tokens = o["val_tokens"]
        self.eval_lengths = lengths(o["eval_lengths"]) or [self.block_size]
        self.options = o
        self.shuffle_seed = int(seed)
        self.data_seed = int(o["seed"] if o["seed"] is not None else seed)
        self.cache_root = Path(o["cache_dir"]).expanduser() if o["cache_dir"] else default_cache_dir()
        self.train_length = self.block_size
        self.pad_id = 0
        self.collate = collate_lm
        self.cache_path = self.cache_root / "text" / content_hash(self.cache_key())
        self._load_or_build()
        self.vocab_size = self.tokenizer.vocab_size
        log.info("%s", self.size_line())
        self._check_split("training", "train", len(self.train_stream))
        self._check_split("validation", "val", len(self.val_stream))
        self._train = WindowDataset(self.train_stream, self.block_size)
        self.pack = o["pack"]
        if self.pack:  # packed documents, each tokenised on its own (validation stays unpacked)
            train_text = self.read_splits()[0]
            self._train = packed_lm_dataset(
                train_text, self.tokenizer.encode, o["doc_separator"], self.block_size, self.source_name()
            )

    # ---- to implement
    def source_key(self) -> dict[str, Any]:
        raise NotImplementedError

    def source_name(self) -> str:
        raise NotImplementedError

    def source_size(self) -> str:
        """What the source holds, for error messages (``"1,234 bytes"``); empty when unknown."""
        return ""

    def read_splits(self) -> tuple[str, str]:
        """(train text, val text)."""
        raise NotImplementedError

    def document_counts(self) -> dict[str, int]:
        """``{"train_documents": n, "val_documents": m}`` where the source has rows (after
        :meth:`read_splits`; a split cut from the training text has no count of its own)."""
        train, val = getattr(self, "documents", (None, None))
        return {k: int(v) for k, v in (("train_documents", train), ("val_documents", val)) if v is not None}

    def size_line(self) -> str:
        """``data <source>: train 1,200 documents, 51,234 characters, 51,234 tokens; validation ...``
        (documents where the source has rows; from the stream cache's ``meta.json``)."""
        parts = []
        for split, name in (("train", "train"), ("val", "validation")):
            docs = self.meta.get(f"{split}_documents")
            counts = [f"{docs:,} documents"] if docs is not None else []
            counts += [f"{int(self.meta.get(f'{split}_chars', 0)):,} characters"]
            counts += [f"{int(len(self.train_stream if split == 'train' else self.val_stream)):,} tokens"]
            parts.append(f"{name} {', '.join(counts)}")
        return f"data {self.source_name()}: {'; '.join(parts)} ({self.tokenizer.kind} tokenizer)"

    # ---- checks
    def _split_error(self, which: str, n_tokens: int, n_chars: int, total_chars: int) -> DataError:
        """A split with fewer than one window of tokens: name the source, its size and the minimum."""
        need, frac = self.block_size + 1, float(self.options["val_fraction"])
        share = frac if which == "validation" else 1.0 - frac
        chars_per_token = n_chars / n_tokens if n_tokens else 1.0
        min_chars = math.ceil(need * chars_per_token / share)
        size = self.source_size()
        fixes = [f"use a text of at least ~{min_chars:,} characters"]
        wanted = math.ceil(100 * need * chars_per_token / total_chars) / 100 if total_chars else 1.0
        if which == "validation" and wanted < 0.9:
            fixes.append(f"raise data.val_fraction to {wanted:.2f}")
        if n_tokens >= 2:
            fixes.append(f"lower data.block_size to {n_tokens - 1}")
        return DataError(
            f"{self.source_name()}{f' ({size})' if size else ''}: the {which} split "
            f"({n_chars:,} of {total_chars:,} characters at data.val_fraction={frac}) has {n_tokens:,} "
            f"tokens, fewer than one window of data.block_size + 1 = {need} tokens; "
            + ", or ".join(fixes)
            + "."
        )

    def _check_split(self, which: str, part: str, n_tokens: int) -> None:
        if (n_tokens - 1) // self.block_size >= 1:
            return
        chars = {k: int(self.meta.get(f"{k}_chars", 0)) for k in ("train", "val")}
        raise self._split_error(which, n_tokens, chars[part], chars["train"] + chars["val"])

    # ---- cache
    def cache_key(self) -> dict[str, Any]:
        o = self.options
        return {
            "version": CACHE_VERSION,
            "source": self.source_key(),
            "tokenizer": o["tokenizer"],
            "vocab_size": o["vocab_size"] if o["tokenizer"] == "bpe" else None,
            "val_fraction": float(o["val_fraction"]),
            "encoding_errors": o["encoding_errors"],
        }

    def _load_or_build(self) -> None:
        """Load the stream cache, building it first when missing; a corrupt one (a file that fails to
        load, or whose size or checksum differs from ``meta.json``'s record) is removed and rebuilt with
        one warning line naming it."""
        path = self.cache_path
        if (path / "meta.json").exists():
            try:
                self._load(path)
                return
            except Exception as exc:  # noqa: BLE001 - any failure to load a cache file is corruption
                if isinstance(exc, OSError) and exc.errno in ACCESS_ERRNOS:
                    raise  # unreadable, not corrupt: the error boundary names the path and the fix
                problem = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            log.warning("data cache %s is corrupt (%s); removing it and rebuilding it", path, problem)
            self._remove_corrupt(path)
        self._build(path)
        self._load(path)

    def _load(self, path: Path) -> None:
        """Read the cache folder; a file that fails to load raises naming it (``meta.json: ...``)."""
        step = "meta.json"
        try:
            meta = json.loads((path / "meta.json").read_text())
            check_cache_files(path, meta)
            step = "the tokenizer files"
            self.tokenizer = load_tokenizer(meta["tokenizer"], path)
            step = "train.npy"
            self.train_stream = np.load(path / "train.npy", mmap_mode="r")
            step = "val.npy"
            self.val_stream = np.load(path / "val.npy", mmap_mode="r")
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the file, keep the cause
            raise ValueError(f"{step}: {type(exc).__name__}: {exc}") from exc
        self.meta = meta
        for split in ("train", "val"):  # a valid header over the wrong data: a size that disagrees
            n = len(self.train_stream if split == "train" else self.val_stream)
            if f"{split}_tokens" in meta and n != int(meta[f"{split}_tokens"]):
                recorded = int(meta[f"{split}_tokens"])
                raise ValueError(f"{split}.npy holds {n:,} tokens, meta.json records {recorded:,}")

    def _remove_corrupt(self, path: Path) -> None:
        """Move the corrupt folder aside (one rename: a concurrent reader keeps its open files), then
        delete it."""
        aside = path.with_name(f"{path.name}.corrupt-{os.getpid()}-{time.time_ns()}")
        try:
            path.rename(aside)
        except FileNotFoundError:  # another process removed it first
            return
        except OSError as exc:
            raise cache_write_error(self.cache_root, exc) from None
        shutil.rmtree(aside, ignore_errors=True)

    def _build(self, path: Path) -> None:
        start = time.time()
        check_cache_writable(self.cache_root, path)  # before the work of reading and tokenising
        train_text, val_text = self.read_splits()
        total = len(train_text) + len(val_text)
        if not train_text:
            raise self._split_error("training", 0, 0, total)
        if not val_text:
            raise self._split_error("validation", 0, 0, total)
        o = self.options
        vocab_text = train_text + val_text if o["tokenizer"] == "char" else train_text
        tok = train_tokenizer(o["tokenizer"], vocab_text, int(o["vocab_size"]))
        dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
        train_ids = tok.encode(train_text).astype(dtype)
        val_ids = tok.encode(val_text).astype(dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp", dir=path.parent))
        except OSError as exc:
            raise cache_write_error(self.cache_root, exc) from None
        try:
            tok.save(tmp)
            np.save(tmp / "train.npy", train_ids)
            np.save(tmp / "val.npy", val_ids)
            meta = {
                "files": cache_file_records(tmp),
                "key": self.cache_key(),
                "tokenizer": tok.kind,
                "vocab_size": tok.vocab_size,
                "train_tokens": len(train_ids),
                "val_tokens": len(val_ids),
                "train_chars": len(train_text),
                "val_chars": len(val_text),
                **self.document_counts(),
                "build_seconds": round(time.time() - start, 2),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                tmp.rename(path)
            except OSError:  # another process built it meanwhile
                if not (path / "meta.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- loaders
    def train_dataset(self) -> Dataset:
        """Windows of the training stream (:class:`WindowDataset`; packed: ``PackedWindows``)."""
        return self._train

    def val_dataloader(self) -> DataLoader:
        count = None if self.val_tokens is None else max(1, self.val_tokens // self.block_size)
        return self._loader(
            WindowDataset(self.val_stream, self.block_size, count), self._eval_batch or self.batch_size
        )

    def eval_chunks(self, length: int, n_tokens: int | None = None) -> WindowDataset:
        """``n_tokens // length`` non-overlapping windows of ``length`` scored tokens from the validation
        stream (``n_tokens`` default: ``eval_tokens``, capped by the stream)."""
        length = check_int("eval length", length)
        n_tokens = self.eval_tokens if n_tokens is None else check_int("n_tokens", n_tokens)
        available = len(self.val_stream) - 1
        if available < length:
            raise DataError(
                f"evaluation length {length} needs {length + 1} validation tokens but "
                f"{self.source_name()} has "
                f"{len(self.val_stream)}; evaluate shorter lengths or raise data.val_fraction."
            )
        return WindowDataset(self.val_stream, length, max(1, min(n_tokens, available) // length))

    def eval_dataloaders(self, lengths: list[int] | None = None) -> dict[int, DataLoader]:
        """One loader per length, all scoring the same number of tokens where the stream allows it:
        ``n = min(eval_tokens, val tokens - 1)`` rounded down to a multiple of the longest length."""
        lengths = sorted(
            {check_int("eval length", v) for v in (lengths if lengths is not None else self.eval_lengths)}
        )
        available = len(self.val_stream) - 1
        n = min(self.eval_tokens, available)
        if n >= lengths[-1]:
            n -= n % lengths[-1]
        base = self._eval_batch or self.batch_size
        out = {}
        for length in lengths:
            bs = eval_batch_size(length, base * self.block_size, base)
            out[length] = self._loader(self.eval_chunks(length, n), bs)
        return out

    # ---- misc
    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(ids)

    def run_tokenizer(self) -> Any:
        return self.tokenizer

    def tokenizer_info(self) -> dict[str, Any]:
        return {"data": self.name, "source": self.source_name(), "cache": str(self.cache_path)}

    def config_summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source_name(),
            "tokenizer": self.tokenizer.kind,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "train_length": self.train_length,
            "train_tokens": int(len(self.train_stream)),
            "val_tokens": int(len(self.val_stream)),
            "val_fraction": self.options["val_fraction"],
            "eval_lengths": self.eval_lengths,
            "eval_tokens": self.eval_tokens,
            "batch_size": self.batch_size,
            "shuffle_seed": self.shuffle_seed,
            "pack": self.pack,
            "cache": str(self.cache_path),
        }
