"""Building a token store (:mod:`posformer.data.store`) from a source (:mod:`posformer.data.sources`).

:func:`build_store` holds ``<key>.lock`` (:func:`store_lock`: a second process building the same store
waits while the holder shows signs of life, then loads it), then:

1. the tokenizer: loaded from an earlier, unfinished build of this store, else made (``make_tokenizer``:
   trained on the source where it learns from the text) and saved into ``<key>.partial`` with the
   size and SHA-256 of its files;
2. the pieces: read in batches, tokenised in order by ``num_proc`` worker processes (a process pool
   with at most ``2 * num_proc`` batches in flight, so memory does not grow with the corpus; one
   process: in this one), appended to their split's :class:`~posformer.data.store.ShardWriter`
   (each split cut at its token budget, ``budgets``); a piece an earlier build wrote is skipped;
3. ``meta.json``, then one rename of ``<key>.partial`` to ``<key>``.

A progress line (tokens, tokens/s, ETA where the source knows its size) is logged every
:data:`PROGRESS_SECONDS`. A pretrained tokenizer ends every document with its end-of-text id
(``document_end`` of the tokenizer: nothing for ``char``, ``byte``, ``bpe``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from posformer.data import store
from posformer.data.cache import cache_file_records, cache_write_error, check_cache_files
from posformer.data.sources import Batch
from posformer.data.store import SPLITS, STORE_VERSION, ShardWriter, remove_tree, token_dtype
from posformer.errors import ConfigError
from posformer.io import atomic_write_json, hold_lock, keep_alive, release_lock

log = logging.getLogger("posformer.data")
PROGRESS_SECONDS = 10.0
#: how often a building process touches its store's lock (its sign of life), and how long another
#: process waits on a holder that has shown none (seconds)
LOCK_BEAT = 5.0
LOCK_WAIT = 120.0
#: the tokenizer's files in a partial build (their sizes and hashes)
TOKENIZER_RECORD = "tokenizer_files.json"


def partial_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ".partial")


@contextlib.contextmanager
def store_lock(folder: Path) -> Iterator[None]:
    """Hold ``<folder>.lock`` (:func:`posformer.io.hold_lock`: not through a symlink, the holder's pid,
    host and start recorded in it; released with the process if it dies). The holder keeps it fresh
    (:func:`~posformer.io.keep_alive`, every :data:`LOCK_BEAT` s), so a second process waits for a
    build of any length, and refuses in one line naming the holder once it has been silent for
    :data:`LOCK_WAIT` s (stopped with SIGSTOP or Ctrl-Z, or hung)."""
    lock = folder.with_name(folder.name + ".lock")
    cache = folder.parent.parent
    held: list[str] = []  # the holder's record, once the lock was found held

    def busy(holder: str) -> str:
        held.append(holder)
        return (
            f"the data store '{folder}' is being built by another process ({holder}), which has shown no "
            f"sign of life for over {LOCK_WAIT:g} s (the limit; a building process touches its lock every "
            f"{LOCK_BEAT:g} s), so it is stopped or hung. Resume it (kill -CONT <pid>) or end it and run "
            "again (the build continues after its last complete shard), or choose another cache with "
            "data.cache_dir=/other/dir."
        )

    how = {
        "what": "the data store's lock file",
        "busy": busy,
        "fix": "choose another cache (data.cache_dir=...)",
    }
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = hold_lock(lock, wait=0, **how)
        except ConfigError:
            if not held:  # not a held lock: a link or a special file there
                raise
            log.info("data store %s is being built by another process (%s); waiting for it", folder, held[0])
            fd = hold_lock(lock, wait=LOCK_WAIT, alive=True, **how)
    except OSError as exc:
        raise cache_write_error(cache, exc) from None
    try:
        with keep_alive(fd, LOCK_BEAT):
            yield
    finally:
        release_lock(fd)


# ------------------------------------------------------------------------------------------ tokenising
_WORKER_TOKENIZER: Any = None


def _init_worker(tok: Any) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER_TOKENIZER = tok


def encode_texts(tok: Any, texts: list[str]) -> list[np.ndarray]:
    """Texts -> their ids, one ``(n_i,)`` array each (a tokenizer with ``encode_batch``: one call)."""
    if hasattr(tok, "encode_batch"):
        return [np.asarray(ids, dtype=np.uint32) for ids in tok.encode_batch(texts)]
    return [np.asarray(tok.encode(t)) for t in texts]


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A worker's task: the ids concatenated ``(N,)`` and their lengths ``(n,)`` (two arrays to send
    back instead of one per text)."""
    arrays = encode_texts(_WORKER_TOKENIZER, texts)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    return (np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)), lengths


def encoded(tok: Any, batches: Iterator[Batch], num_proc: int) -> Iterator[tuple[Batch, list[np.ndarray]]]:
    """``(batch, per-piece ids)`` in the order of ``batches``; ``num_proc > 1``: tokenised by a pool of
    worker processes, at most ``2 * num_proc`` batches ahead of the caller."""

    def split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []

    if num_proc <= 1:
        for batch in batches:
            yield batch, encode_texts(tok, [p[2] for p in batch[1]])
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    window: deque[tuple[Batch, Future]] = deque()
    with ProcessPoolExecutor(num_proc, mp.get_context(method), _init_worker, (tok,)) as pool:
        try:
            for batch in batches:
                window.append((batch, pool.submit(_encode_in_worker, [p[2] for p in batch[1]])))
                if len(window) >= 2 * num_proc:
                    done, future = window.popleft()
                    yield done, split(*future.result())
            while window:
                done, future = window.popleft()
                yield done, split(*future.result())
        finally:
            for _, future in window:
                future.cancel()


# ------------------------------------------------------------------------------------------ progress
class Progress:
    """One log line every :data:`PROGRESS_SECONDS`: tokens, tokens/s and (with a known size) the ETA."""

    def __init__(self, name: str, fraction: Callable[[], float | None]) -> None:
        self.name, self.fraction = name, fraction
        self.start = self.last = time.perf_counter()

    def update(self, tokens: int, new_tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last = now
        rate = new_tokens / max(now - self.start, 1e-9)
        done = self.fraction()
        eta = ""
        if done:
            left = (now - self.start) * (1 - done) / done
            eta = f", {100 * done:.0f}% read, ETA {time.strftime('%H:%M:%S', time.gmtime(left))}"
        log.info("data store %s: %s tokens, %s tokens/s%s", self.name, f"{tokens:,}", f"{rate:,.0f}", eta)


# ------------------------------------------------------------------------------------------ building
def _tokenizer(partial: Path, make: Callable[[], Any], load: Callable[[Path], Any]) -> Any:
    """The tokenizer of an earlier, unfinished build (its files as recorded), else a new one, saved."""
    record = partial / TOKENIZER_RECORD
    if record.is_file():
        try:
            check_cache_files(partial, {"files": json.loads(record.read_text(encoding="utf-8"))})
            return load(partial)
        except Exception as exc:  # noqa: BLE001 - damaged: start the build over
            log.warning("data store %s: its tokenizer files are damaged (%s); building it anew", partial, exc)
    remove_tree(partial)
    tok = make()
    try:
        partial.mkdir(parents=True)
        tok.save(partial)
        atomic_write_json(record, cache_file_records(partial))
    except OSError as exc:
        raise cache_write_error(partial.parent.parent, exc) from None
    return tok


def build_store(
    folder: Path,
    source: Any,
    make_tokenizer: Callable[[], Any],
    load_tokenizer: Callable[[Path], Any],
    *,
    name: str,
    meta: dict[str, Any],
    budgets: dict[str, int | None],
    num_proc: int = 1,
    shard_tokens: int | None = None,
) -> None:
    """Build (or finish building) the store ``folder`` from ``source``; see the module docstring.
    ``shard_tokens``: tokens per shard (default :data:`posformer.data.store.SHARD_TOKENS`)."""
    start = time.perf_counter()
    shard_tokens = shard_tokens or store.SHARD_TOKENS
    partial = partial_of(folder)
    tok = _tokenizer(partial, make_tokenizer, load_tokenizer)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: ShardWriter(partial, s, dtype, budgets.get(s), shard_tokens) for s in SPLITS}
    kept = sum(w.tokens for w in writers.values())
    if kept:
        log.info("data store %s: continuing an unfinished build after %s tokens", name, f"{kept:,}")
    end_ids = list(getattr(tok, "document_end", []))
    progress = Progress(name, source.progress)

    def todo(batches: Iterator[Batch]) -> Iterator[Batch]:  # what no complete shard holds
        for p, pieces in batches:
            new = [piece for piece in pieces if writers[piece[0]].takes((p, piece[1]))]
            if new:
                yield p, new

    for (p, pieces), ids in encoded(tok, todo(source.batches(lambda s: writers[s].full)), num_proc):
        for (split, index, text, doc_end), piece_ids in zip(pieces, ids, strict=True):
            writer = writers[split]
            if not writer.takes((p, index)):
                continue
            if doc_end and end_ids:
                piece_ids = np.concatenate([piece_ids, np.asarray(end_ids, dtype=piece_ids.dtype)])
            writer.add(piece_ids, (p, index), len(text), doc_end)
        total = sum(w.tokens for w in writers.values())
        progress.update(total, total - kept)
    for writer in writers.values():
        writer.close_shard()
    index = {
        "version": STORE_VERSION,
        **meta,
        "tokenizer": tok.kind,
        "vocab_size": int(tok.vocab_size),
        "dtype": dtype.str,
        "rows": bool(getattr(source, "rows", False)),
        "files": cache_file_records(partial),
        "splits": {s: w.summary() for s, w in writers.items()},
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    try:
        atomic_write_json(partial / "meta.json", index)
        os.replace(partial, folder)
    except OSError as exc:
        raise cache_write_error(folder.parent.parent, exc) from None
