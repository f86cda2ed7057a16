"""The token store: a tokenised corpus as memory-mapped shards, read back as one stream per split.

Layout (the nanoGPT / Megatron idea: flat token files plus an index), under ``<cache_dir>/text/<key>``::

    meta.json              the index, written last: key, tokenizer, dtype, per split its shards
                           (tokens, documents, CRC-32), tokens, documents, characters
    <tokenizer files>      vocab.json | tokenizer_byte.json | tokenizer.json (+ pretrained.json)
    train/000000.bin       tokens: little-endian uint16 (vocabulary <= 65,535) or uint32, no header
    train/000000.docs.npy  int64 (d,): where each document ending in this shard ends (shard-local)
    train/000000.json      the shard's record: tokens, documents, characters, CRC-32, and the source
                           position after it (what a resumed build skips)
    val/...

A shard is complete when its record exists (written atomically after the shard's files, which are
renamed into place first); a build in progress lives in ``<key>.partial`` and becomes ``<key>`` by one
rename once ``meta.json`` is written. A killed build leaves complete shards and at most one unfinished
``.tmp`` file, which the next build removes before it continues after the last complete shard
(:class:`ShardWriter`). Loading (:func:`open_store`) checks every shard's size against the index and,
for a split of at most :data:`~posformer.data.cache.HASH_LIMIT` bytes, its CRC-32; a shard that differs
is a :class:`StoreDamage` naming it, which the datamodule repairs by rebuilding from that shard on
(the shards before it are kept).

:class:`TokenStream` is one split: ``len`` tokens, ``stream[a:b]`` -> ``(b - a,)`` array across shard
boundaries, ``documents()`` -> ``(D,)`` global document ends. It pickles as paths (DataLoader workers,
DDP processes reopen the files; nothing is copied).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import errno
import json
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from posformer.data.cache import HASH_LIMIT, cache_write_error
from posformer.errors import DataError
from posformer.io import atomic_write_json

STORE_VERSION = 2
SPLITS = ("train", "val")
#: tokens per shard: 64 MiB of uint16 (shards close at the first piece boundary past it)
SHARD_TOKENS = 1 << 25
#: the errors of a disk that is full
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,535), else uint32."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def shard_name(index: int) -> str:
    return f"{index:06d}"


class StoreDamage(ValueError):
    """A store file that is missing or differs from its record: ``split`` and ``shard`` name the first
    damaged shard (``shard`` None: the index or the tokenizer; rebuilt whole)."""

    def __init__(self, message: str, split: str | None = None, shard: int | None = None) -> None:
        super().__init__(message)
        self.split, self.shard = split, shard


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


# -------------------------------------------------------------------------------------------- reading
class TokenStream:
    """One split of a store: the shards' tokens as one stream (memory-mapped, opened lazily)."""

    def __init__(self, folder: Path, records: list[dict[str, Any]], dtype: str) -> None:
        self.folder, self.records, self.dtype = Path(folder), records, np.dtype(dtype)
        counts = np.array([int(r["tokens"]) for r in records], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (S + 1,)
        self._bounds = self.starts.tolist()  # the same as Python ints (bisect in the window path)
        self._maps: list[np.ndarray] | None = None
        self._docs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shards(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [  # plain ndarray views of the maps: a slice of one is quicker than of a np.memmap
                np.asarray(np.memmap(self.folder / f"{shard_name(i)}.bin", dtype=self.dtype, mode="r"))
                if int(r["tokens"])
                else np.zeros(0, dtype=self.dtype)
                for i, r in enumerate(self.records)
            ]
        return self._maps

    def __getitem__(self, key: int | slice) -> Any:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return np.asarray(self)[key]
            return self._range(start, max(start, stop))
        i = int(key) + (n if int(key) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(key)
        return self._range(i, i + 1)[0]

    def _range(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` -> ``(stop - start,)`` array of the store's dtype."""
        maps = self._maps if self._maps is not None else self._shards()
        bounds = self._bounds
        first = bisect.bisect_right(bounds, start) - 1
        if 0 <= first < len(maps) and stop <= bounds[first + 1]:  # inside one shard: a view of it
            return maps[first][start - bounds[first] : stop - bounds[first]]
        parts = []
        k, pos = max(first, 0), start
        while pos < stop and k < len(maps):
            lo, hi = pos - int(self.starts[k]), min(stop, int(self.starts[k + 1])) - int(self.starts[k])
            if hi > lo:
                parts.append(maps[k][lo:hi])
                pos += hi - lo
            k += 1
        if len(parts) == 1:
            return np.asarray(parts[0])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._range(0, len(self))
        return out.astype(dtype) if dtype is not None else out

    def __iter__(self) -> Iterator[int]:
        for shard in self._shards():
            for start in range(0, len(shard), 1 << 20):
                yield from shard[start : start + (1 << 20)].tolist()

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def documents(self) -> np.ndarray:
        """``(D,)`` int64: where each document ends in the stream (the last one at ``len``)."""
        if self._docs is None:
            self._docs = document_ends(self.folder, self.records)
        return self._docs

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "records": self.records, "dtype": self.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(Path(state["folder"]), state["records"], state["dtype"])


def document_ends(folder: Path, records: list[dict[str, Any]]) -> np.ndarray:
    """``(D,)`` int64: where each document of a split's shards (``folder``, their ``records``) ends in
    the split's stream."""
    out = np.empty(sum(int(r["documents"]) for r in records), dtype=np.int64)
    at = start = 0
    for i, rec in enumerate(records):
        ends = np.load(folder / f"{shard_name(i)}.docs.npy")
        out[at : at + len(ends)] = ends + start
        at, start = at + len(ends), start + int(rec["tokens"])
    return out


def open_store(folder: Path) -> tuple[dict[str, Any], dict[str, TokenStream]]:
    """``(meta, {split: TokenStream})`` of a complete store; a damaged file -> :class:`StoreDamage`."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("version") != STORE_VERSION:
            raise ValueError(f"version {meta.get('version') if isinstance(meta, dict) else None}")
        splits = {s: meta["splits"][s] for s in SPLITS}
        dtype = np.dtype(meta["dtype"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreDamage(f"meta.json is not a store index ({type(exc).__name__}: {exc})") from None
    streams = {}
    for split, info in splits.items():
        check_shards(folder / split, info["shards"], dtype, split)
        streams[split] = TokenStream(folder / split, info["shards"], dtype.str)
    return meta, streams


def check_shards(folder: Path, records: list[dict[str, Any]], dtype: np.dtype, split: str) -> None:
    """Every shard's size against its record; the CRC-32 too when the split is small."""
    total = sum(int(r["tokens"]) for r in records) * dtype.itemsize
    for i, rec in enumerate(records):
        path = folder / f"{shard_name(i)}.bin"
        where = f"{split}/{path.name}"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreDamage(f"{where} is missing", split, i) from None
        want = int(rec["tokens"]) * dtype.itemsize
        if size != want:
            raise StoreDamage(f"{where} has {size:,} bytes, its record {want:,} (truncated?)", split, i)
        if not (folder / f"{shard_name(i)}.docs.npy").is_file():
            raise StoreDamage(f"{split}/{shard_name(i)}.docs.npy is missing", split, i)
        if total <= HASH_LIMIT and crc32_of(path) != int(rec["crc32"]):
            raise StoreDamage(f"{where} does not match its CRC-32", split, i)


# -------------------------------------------------------------------------------------------- writing
def full_disk_error(folder: Path, exc: OSError, done: str) -> Exception:
    """The one line of a disk that filled up mid-build (what is kept, how to continue); other OS errors
    as :func:`~posformer.data.cache.cache_write_error` says."""
    if exc.errno not in FULL_ERRNOS:
        return cache_write_error(folder.parent.parent, exc)
    return DataError(
        f"the disk of the data store {str(folder)!r} is full ({exc.strerror}) while writing its next shard; "
        f"{done} are kept. Free space there, or choose another cache with data.cache_dir=/other/disk (or "
        "POSFORMER_CACHE), and run the same command again: the build continues after the last complete shard."
    )


class ShardWriter:
    """One split's shards in ``<store>/<split>/``: appends tokens, closes a shard at the first piece
    boundary past :data:`SHARD_TOKENS`, and resumes after the last complete shard of an earlier build."""

    def __init__(
        self,
        store: Path,
        split: str,
        dtype: np.dtype,
        budget: int | None = None,
        shard_tokens: int | None = None,
    ) -> None:
        self.store, self.split, self.dtype = Path(store), split, np.dtype(dtype)
        self.folder = self.store / split
        self.budget, self.shard_tokens = budget, int(shard_tokens or SHARD_TOKENS)
        self.records: list[dict[str, Any]] = []
        self.position: list[int] = [0, 0]  # (pass, piece) after the last piece taken
        self._file: Any = None
        self._open_tokens = self._open_chars = 0
        self._crc = 0
        self._ends = array.array("q")  # the open shard's document ends (8 bytes each)
        self._resume()

    # ---- state
    @property
    def tokens(self) -> int:
        return sum(int(r["tokens"]) for r in self.records) + self._open_tokens

    @property
    def full(self) -> bool:
        return self.budget is not None and self.tokens >= self.budget

    def _resume(self) -> None:
        """Keep the complete shards of an earlier build (in order, each with its record and files of the
        recorded size); remove the rest."""
        self.folder.mkdir(parents=True, exist_ok=True)
        i = 0
        while True:
            rec_file = self.folder / f"{shard_name(i)}.json"
            try:
                rec = json.loads(rec_file.read_text(encoding="utf-8"))
                size = (self.folder / f"{shard_name(i)}.bin").stat().st_size
                ok = size == int(rec["tokens"]) * self.dtype.itemsize
                ok = ok and (self.folder / f"{shard_name(i)}.docs.npy").is_file()
            except (OSError, ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                break
            self.records.append(rec)
            i += 1
        keep = {f"{shard_name(k)}{ext}" for k in range(i) for ext in (".bin", ".docs.npy", ".json")}
        for stray in self.folder.iterdir():
            if stray.name not in keep:
                stray.unlink()
        if self.records:
            self.position = list(self.records[-1]["position"])

    def takes(self, position: tuple[int, int]) -> bool:
        """Whether the piece at ``position`` is new to this split (not in a complete shard) and fits."""
        return list(position) >= self.position and not self.full

    # ---- writing
    def add(self, tokens: np.ndarray, position: tuple[int, int], chars: int, doc_end: bool) -> None:
        """Append one piece's tokens (``(n,)``; cut at the budget); ``doc_end``: a document ends here."""
        if self.budget is not None:
            tokens = tokens[: max(0, self.budget - self.tokens)]
        if self._file is None:
            self._open()
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._open_tokens += len(tokens)
        self._open_chars += int(chars)
        if doc_end or self.full:
            self._ends.append(self._open_tokens)
        self.position = [int(position[0]), int(position[1]) + 1]
        if self._open_tokens >= self.shard_tokens or self.full:
            self.close_shard()

    def _open(self) -> None:
        try:
            self._file = open(self.folder / f"{shard_name(len(self.records))}.bin.tmp", "wb")  # noqa: SIM115
        except OSError as exc:
            raise self._error(exc) from None
        self._open_tokens = self._open_chars = self._crc = 0
        self._ends = array.array("q")

    def _write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            self._abandon()
            raise self._error(exc) from None

    def close_shard(self) -> None:
        """Make the open shard complete: its files renamed into place, then its record."""
        if self._file is None:
            return
        name = shard_name(len(self.records))
        record = {
            "tokens": self._open_tokens,
            "documents": len(self._ends),
            "chars": self._open_chars,
            "crc32": self._crc,
            "position": self.position,
        }
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            np.save(self.folder / f"{name}.docs.tmp.npy", np.frombuffer(self._ends, dtype=np.int64))
            os.replace(self.folder / f"{name}.docs.tmp.npy", self.folder / f"{name}.docs.npy")
            os.replace(self.folder / f"{name}.bin.tmp", self.folder / f"{name}.bin")
            atomic_write_json(self.folder / f"{name}.json", record)
        except OSError as exc:
            self._abandon()
            raise self._error(exc) from None
        self._file = None
        self.records.append(record)
        self._open_tokens = self._open_chars = 0

    def _abandon(self) -> None:
        """Drop the unfinished shard (its bytes free the disk; the complete shards stay)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        for tmp in self.folder.glob("*.tmp*"):
            tmp.unlink(missing_ok=True)
        self._open_tokens = self._open_chars = 0

    def _error(self, exc: OSError) -> Exception:
        done = f"{len(self.records)} complete {self.split} shard(s) ({self.tokens:,} tokens)"
        return full_disk_error(self.store, exc, done)

    def summary(self) -> dict[str, Any]:
        """The split's entry of ``meta.json``."""
        return {
            "shards": self.records,
            "tokens": self.tokens,
            "documents": sum(int(r["documents"]) for r in self.records),
            "chars": sum(int(r["chars"]) for r in self.records),
        }


def drop_from(store: Path, split: str, shard: int) -> None:
    """Remove shard ``shard`` of ``split`` and every later one (their records first), so that a build
    continues from there."""
    folder = store / split
    for rec in sorted(folder.glob("*.json"), reverse=True):
        if rec.stem.isdigit() and int(rec.stem) >= shard:
            rec.unlink()
    for path in folder.iterdir():
        stem = path.name.split(".", 1)[0]
        if stem.isdigit() and int(stem) >= shard:
            path.unlink()


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
