"""The integrity of a data cache folder (the stream cache of :mod:`posformer.data.lm`).

A cache folder records, in its ``meta.json``, the size and SHA-256 of every other file it holds
(:func:`cache_file_records`, at build time). :func:`check_cache_files` compares them on load (sizes
always; checksums of files up to :data:`HASH_LIMIT` bytes, so a multi-GB token stream costs no hashing
per run: its size and its ``.npy`` header are checked instead) and raises ``ValueError`` naming the
first file that differs, which the loader treats as corruption (removed, rebuilt, one warning line).
A cache folder built before these records were kept is loaded as before.

A split generated through HF ``datasets`` (the synthetic tasks) lives in HF's cache; a damaged one (a
truncated ``.arrow``: pyarrow fails to load it) is removed with one warning and generated again
(:func:`drop_damaged_generator_cache`).

A cache that cannot be written (read-only, permission denied) is one
:class:`~posformer.errors.DataError` naming the path and the fix (:func:`cache_write_error`),
checked before the data is read (:func:`check_cache_writable`) and when a write fails.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from posformer.data.files import file_digest
from posformer.errors import DataError
from posformer.io import atomic_write_bytes, atomic_write_text

T = TypeVar("T")
log = logging.getLogger("posformer.data")

#: files above this size are checked by size only (hashing them on every load would cost seconds)
HASH_LIMIT = 64 << 20
#: the errors of a cache location that cannot be written
WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def cache_file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": n, "sha256": hex}}`` for every file in ``folder`` but ``meta.json``."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)}
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.name != "meta.json"
    }


def check_cache_files(folder: Path, meta: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first file of ``folder`` whose size or checksum differs from
    ``meta["files"]`` (no record: nothing to check)."""
    records = meta.get("files")
    if records is None:
        return
    if not isinstance(records, dict):
        raise ValueError("meta.json's file records are not a mapping")
    for name, rec in records.items():
        path = Path(folder) / str(name)
        size = path.stat().st_size  # a missing file: FileNotFoundError, also corruption
        if size != int(rec["bytes"]):
            raise ValueError(f"{name} has {size:,} bytes, meta.json records {int(rec['bytes']):,}")
        if size <= HASH_LIMIT and file_digest(path) != rec["sha256"]:
            raise ValueError(f"{name} does not match the SHA-256 meta.json records")


def _cache_fix(cache_root: Path) -> str:
    return (
        f"Choose a writable cache with paths.cache_dir=/writable/dir (or POSFORMER_CACHE=/writable/dir; "
        f"data.cache_dir for this dataset only), or make {str(cache_root)!r} writable"
    )


def cache_write_error(cache_root: Path, exc: OSError) -> Exception:
    """The one-line error of a failed cache write: a :class:`DataError` naming the path and the fix when
    the location is not writable; any other OS error unchanged (the error boundary names its path)."""
    if exc.errno not in WRITE_ERRNOS:
        return exc
    where = exc.filename if exc.filename is not None else cache_root
    return DataError(
        f"the data cache {str(cache_root)!r} cannot be written ({str(where)!r}: {exc.strerror}); the "
        f"tokenised data is cached there. {_cache_fix(cache_root)}."
    )


def check_cache_writable(cache_root: Path, folder: Path) -> None:
    """Before the data is read: the nearest existing ancestor of ``folder`` must be a writable
    directory (root passes every permission check; a read-only file system is found at the write)."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise DataError(
            f"the data cache {str(cache_root)!r} cannot be written ({str(probe)!r} is not writable); the "
            f"tokenised data is cached there. {_cache_fix(cache_root)}."
        )


#: errors on a cache file that mean "cannot read it", not "it is damaged": reported, never rebuilt
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.EMFILE)


def read_cache_file(path: Path, reader: Callable[[Path], T]) -> T | None:
    """``reader(path)``, or ``None`` when the file (or folder) is missing or corrupt (it fails to load:
    one warning line names it, and it is removed so that the caller rebuilds it). An unreadable file
    (permissions, a loop) is not corruption: its OS error propagates, for the error boundary to name."""
    if not path.exists():
        return None
    try:
        return reader(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load a cache file is corruption
        if isinstance(exc, OSError) and exc.errno in ACCESS_ERRNOS:
            raise
        problem = f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0][:200]
    log.warning("data cache file %s is corrupt (%s); removing it and rebuilding it", path, problem)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return None


def write_cache_file(cache_root: Path, path: Path, data: str | bytes) -> None:
    """Write a cache file atomically; a location that cannot be written is one :class:`DataError`
    naming ``cache_root`` and the fix (:func:`cache_write_error`)."""
    try:
        if isinstance(data, bytes):
            atomic_write_bytes(path, data)
        else:
            atomic_write_text(path, data)
    except OSError as exc:
        raise cache_write_error(cache_root, exc) from None


def drop_damaged_generator_cache(
    generator: Callable[..., Any],
    features: Any,
    gen_kwargs: dict[str, Any],
    cache_dir: str | None,
    exc: BaseException,
) -> None:
    """A split built by ``datasets.Dataset.from_generator`` whose HF cache failed to load: remove that
    split's cache folder (HF's builder names it from the generator and ``gen_kwargs``) with one warning
    line, so the next call generates it again (the examples are a function of the arguments: the same
    data). Re-raises ``exc`` when the folder holds no prepared split (the failure was not the cache's)."""
    from datasets.io.generator import GeneratorDatasetInputStream  # the builder from_generator makes

    stream = GeneratorDatasetInputStream(
        generator=generator, features=features, cache_dir=cache_dir, gen_kwargs=gen_kwargs
    )
    folder = Path(stream.builder.cache_dir)
    if not any(folder.glob("*.arrow")):
        raise exc
    warnings.warn(
        f"data cache {str(folder)!r} is damaged ({type(exc).__name__}: {str(exc)[:120]}); removing it and "
        "generating the split again.",
        stacklevel=3,
    )
    shutil.rmtree(folder, ignore_errors=True)
