"""How an LM uses its context past the training length L, from the loss at every window position.

The LM study's evaluations keep, for every non-overlapping window, the mean loss at each position
(``position_loss`` of a row, over ``n_sequences`` windows). :func:`window_curves` pools those of a
run's longest windows into one curve per run (seed); :func:`lm_context_use` reads the near (positions
[L/2, L)) and far (the window's last half) loss, their difference and the first break
(:func:`break_position`); :func:`position_lines` bins the curves for the leaderboard's figure.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from posformer.metrics import mean_std
from posformer.studies.aggregate import Key
from posformer.utils.figures import Line, binned_line

__all__ = ["break_position", "fmt_breaks", "lm_context_use", "position_lines", "rank_by", "window_curves"]


def window_curves(rows: list[dict[str, Any]], pe: str) -> list[list[float]]:
    """Per run (seed) of ``pe``: the mean loss at every position of that run's longest nonoverlap
    windows (rows of that length from both evaluations, weighted by their windows). Shorter windows
    are left out on purpose: they tile only the first ``n_tokens`` of the validation text, so pooling
    them in would measure the early positions on easier or harder text than the late ones."""
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["pe"] == pe and r["mode"] == "nonoverlap" and r.get("position_loss"):
            by_run[r["checkpoint"]].append(r)
    out = []
    for runs in by_run.values():
        size = max(len(r["position_loss"]) for r in runs)
        longest = [r for r in runs if len(r["position_loss"]) == size]
        total = [0.0] * size
        weight = sum(r["n_sequences"] for r in longest)
        for r in longest:
            for p, v in enumerate(r["position_loss"]):
                total[p] += r["n_sequences"] * v
        out.append([t / weight for t in total])
    return out


def break_position(curve: list[float], L: int, margin: float = 0.1, span: int = 64) -> int | None:
    """The first position ``p >= L`` (in steps of ``span // 8``) whose next ``span`` positions average
    more than ``margin`` nats above the loss at [L/2, L); ``None`` if no such stretch in ``curve``."""
    near = statistics.fmean(curve[L // 2 : L])
    for p in range(L, len(curve) - span + 1, max(span // 8, 1)):
        if statistics.fmean(curve[p : p + span]) > near + margin:
            return p
    return None


def lm_context_use(rows: list[dict[str, Any]], pes: list[str], L: int) -> dict[str, dict[str, Any]]:
    """Per PE, over seeds, from :func:`window_curves` (the same windows for every position): ``near`` =
    mean loss at positions [L/2, L), ``far`` = the last half of the window ([8L, 16L) for 16L windows),
    ``delta`` = far - near (< 0: the context past L helps; ~0: ignored without harm; > 0: it hurts),
    ``start`` = positions [0, 8) minus near (what the context within L is worth), each mean ± std;
    ``breaks`` = the :func:`break_position` of each seed."""
    out: dict[str, dict[str, Any]] = {}
    for pe in pes:
        vals: dict[str, list[float]] = defaultdict(list)
        breaks = []
        for c in window_curves(rows, pe):
            near, far = statistics.fmean(c[L // 2 : L]), statistics.fmean(c[len(c) // 2 :])
            vals["near"].append(near)
            vals["far"].append(far)
            vals["delta"].append(far - near)
            vals["start"].append(statistics.fmean(c[:8]) - near)
            breaks.append(break_position(c, L))
        out[pe] = {**{k: mean_std(v) for k, v in vals.items()}, "breaks": breaks}
    return out


def fmt_breaks(breaks: list[int | None], longest: int) -> str:
    """``breaks`` of the seeds as one cell: ``none`` when no seed breaks, else the seeds' positions
    (``>N`` for a seed that held to the window's end)."""
    if not breaks or all(b is None for b in breaks):
        return "none" if breaks else ""
    return "/".join(str(b) if b is not None else f">{longest}" for b in breaks)


def position_lines(rows: list[dict[str, Any]], pes: list[str], bins: int = 48) -> list[Line]:
    """Mean ± std over seeds of the loss per position (:func:`window_curves`), in log-spaced bins."""
    import numpy as np

    lines = []
    for pe, curves in ((pe, window_curves(rows, pe)) for pe in pes):
        if curves:
            edges = np.unique(np.geomspace(1, len(curves[0]), bins + 1).astype(int))
            edges[0] = 0
            mids = [(a + b - 1) / 2 + 1 for a, b in zip(edges[:-1], edges[1:], strict=True)]  # 1-based
            lines.append(binned_line(pe, pe, curves, edges, mids))
    return lines


def rank_by(agg: dict[Key, dict[str, Any]], pes: list[str], key: tuple) -> list[str]:
    """``pes`` by their mean at ``(pe, *key)``, lowest first; a PE without a value there (n/a: it
    cannot represent the length) after the others, in the given order."""

    def rank(pe: str) -> tuple[bool, float]:
        m = agg.get((pe, *key), {}).get("mean", math.nan)
        return (not math.isfinite(m), m if math.isfinite(m) else 0.0)

    return sorted(pes, key=rank)
