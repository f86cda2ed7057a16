"""Committed per-run records of the studies: what each finished run measured, small enough for git.

A study takes many working days of a 2-core CPU, and the machine of one day, with ``outputs/``, may not come
back (it did not once: 42 finished runs were lost with it). Every finished run therefore also leaves a
record in a *ledger*, a folder of one JSON file per run that is committed (``docs/studies/<study>/``
for the studies of ``docs/leaderboard.md``):

- the run's settings (PE, seed, the study's own keys), its steps and the wall time of every process
  invocation that trained it, the commit that trained it;
- its metrics (the evaluation rows of the algorithmic study, BLEU/chrF of Multi30k) — no weights.

The queue treats a recorded run as finished (:func:`recorded`), and each study builds its summary from
the records, so a study continues from a fresh clone and its tables can be rebuilt from the repository
alone. A record is written once, atomically, and never rewritten: delete it to train the run again.

    ledger = Path("docs/studies/algorithmic_reverse_small")
    write_record(ledger, "3_rope_s0", {"pe": "rope", "seed": 0, ...})
    records = read_records(ledger)          # run name -> record
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from posformer.io import atomic_write_json
from posformer.studies.common import CHECKOUT, StudyError

__all__ = [
    "FORMAT",
    "check_setup",
    "invocations",
    "read_records",
    "recorded",
    "run_index",
    "train_seconds",
    "write_record",
]

#: the record format this code writes and reads
FORMAT = 1


def record_path(ledger: Path, name: str) -> Path:
    """The file of run ``name``'s record."""
    return ledger / f"{name}.json"


def recorded(ledger: Path | None) -> set[str]:
    """Names of the runs that ``ledger`` holds a record of (empty without a ledger)."""
    if ledger is None or not ledger.is_dir():
        return set()
    return {p.stem for p in ledger.glob("*.json")}


def read_records(ledger: Path | None) -> dict[str, dict[str, Any]]:
    """Run name -> record, for every record in ``ledger`` (sorted by name); a file that is not a
    record of this format is a :class:`StudyError` naming it."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(recorded(ledger)):
        path = record_path(ledger, name)  # type: ignore[arg-type]
        try:
            rec = json.loads(path.read_text())
        except ValueError as e:
            raise StudyError(f"{path}: not valid JSON ({e}); delete it to re-run that run") from None
        if rec.get("format") != FORMAT:
            raise StudyError(f"{path}: record format {rec.get('format')!r}, this code reads {FORMAT}")
        out[name] = rec
    return out


def run_index(name: str) -> int:
    """The position of run ``name`` in its study's grid (the ``<i>_`` its name starts with; -1: none)."""
    m = re.match(r"(\d+)_", name)
    return int(m.group(1)) if m else -1


def check_setup(records: dict[str, dict[str, Any]], setup: list[str], ledger: Path, key: str) -> None:
    """Refuse a ledger whose records (their ``key`` field) were trained with other study settings than
    ``setup``: their numbers would be pooled with this call's in one table."""
    for name, rec in records.items():
        if rec.get(key) != setup:
            theirs, ours = set(rec.get(key) or []), set(setup)
            raise StudyError(
                f"{record_path(ledger, name)}: trained with other settings (only there: "
                f"{sorted(theirs - ours)}; only in this call: {sorted(ours - theirs)}); use another "
                "--ledger/--out for other settings"
            )


def write_record(ledger: Path, name: str, record: dict[str, Any]) -> Path:
    """Write the record of run ``name`` (adds the format, the time and the commit of the code)."""
    ledger.mkdir(parents=True, exist_ok=True)
    path = record_path(ledger, name)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    full = {"format": FORMAT, "run": name, **record, "recorded": stamp, "commit": git_commit()}
    atomic_write_json(path, full, indent=1)
    return path


def invocations(sweep_dir: Path, name: str) -> list[dict[str, Any]]:
    """The recorded process invocations of run ``name`` (``<sweep>/logs/<name>.jsonl``, see
    :func:`posformer.studies.jobs.record_invocation`); empty when the run has no log of its own."""
    path = sweep_dir / "logs" / f"{name}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_seconds(records: dict[str, dict[str, Any]]) -> tuple[float, int]:
    """Summed wall seconds of every training invocation of ``records`` and their count."""
    total, n = 0.0, 0
    for rec in records.values():
        for inv in rec.get("invocations", []):
            total += float(inv["seconds"])
            n += 1
    return total, n


def records_wall(records: dict[str, dict[str, Any]]) -> str:
    """The summed wall time of every training invocation of ``records``, as a sentence's end."""
    seconds, n = train_seconds(records)
    return f"{seconds:.0f} s summed over {n} process runs (one core each, run side by side)"


def git_commit() -> str:
    """HEAD of the checkout holding this code (``+dirty`` when tracked files of ``posformer/`` differ),
    or ``unknown`` outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "posformer"], cwd=CHECKOUT).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
