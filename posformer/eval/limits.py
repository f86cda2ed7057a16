"""What ``posformer-eval`` refuses before any work: lengths past ``eval.max_length`` (with the memory and
compute one window of that length would need), and an output dir holding another evaluation's
finished results (:func:`check_owner`; resuming or extending the same evaluation is allowed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from posformer.errors import ConfigError
from posformer.eval.results import RESULTS_JSON
from posformer.utils.memory import window_cost_words


def check_max_length(
    lengths: Iterable[int], max_length: int | None, models: Callable[[], list[Mapping[str, Any]]]
) -> None:
    """Refuse a length above ``max_length`` (``None``: no limit) in one line naming what one window of
    it would cost for the largest of ``models()`` (saved model configs, read only then) and the fix."""
    longest = max(lengths, default=0)
    if max_length is None or longest <= max_length:
        return
    raise ConfigError(
        f"eval.lengths asks for length {longest}, above eval.max_length={max_length}: "
        f"{window_cost_words(longest, models() or [{}])}; evaluate shorter lengths, or raise "
        f"eval.max_length={longest} if you mean it."
    )


def _resolved(path: str | Path) -> str:
    return str(Path(path).expanduser().resolve())


def sources(ecfg: Mapping[str, Any]) -> list[str]:
    """What an evaluation evaluates, as recorded in ``extrapolation.json``'s ``meta.sources``: the
    resolved ``eval.checkpoints`` and ``eval.sweep_dir`` s (a sweep dir, not the files in it: its best
    checkpoints change name while its runs train on, and re-evaluating it is the same evaluation)."""
    items: list[str] = []
    for key in ("checkpoints", "sweep_dir"):
        value = ecfg.get(key) or []
        items += [_resolved(v) for v in ([value] if isinstance(value, str) else value)]
    return sorted(set(items))


def check_owner(out_dir: Path, mine: Iterable[str], checkpoints: Iterable[str | Path]) -> None:
    """Refuse to write into ``out_dir`` when it holds the *finished* results of another evaluation.

    ``mine``: this evaluation's :func:`sources`; ``checkpoints``: its checkpoint files (compared with
    the rows of a results file written before ``meta.sources`` was recorded). The same evaluation (a
    resume, more lengths or scalings) and an unfinished one (still running or interrupted: the merge
    under the lock keeps both) are allowed, and so is a part of the same evaluation.
    """
    path = Path(out_dir) / RESULTS_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        meta, rows = dict(data.get("meta") or {}), list(data["results"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return  # none, or unreadable (set aside by the caller)
    if not rows or not meta.get("finished", True):
        return
    if meta.get("sources"):
        theirs, ours = set(meta["sources"]), set(mine)
    else:
        theirs = {_resolved(r["checkpoint"]) for r in rows if r.get("checkpoint")}
        ours = {_resolved(p) for p in checkpoints}
    if not theirs or ours <= theirs:  # the same evaluation, or a part of it (its rows are already there)
        return
    names = ", ".join(sorted(theirs)[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
    raise ConfigError(
        f"eval.output_dir={out_dir} holds the finished evaluation of other checkpoints ({names}); this one "
        f"({', '.join(sorted(ours)[:3])}) would mix two studies in one results file. Pass another "
        "eval.output_dir, or the same eval.checkpoints / eval.sweep_dir to resume or extend that evaluation."
    )
