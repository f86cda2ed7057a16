"""Safe file output: atomic writes, writable directories, the layout of a run dir, OS errors in one line.

Atomic writes
    :func:`atomic_write_bytes` / :func:`atomic_write_text` / :func:`atomic_write_json` /
    :func:`atomic_torch_save` write to a temporary file *in the destination directory*, ``fsync`` it,
    then ``os.replace`` it over the destination (atomic on POSIX and Windows within one file system)
    and ``fsync`` the directory. A crash, a kill or an exception at any point leaves either the old
    file or the new one, never a partial file; the temporary file is removed on errors (a SIGKILL can
    leave a ``.<name>.*.tmp`` file next to the destination, never a damaged destination;
    :func:`remove_stale_tmp` clears those). New files get the usual ``0o666 & ~umask`` mode; an
    existing file keeps its mode. A full disk (``ENOSPC``/``EDQUOT``) is a :class:`DiskFullError`
    naming the file, the bytes to write and the free space; the old file stays as it was.

Output directories
    :func:`check_writable_dir` proves a directory writable (a probe file) before any work starts;
    ``create=False`` creates nothing (a missing directory is judged by its nearest existing parent).

Run files that are written in place
    :func:`open_regular` opens a lock or owner file without following a symlink at that name
    (``O_NOFOLLOW``) and without waiting on a FIFO (``O_NONBLOCK``): a link or a special file there is
    refused in one line, so no write ever lands outside the run. :func:`hold_lock` takes an ``flock``
    on such a file and records who holds it (pid, host, command, since when); a lock still held after
    ``wait`` seconds (a stopped process keeps its lock) is refused with that record. A lock held for
    long work (building a data store) is kept fresh by its holder (:func:`keep_alive`: the file's
    mtime, every few seconds) and waited on while it is (``hold_lock(..., alive=True)``): only a holder
    silent for ``wait`` seconds, stopped or hung, is refused.

Checkpoints are read in :mod:`posformer.checkpoints` (``safe_load_checkpoint``); this module writes
them (:func:`atomic_torch_save`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import io
import json
import math
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from posformer.errors import ConfigError, ResourceError

__all__ = [
    "DiskFullError",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_layout",
    "check_writable_dir",
    "hold_lock",
    "json_safe",
    "open_regular",
    "os_error_message",
    "read_regular",
    "release_lock",
    "remove_stale_tmp",
]

#: names of the temporary files of :func:`_atomic_write` (``tempfile.mkstemp``: 8 random characters)
_TMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_DISK_FULL = {errno_: name for errno_, name in ((28, "ENOSPC"), (122, "EDQUOT"))}


class DiskFullError(ResourceError, OSError):
    """A write failed because the file system is full (or the quota is used up)."""

    def __init__(self, path: Path, exc: OSError, nbytes: int | None) -> None:
        free = _free_bytes(path.parent)
        need = f"{_size(nbytes)} to write, " if nbytes is not None else ""
        self.message = (
            f"cannot write {str(path)!r}: {exc.strerror or exc} ({need}{_size(free)} free on that file "
            "system); "
            "the earlier file is unchanged. Free space there, or write elsewhere (paths.log_dir=/other/disk "
            "or hydra.run.dir=/other/disk/run), then resume from the last checkpoint with ckpt_path=."
        )
        super().__init__(self.message)
        self.errno, self.strerror, self.filename = exc.errno, exc.strerror, str(path)

    def __str__(self) -> str:
        return self.message


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # pragma: no cover


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ atomic writes
def _umask() -> int:
    """The process umask, read without changing it where possible (``os.umask`` is process-wide,
    so the set-and-restore fallback is briefly racy with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(
    path: str | os.PathLike[str], write: Callable[[Any], None], nbytes: int | None = None
) -> Path:
    """Call ``write(binary_file)`` on a temp file next to ``path``, then replace ``path`` with it.

    A full disk is a :class:`DiskFullError` (``nbytes``: the size to write, for its message)."""
    path = Path(path)
    try:
        return _atomic_write_unchecked(path, write)
    except OSError as exc:
        if exc.errno in _DISK_FULL and not isinstance(exc, DiskFullError):
            raise DiskFullError(path, exc, nbytes) from None
        raise


def _atomic_write_unchecked(path: Path, write: Callable[[Any], None]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + fsync + os.replace)."""
    return _atomic_write(path, lambda f: f.write(data), nbytes=len(data))


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode(encoding))


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by ``None`` (strict JSON) and tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> Path:
    """Write ``obj`` as strict JSON (NaN/inf -> null) to ``path`` atomically.

    The object is serialised *before* the file is touched, so an unserialisable value leaves the
    old file as it was.
    """
    text = json.dumps(json_safe(obj), indent=indent, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (serialised in memory first, then written)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getbuffer())


def check_writable_dir(
    path: str | os.PathLike[str],
    what: str = "output directory",
    *,
    create: bool = True,
    fix: str = "hydra.run.dir=outputs/my_run (or paths.log_dir=/writable/dir)",
) -> Path:
    """Prove ``path`` is writable (a probe file, removed again); else a ConfigError naming ``fix``.

    ``create``: make the directory first; ``False``: create nothing, and judge a missing directory by
    its nearest existing parent (where it would be created). Called before training starts so that a
    bad output directory fails in a second, not after hours.
    """
    path = Path(path)
    probe_dir = path
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        else:
            while not probe_dir.exists() and probe_dir != probe_dir.parent:
                probe_dir = probe_dir.parent
            if not probe_dir.is_dir():
                raise NotADirectoryError(20, f"{probe_dir} is a file, not a directory")
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".posformer-write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{what} {str(path)!r} is not writable ({reason}); choose a writable location, e.g. {fix}."
        ) from None
    return path


def remove_stale_tmp(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the ``.<name>.XXXXXXXX.tmp`` files an atomic write killed half-way left under
    ``directory`` (recursively); returns them. Call it only while holding the directory's run lock."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = []
    for p in root.rglob(".*.tmp"):
        if _TMP_NAME.match(p.name) and p.is_file():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


# ------------------------------------------------------------------------------------------ files in place
def _not_regular(path: Path, what: str, fix: str) -> ConfigError:
    if path.is_symlink():
        found = f"a symlink (to {os.readlink(path)!r})"
        why = "run files are not written or read through links (one could reach a file outside the run)"
    else:
        found, why = "a special file (FIFO, socket or device), not a regular file", "it would hang or fail"
    return ConfigError(f"{what} {str(path)!r} is {found}; {why}. Remove it, or {fix}.")


def open_regular(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o644,
    *,
    what: str = "run file",
    fix: str = "give this run its own directory (hydra.run.dir=...)",
) -> int:
    """``os.open(path, flags)`` of a regular file only: a symlink at ``path`` is not followed and a FIFO
    is not waited on; either is a :class:`ConfigError` naming the path, what is there and ``fix``."""
    path = Path(path)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK) or path.is_symlink():
            raise _not_regular(path, what, fix) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path, what, fix)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], *, what: str = "run file", fix: str = "") -> str:
    """The text of the regular file ``path`` (:func:`open_regular`: not through a link, not a FIFO)."""
    fd = open_regular(path, what=what, fix=fix or "give this run its own directory (hydra.run.dir=...)")
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8")


def _holder() -> str:
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "?"
    since = _dt.datetime.now().isoformat(timespec="seconds")
    return f"pid {os.getpid()} on {socket.gethostname()}, command {command[:300]!r}, since {since}"


def hold_lock(
    path: str | os.PathLike[str],
    *,
    wait: float,
    what: str,
    busy: Callable[[str], str],
    fix: str,
    alive: bool = False,
) -> int:
    """``flock`` ``path`` (a regular file, :func:`open_regular`), waiting at most ``wait`` seconds
    (0: not at all), then record this process as the holder in it; returns the open descriptor (closing
    it drops the lock; the kernel drops it when the process dies). Still held after ``wait``: a
    :class:`ConfigError` with ``busy(<the holder's record>)``. ``alive``: wait as long as the holder
    keeps the file fresh (:func:`keep_alive`), refusing once it has been silent for ``wait`` seconds."""
    path = Path(path)
    fd = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644, what=what, fix=fix)
    deadline = time.monotonic() + max(wait, 0.0)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if alive:  # the holder's last sign of life, not this wait's start
                deadline = time.monotonic() + max(wait - (time.time() - os.fstat(fd).st_mtime), 0.0)
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 1024, 0).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                raise ConfigError(busy(holder)) from None
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
        except BaseException:
            os.close(fd)
            raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_holder() + "\n").encode(), 0)
    return fd


@contextlib.contextmanager
def keep_alive(fd: int, every: float) -> Iterator[None]:
    """While the body runs, touch the lock file ``fd`` every ``every`` seconds (its mtime: the holder's
    sign of life for :func:`hold_lock` ``alive=True`` waiters). A stopped process stops touching it."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            with contextlib.suppress(OSError):
                os.utime(fd)

    thread = threading.Thread(target=beat, name="posformer-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def release_lock(fd: int) -> None:
    """Clear the holder record and close ``fd`` (which drops the lock; the empty file stays: unlinking it
    would race with the next holder)."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


# ------------------------------------------------------------------------------------------ OS errors
#: errno -> what it means for a path, and the usual fix
_OS_FIXES: dict[int, tuple[str, str]] = {
    errno.EISDIR: ("is a directory where a file is expected", "move that directory away (or remove it)"),
    errno.ENOTDIR: (
        "has a file where a directory is expected",
        "move that file away (or remove it) so posformer can make the directory",
    ),
    errno.ELOOP: ("is a symlink loop", "fix the link (ls -l shows where it points) or give the real path"),
    errno.EROFS: ("is on a read-only file system", "choose a writable location"),
    errno.EACCES: ("is not accessible (permission denied)", "fix its permissions or use another location"),
    errno.EPERM: ("is not accessible (not permitted)", "fix its permissions or use another location"),
    errno.ENOENT: ("does not exist", "create it or correct the path"),
    errno.ENOTEMPTY: ("is a non-empty directory where a file is expected", "move that directory away"),
    errno.EEXIST: ("already exists and is in the way", "move it away"),
}


def os_error_message(exc: OSError) -> str:
    """One line for an operating-system error on a path: the path, what is wrong with it, the fix."""
    path = exc.filename if exc.filename is not None else ""
    what, fix = _OS_FIXES.get(exc.errno or -1, (exc.strerror or type(exc).__name__, "check that path"))
    if not path:
        return f"{exc.strerror or exc} ({type(exc).__name__}, errno {exc.errno}); {fix}."
    other = f" (and {str(exc.filename2)!r})" if exc.filename2 else ""
    return f"{str(path)!r}{other} {what} ({exc.strerror}); {fix}, or write elsewhere (hydra.run.dir=...)."


def check_layout(root: Path, files: Iterable[str], dirs: Iterable[str]) -> None:
    """Before the first write under ``root``: every path posformer writes as a file must not be a
    directory (and vice versa), and none may be a broken symlink or a loop. Raises a
    :class:`~posformer.errors.ConfigError` naming the first such path and the fix; creates nothing."""
    for name, want_dir in [*((f, False) for f in files), *((d, True) for d in dirs)]:
        path = root / name
        if path.is_symlink() and not path.exists():
            raise ConfigError(
                f"{str(path)!r} is a symlink that leads nowhere (a loop or a missing target); fix or remove "
                "the link, or give this run its own directory (hydra.run.dir=...)."
            )
        if not path.exists() or path.is_dir() == want_dir:
            continue
        found, wanted = ("a file", "a directory") if want_dir else ("a directory", "a file")
        raise ConfigError(
            f"{str(path)!r} is {found}, but posformer writes {wanted} there; move it away (or remove it), or "
            "give this run its own directory (leave hydra.run.dir unset)."
        )
