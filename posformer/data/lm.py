"""Language modelling on token stores: the options, the windows and the shared datamodule.

:class:`LMDataModule` is the base of ``data=text`` (:mod:`posformer.data.text`), ``data=hub``
(:mod:`posformer.data.hub`) and ``data=corpus`` (:mod:`posformer.data.corpus`); a subclass says where
the text comes from (``make_source``: a :mod:`posformer.data.sources` source, ``source_key``,
``source_name``, ``source_size``).

Pipeline: the tokenizer (``char``/``bpe`` trained on the source, ``byte``, or a pretrained one:
:mod:`posformer.data.pretrained`) -> the source read in batches, tokenised by ``data.num_proc``
processes, written as memory-mapped shards (:mod:`posformer.data.store`, built by
:mod:`posformer.data.building`) under ``<cache_dir>/text/<key>``, where ``key`` hashes everything that
changes the tokens (the source, the tokenizer, ``val_fraction``, ``encoding_errors``, ``max_tokens``,
packing). Block size and evaluation lengths only change how the streams are cut, so they are not part
of the key. A split too short for one window (``block_size + 1`` tokens) is an error naming the source,
its size and the minimum. ``data.max_tokens`` takes the first that many training tokens of the source
(a prefix of a huge stream) and validation up to ``val_fraction / (1 - val_fraction)`` of it.

Batches (decoder-only): ``input_ids``/``labels`` are a window of ``L + 1`` tokens shifted by one (every
position scored), ``attention_mask`` all True. Training: non-overlapping blocks of ``block_size``
(windows start every ``block_size`` tokens of the training stream, across shard boundaries), in an
order that is a function of the seed and epoch (:class:`~posformer.data.base.ResumableSampler`).
``eval_chunks(L, n_tokens)``: ``n_tokens // L`` non-overlapping windows from the start of the
validation stream, so every length scores the same tokens (when ``n_tokens`` is a multiple of the
lengths); ``data.eval_windows=documents``: only windows inside one document (long-document corpora;
each length then scores what its documents hold, stated per length). ``data.pack=true``: the training
windows are packed documents instead (cut at ``data.doc_separator`` in a text, one per row of a
dataset; :mod:`posformer.data.packing`), with ``segment_ids``; validation stays unpacked.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from posformer.data.base import BaseDataModule, check_int, eval_batch_size
from posformer.data.building import build_store, partial_of, store_lock
from posformer.data.cache import ACCESS_ERRNOS, cache_write_error, check_cache_files, check_cache_writable
from posformer.data.files import content_hash, default_cache_dir
from posformer.data.options import LMOptions, lengths, read_options
from posformer.data.packing import PackedWindows
from posformer.data.pretrained import resolve_pretrained
from posformer.data.store import StoreDamage, TokenStream, drop_from, open_store, remove_tree
from posformer.data.tokenizers import TOKENIZERS, load_tokenizer, train_tokenizer
from posformer.errors import DataError

CACHE_VERSION = 2
log = logging.getLogger("posformer.data")


def available_cores() -> int:
    """The CPU cores this process may run on (``data.num_proc=null``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------- datasets
class WindowDataset(Dataset):
    """``count`` windows of ``length + 1`` tokens from ``stream``, starting every ``length`` tokens, or
    at ``starts`` (``(n,)``: windows inside documents)."""

    def __init__(
        self, stream: Any, length: int, count: int | None = None, starts: np.ndarray | None = None
    ) -> None:
        self.stream, self.length, self.starts = stream, int(length), starts
        available = max(0, (len(stream) - 1) // self.length) if starts is None else len(starts)
        self.count = available if count is None else min(int(count), available)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = i * self.length if self.starts is None else int(self.starts[i])
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


def document_starts(ends: np.ndarray, length: int, n_tokens: int) -> np.ndarray:
    """Starts of non-overlapping windows of ``length + 1`` tokens inside documents (``ends``: ``(D,)``
    where each ends), in stream order, at most ``n_tokens`` targets in all -> ``(n,)`` int64."""
    starts: list[np.ndarray] = []
    have, begin = 0, 0
    for end in ends.tolist():
        k = (end - begin - 1) // length  # whole windows of this document
        if k > 0:
            k = min(k, (n_tokens - have) // length)
            starts.append(begin + length * np.arange(k, dtype=np.int64))
            have += k * length
        begin = end
        if have >= n_tokens:
            break
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------------------------------------ module
class LMDataModule(BaseDataModule):
    """Shared by ``data=text``, ``data=hub`` and ``data=corpus``: a token store -> windows."""

    task_type = "lm"
    name = "lm"
    Options: type[LMOptions] = LMOptions

    def __init__(self, cfg: LMOptions | Mapping[str, Any], model_kind: str, seed: int) -> None:
        super().__init__()
        o = self.options = read_options(self.Options, cfg, model_kind)
        self.block_size = o.block_size
        self.batch_size = o.batch_size
        self._eval_batch = o.eval_batch_size
        self.num_workers = o.num_workers
        self.eval_tokens = o.eval_tokens
        self.val_tokens = o.val_tokens
        self.eval_lengths = lengths(o.eval_lengths) or [self.block_size]
        self.eval_windows = o.eval_windows
        self.shuffle_seed = int(seed)
        self.data_seed = int(o.seed if o.seed is not None else seed)
        self.cache_root = Path(o.cache_dir).expanduser() if o.cache_dir else default_cache_dir()
        self.train_length = self.block_size
        self.pack = o.pack
        # a pretrained tokenizer is read first: a file that is not one fails before any data is read
        self.pretrained = (
            None if o.tokenizer in TOKENIZERS else resolve_pretrained(o.tokenizer, self.cache_root)
        )
        self.collate = collate_lm
        self.cache_path = self.cache_root / "text" / content_hash(self.cache_key())
        self._load_or_build()
        self.vocab_size = self.tokenizer.vocab_size
        self.pad_id = int(getattr(self.tokenizer, "pad_id", 0))
        log.info("%s", self.size_line())
        self._check_split("training", "train", len(self.train_stream))
        self._check_split("validation", "val", len(self.val_stream))
        self._train: Dataset = WindowDataset(self.train_stream, self.block_size)
        if self.pack:  # packed documents, each tokenised on its own (validation stays unpacked)
            self._train = PackedWindows(self.train_stream, self.train_stream.documents(), self.block_size)
            if not len(self._train):
                raise DataError(
                    f"{self.source_name()}: data.pack=true found {len(self.train_stream):,} tokens in "
                    f"{len(self.train_stream.documents())} documents (data.doc_separator="
                    f"{o.doc_separator!r}), fewer than one row of data.block_size + 1 = "
                    f"{self.block_size + 1} tokens; use more text or lower data.block_size."
                )

    # ---- to implement
    def source_key(self) -> dict[str, Any]:
        raise NotImplementedError

    def source_name(self) -> str:
        raise NotImplementedError

    def source_size(self) -> str:
        """What the source holds, for error messages (``"1,234 bytes"``); empty when unknown."""
        return ""

    def make_source(self) -> Any:
        """The source to build the store from (:mod:`posformer.data.sources`), checked: called only to
        build, before anything is written."""
        raise NotImplementedError

    def size_line(self) -> str:
        """``data <source>: train 1,200 documents, 51,234 characters, 51,234 tokens; validation ...``
        (documents where the source has rows; from the store's ``meta.json``)."""
        parts = []
        for split, name in (("train", "train"), ("val", "validation")):
            info = self.meta["splits"][split]
            counts = [f"{int(info['documents']):,} documents"] if self.meta.get("rows") else []
            counts += [f"{int(info['chars']):,} characters", f"{int(info['tokens']):,} tokens"]
            parts.append(f"{name} {', '.join(counts)}")
        return f"data {self.source_name()}: {'; '.join(parts)} ({self.tokenizer.kind} tokenizer)"

    # ---- checks
    def _split_error(self, which: str, n_tokens: int, n_chars: int, total_chars: int) -> DataError:
        """A split with fewer than one window of tokens: name the source, its size and the minimum."""
        need, frac = self.block_size + 1, float(self.options.val_fraction)
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
        chars = {k: int(self.meta["splits"][k]["chars"]) for k in ("train", "val")}
        raise self._split_error(which, n_tokens, chars[part], chars["train"] + chars["val"])

    # ---- the store
    def cache_key(self) -> dict[str, Any]:
        o = self.options
        key = {
            "version": CACHE_VERSION,
            "source": self.source_key(),
            "tokenizer": o.tokenizer if self.pretrained is None else self.pretrained.identity(),
            "vocab_size": o.vocab_size if o.tokenizer == "bpe" else None,
            "val_fraction": float(o.val_fraction),
            "encoding_errors": o.encoding_errors,
        }
        if o.max_tokens is not None:
            key["max_tokens"] = int(o.max_tokens)
        if self.pack:
            key["pack"] = o.doc_separator
        return key

    def budgets(self) -> dict[str, int | None]:
        """Tokens per split: ``max_tokens`` for training and its validation share (None: no limit)."""
        n = self.options.max_tokens
        if n is None:
            return {"train": None, "val": None}
        f = float(self.options.val_fraction)
        return {"train": int(n), "val": max(1, math.ceil(int(n) * f / (1.0 - f)))}

    def _load_or_build(self) -> None:
        """Open the store, building it first when missing (or finishing an unfinished build); a damaged
        one (a shard, the index or the tokenizer files differ from their records) is rebuilt from the
        first damaged shard on, with one warning line naming it."""
        path = self.cache_path
        if (path / "meta.json").exists():
            try:
                self._open(path)
                return
            except StoreDamage as exc:
                kept = f" from {exc.split} shard {exc.shard} on (the shards before it are kept)"
                kept = kept if exc.split else ""
                log.warning("data cache %s is corrupt (%s); rebuilding it%s", path, exc, kept)
                self._set_aside(path, exc)
        check_cache_writable(self.cache_root, path)  # before the work of reading and tokenising
        with store_lock(path):
            if not (path / "meta.json").exists():  # else another process built it meanwhile
                source = self.make_source()
                build_store(
                    path,
                    source,
                    lambda: self._make_tokenizer(source),
                    self._load_tokenizer,
                    name=self.source_name(),
                    meta={"key": self.cache_key()},
                    budgets=self.budgets(),
                    num_proc=self.options.num_proc or available_cores(),
                )
        self._open(path)

    def _open(self, path: Path) -> None:
        """The store's index, streams and tokenizer; a damaged file -> :class:`StoreDamage`."""
        try:
            meta, streams = open_store(path)
            check_cache_files(path, meta)
            self.tokenizer = self._load_tokenizer(path)
        except StoreDamage:
            raise
        except OSError as exc:
            if exc.errno in ACCESS_ERRNOS:
                raise  # unreadable, not corrupt: the error boundary names the path and the fix
            raise StoreDamage(f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a tokenizer file that fails to load is damage too
            raise StoreDamage((str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]) from None
        self.meta = meta
        self.train_stream: TokenStream = streams["train"]
        self.val_stream: TokenStream = streams["val"]

    def _set_aside(self, path: Path, damage: StoreDamage) -> None:
        """Turn a damaged store back into an unfinished build: its damaged shard and the later ones of
        that split removed (damage elsewhere: the index or the tokenizer, rebuilt whole)."""
        partial = partial_of(path)
        try:
            with store_lock(path):
                remove_tree(partial)
                path.rename(partial)
                (partial / "meta.json").unlink(missing_ok=True)
                if damage.split is None:
                    remove_tree(partial)
                else:
                    drop_from(partial, damage.split, int(damage.shard or 0))
        except FileNotFoundError:  # another process moved it first
            return
        except OSError as exc:
            raise cache_write_error(self.cache_root, exc) from None

    def _load_tokenizer(self, folder: Path) -> Any:
        if self.pretrained is not None:
            return type(self.pretrained).load(folder)
        return load_tokenizer(self.options.tokenizer, folder)

    def _make_tokenizer(self, source: Any) -> Any:
        """The run's tokenizer: the pretrained one, or one trained on the source's text (``char``: both
        splits' characters; ``bpe``: the training lines), read once more in batches."""
        o = self.options
        if self.pretrained is not None or o.tokenizer == "byte":
            return self.pretrained or train_tokenizer("byte", "", 0)
        splits = ("train", "val") if o.tokenizer == "char" else ("train",)
        budget = self.budgets()
        read = dict.fromkeys(budget, 0)

        def texts() -> Any:
            for _, pieces in source.batches(lambda s: s not in splits or (budget[s] or math.inf) <= read[s]):
                for split, _, text, _ in pieces:
                    if split in splits:
                        read[split] += len(text)
                        yield text

        started = time.perf_counter()
        tok = train_tokenizer(o.tokenizer, texts(), int(o.vocab_size))
        log.info(
            "data: trained the %s tokenizer (%s tokens) in %.1f s",
            tok.kind,
            f"{tok.vocab_size:,}",
            time.perf_counter() - started,
        )
        return tok

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
        if self.eval_windows == "documents":
            starts = document_starts(self.val_stream.documents(), length, max(n_tokens, length))
            if not len(starts):
                raise DataError(
                    f"evaluation length {length} with data.eval_windows=documents needs a validation "
                    f"document of at least {length + 1} tokens, but {self.source_name()} has none; evaluate "
                    "shorter lengths, or score windows anywhere in the stream with data.eval_windows=stream."
                )
            return WindowDataset(self.val_stream, length, starts=starts)
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
            "tokenizer_identity": self.tokenizer.identity(),
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "train_length": self.train_length,
            "train_tokens": int(len(self.train_stream)),
            "val_tokens": int(len(self.val_stream)),
            "val_fraction": self.options.val_fraction,
            "eval_lengths": self.eval_lengths,
            "eval_tokens": self.eval_tokens,
            "eval_windows": self.eval_windows,
            "batch_size": self.batch_size,
            "shuffle_seed": self.shuffle_seed,
            "pack": self.pack,
            "cache": str(self.cache_path),
        }
