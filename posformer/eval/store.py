"""posformer-eval's output dir as a shared store: :class:`Results` (rows + metadata) loaded from and saved
to ``extrapolation.{json,csv,md}`` under the dir's lock, merged with what other evaluations wrote, and an
unreadable earlier file set aside.

Rows are plain dicts, one per (checkpoint x scaling x mode x length), keyed by
:meth:`posformer.eval.settings.Subject.key`; rows with status ``ok`` or ``n/a`` count as done (an
``oom`` row is retried). Every save writes the three files atomically (:mod:`posformer.io`,
:func:`~posformer.eval.results.write_results`), so an interrupted sweep leaves loadable files. An earlier
``extrapolation.json`` that cannot be read (malformed, truncated, not the results layout) is never
overwritten: :func:`set_aside_unreadable` renames it to ``extrapolation.json.corrupt-<time>`` and says so
in one line, and the sweep starts over.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posformer.errors import ResourceError
from posformer.eval.results import RESULTS_JSON, write_results
from posformer.io import hold_lock, release_lock

#: the lock file of an output dir: held while results are merged and written (:meth:`Results.save`)
LOCK_NAME = ".posformer-eval.lock"


#: how long a save waits for another evaluation's save (seconds): saves take well under a second, so a
#: lock held longer belongs to a stopped or hung process, named in the refusal
LOCK_WAIT = 120.0


@contextlib.contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """``flock`` on ``out_dir/.posformer-eval.lock`` for the duration (:func:`posformer.io.hold_lock`:
    waiting at most :data:`LOCK_WAIT` seconds, then refusing with the holder's pid, host, command and
    start). The kernel drops it when the process dies, so a killed evaluation never blocks the next one."""
    fd = hold_lock(
        out_dir / LOCK_NAME,
        wait=LOCK_WAIT,
        what="the output dir's lock file",
        busy=lambda holder: (
            f"eval.output_dir={out_dir} is locked by another evaluation ({holder}) for over {LOCK_WAIT:g} s "
            "(the limit; a save takes about a second), so that process is stopped or hung. Resume it "
            "(kill -CONT <pid>) or end it, or pass another eval.output_dir; this evaluation's rows were not "
            "saved there."
        ),
        fix="pass another eval.output_dir",
    )
    try:
        yield
    finally:
        release_lock(fd)


@dataclass
class Results:
    """Rows of results (one per checkpoint × scaling × mode × length) plus run metadata.

    Several evaluations may write into one output dir at once: :meth:`save` merges, under the dir's
    lock, the rows this process added (or dropped as stale) into what is on disk, so no row is lost.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    #: keys of the rows added by this process, and of the rows it dropped (stale): they win a merge
    own: set[str] = field(default_factory=set, repr=False)
    dropped: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def load(cls, out_dir: Path | str) -> Results:
        """The results saved in ``out_dir`` (empty when there are none, or when the file was unreadable
        and has been set aside by :func:`set_aside_unreadable`)."""
        path = Path(out_dir) / RESULTS_JSON
        if set_aside_unreadable(out_dir) or not path.exists():
            return cls()
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(rows=list(data["results"]), meta=dict(data.get("meta") or {}))

    def done_keys(self) -> set[str]:
        """Keys of the rows that need no re-run (status ``ok`` or ``n/a``)."""
        return {r["key"] for r in self.rows if r.get("status") in ("ok", "n/a")}

    def add(self, row: dict[str, Any]) -> None:
        """Add ``row``, replacing a row with the same key."""
        self.rows = [r for r in self.rows if r["key"] != row["key"]] + [row]
        self.own.add(row["key"])
        self.dropped.discard(row["key"])

    def drop_stale(self, current: set[tuple[str, str]]) -> int:
        """Drop the rows of the checkpoint paths in ``current`` recorded with another fingerprint.

        ``current``: ``(checkpoint path, fingerprint)`` of the files being evaluated. Returns the number
        of rows dropped.
        """
        paths = {c for c, _ in current}
        stale = [
            r["key"]
            for r in self.rows
            if r.get("checkpoint") in paths and (r["checkpoint"], r.get("fingerprint", "")) not in current
        ]
        self.rows = [r for r in self.rows if r["key"] not in set(stale)]
        self.dropped.update(stale)
        return len(stale)

    def merge_from(self, disk: Results) -> None:
        """Take the rows another evaluation wrote meanwhile: the disk's rows, with this process's own
        rows (and drops) over them; the evaluated sources and checkpoints are the union of both."""
        mine = {r["key"]: r for r in self.rows}
        merged = [mine.get(r["key"], r) if r["key"] in self.own else r for r in disk.rows]
        merged = [r for r in merged if r["key"] not in self.dropped]
        skip = {r["key"] for r in disk.rows} | self.dropped
        self.rows = merged + [r for r in self.rows if r["key"] not in skip]
        for key in ("sources", "checkpoints"):  # what both evaluations evaluate
            union = set(disk.meta.get(key) or []) | set(self.meta.get(key) or [])
            if union:
                self.meta[key] = sorted(union)

    def save(self, out_dir: Path | str) -> None:
        """Merge with what is on disk and write JSON, CSV and Markdown (atomically, under the lock)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        with locked(out_dir):
            path = out_dir / RESULTS_JSON
            if path.is_file() and not _problem(path):
                self.merge_from(Results.load(out_dir))
            write_results(out_dir, self.rows, self.meta)


def _problem(path: Path) -> str:
    """Why ``path`` is not a readable results file (``""``: it is)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    rows = data.get("results") if isinstance(data, dict) else None
    rows = rows if isinstance(rows, list) else [None]
    if not all(isinstance(r, dict) and isinstance(r.get("key"), str) for r in rows):
        return "not the results layout ({'meta': ..., 'results': [rows with a 'key']})"
    if not isinstance(data.get("meta", {}), dict):
        return "its 'meta' entry is not a mapping"
    return ""


def set_aside_unreadable(out_dir: Path | str) -> str:
    """Rename an unreadable ``extrapolation.json`` of ``out_dir`` to ``extrapolation.json.corrupt-<time>``
    and print one line saying so (stderr); returns that line, or ``""`` when the file is fine or absent."""
    path = Path(out_dir) / RESULTS_JSON
    if not path.is_file():
        return ""
    problem = _problem(path)
    if not problem:
        return ""
    aside = path.with_name(f"{RESULTS_JSON}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{RESULTS_JSON}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
    try:
        path.rename(aside)
    except OSError as exc:
        raise ResourceError(
            f"the earlier {path} is unreadable ({problem[:160]}) and cannot be moved aside ({exc.strerror}); "
            "move it away yourself or pass another eval.output_dir."
        ) from None
    line = (
        f"posformer-eval: warning: the earlier {path} is unreadable ({problem[:160]}); moved it to "
        f"{aside.name} and starting the results over (its rows will be evaluated again)."
    )
    print(line, file=sys.stderr)
    return line
