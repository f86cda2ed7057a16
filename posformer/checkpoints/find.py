"""Finding checkpoints: one per run of a sweep, a run's best or last, the last N of a directory.

A path recorded inside a checkpoint (``ModelCheckpoint``'s ``best_model_path``) is data and may point
anywhere: only its file name is used, next to the checkpoint that recorded it.
"""

from __future__ import annotations

import re
from pathlib import Path

from posformer.checkpoints.read import checkpoint_step, safe_load_checkpoint
from posformer.errors import CheckpointError, ConfigError

__all__ = ["find_checkpoints", "last_checkpoints", "pick_run_checkpoint", "recorded_best"]


def find_checkpoints(sweep_dir: Path | str, which: str = "best") -> list[Path]:
    """One checkpoint per run under ``sweep_dir`` (found by globbing ``**/checkpoints/*.ckpt``).

    ``which="last"``: each run's ``last.ckpt`` (or its newest file); ``"best"``: the best model path
    recorded by Lightning's ``ModelCheckpoint`` in the run's checkpoints, if that file exists, else the
    newest non-``last`` checkpoint, else ``last.ckpt``.
    """
    if which not in ("best", "last"):
        raise ConfigError(f"eval.which={which!r}; valid: best, last.")
    root = Path(sweep_dir)
    if not root.is_dir():
        raise CheckpointError(f"eval.sweep_dir={str(root)!r} is not a directory.")
    runs: dict[Path, list[Path]] = {}
    for path in sorted(root.glob("**/checkpoints/*.ckpt")):
        runs.setdefault(path.parent, []).append(path)
    if not runs:
        raise CheckpointError(f"no checkpoints (**/checkpoints/*.ckpt) under eval.sweep_dir={str(root)!r}.")
    chosen = []
    for files in runs.values():
        last = [f for f in files if f.name.startswith("last")]
        others = sorted((f for f in files if not f.name.startswith("last")), key=lambda f: f.stat().st_mtime)
        if which == "last":
            chosen.append(last[0] if last else max(files, key=lambda f: f.stat().st_mtime))
            continue
        best = recorded_best(last[0] if last else others[-1])
        if best is not None and best.exists():
            chosen.append(best)
        else:
            chosen.append(others[-1] if others else last[0])
    return chosen


def recorded_best(path: Path) -> Path | None:
    """The file name of the ``best_model_path`` that ``ModelCheckpoint`` recorded in checkpoint ``path``,
    in ``path``'s directory (never elsewhere); ``None`` if unreadable or absent."""
    try:
        ckpt = safe_load_checkpoint(path, verify=False)  # weights_only=True: never runs code
    except Exception:
        return None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if "ModelCheckpoint" in str(key) and isinstance(state, dict) and state.get("best_model_path"):
            # only ever a file next to `path`: a recorded path is data and may point anywhere
            return path.parent / Path(str(state["best_model_path"])).name
    return None


def pick_run_checkpoint(run_dir: Path, which: str) -> Path:
    """The checkpoint of one training run: ``last`` -> ``checkpoints/last.ckpt`` if present; else (and
    for ``best``) the lowest ``val_loss<x>`` in the file names, else the last file by name."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise CheckpointError(
            f"{str(run_dir)!r} has no checkpoints/ directory; pass eval.checkpoint=<.ckpt>."
        )
    if which == "last" and (ckpt_dir / "last.ckpt").is_file():
        return ckpt_dir / "last.ckpt"
    scored = []
    for f in ckpt_dir.glob("*.ckpt"):
        m = re.search(r"val_loss([0-9.]+?)\.ckpt$", f.name)
        if m:
            scored.append((float(m.group(1)), f))
    if scored:
        return min(scored)[1]
    files = sorted(ckpt_dir.rglob("*.ckpt"))
    if not files:
        raise CheckpointError(f"no .ckpt files under {str(ckpt_dir)!r}.")
    return files[-1]


def last_checkpoints(directory: str | Path, n: int, up_to_step: int | None = None) -> list[Path]:
    """The ``n`` checkpoints of ``directory`` (recursively) with the highest training step, oldest first.

    ``last.ckpt`` (Lightning's copy of the newest checkpoint) is skipped when other checkpoints
    exist, and so is any checkpoint whose step another one already has. ``up_to_step``: only
    checkpoints at or before that step (to compare runs at an equal number of updates).
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist.")
    if n < 1:
        raise CheckpointError(f"average the last n={n} checkpoints: n must be >= 1.")
    files = sorted(d.rglob("*.ckpt"))
    named = [f for f in files if not f.name.startswith("last")] or files
    by_step: dict[int, Path] = {}
    for f in named:
        by_step.setdefault(checkpoint_step(f), f)
    if not by_step:
        raise CheckpointError(f"no .ckpt files under {str(d)!r}.")
    steps = sorted(by_step)
    if up_to_step is not None:
        steps = [s for s in steps if s <= up_to_step]
    if len(steps) < n:
        where = f" at or before step {up_to_step}" if up_to_step is not None else ""
        raise CheckpointError(
            f"asked to average the last {n} checkpoints{where}, but {str(d)!r} holds {len(steps)} distinct "
            f"ones (steps {sorted(by_step)}); lower the count or save more often "
            "(callbacks.periodic_checkpoint)."
        )
    return [by_step[s] for s in steps[-n:]]
