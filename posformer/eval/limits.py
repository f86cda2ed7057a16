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

#: the compute rate the refusal's time estimate assumes (a few CPU cores; a GPU is 10-100x faster)
NOMINAL_FLOPS = 1e11


def window_cost(length: int, model: Mapping[str, Any]) -> tuple[float, float]:
    """``(bytes, FLOPs)`` of one forward window of ``length`` tokens through ``model`` (its saved
    config): fp32 logits and their cross-entropy plus one layer's activations; the projections and
    MLP of every layer plus causal attention (q·k and the weighted sum, half the square)."""
    d = int(model.get("d_model") or 512)
    ff = int(model.get("d_ff") or 4 * d)
    layers = int(model.get("n_layers") or model.get("n_decoder_layers") or 6)
    vocab = int(model.get("vocab_size") or 32000)
    memory = length * (8.0 * vocab + 4.0 * (ff + 4 * d))
    flops = 2.0 * length * layers * (4 * d * d + 2 * d * ff) + 2.0 * layers * float(length) ** 2 * d
    return memory, flops


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def check_max_length(
    lengths: Iterable[int], max_length: int | None, models: Callable[[], list[Mapping[str, Any]]]
) -> None:
    """Refuse a length above ``max_length`` (``None``: no limit) in one line naming what one window of
    it would cost for the largest of ``models()`` (saved model configs, read only then) and the fix."""
    longest = max(lengths, default=0)
    if max_length is None or longest <= max_length:
        return
    memory, flops = max((window_cost(longest, m) for m in models() or [{}]), key=lambda c: c[1])
    raise ConfigError(
        f"eval.lengths asks for length {longest}, above eval.max_length={max_length}: one window of "
        f"{longest} tokens needs ~{memory / 2**30:.1f} GiB (logits and activations) and ~{flops:.1e} FLOPs "
        f"(~{_duration(flops / NOMINAL_FLOPS)} at {NOMINAL_FLOPS / 1e9:.0f} GFLOP/s); evaluate shorter "
        f"lengths, or raise eval.max_length={longest} if you mean it."
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
