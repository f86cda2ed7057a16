#!/usr/bin/env python
"""Tables and figures of ``docs/leaderboard.md`` from the studies' outputs (``scripts/run_studies.sh``).

Reads what exists of ``outputs/studies/{lm_small, algorithmic_<task>_small, multi30k}`` and writes
``<figures>/leaderboard_*.{png,svg}`` (one colour per PE, the same in every figure:
:func:`posformer.eval.plots.pe_color`) and the Markdown tables to ``--tables`` (and stdout). A study
whose outputs are missing is skipped with a note.

    python scripts/leaderboard.py                       # figures into docs/figures
    python scripts/leaderboard.py --studies outputs/studies --figures /tmp/fig
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_algorithmic import ORDINARY_EVAL, reads_positions  # noqa: E402
from study_jobs import ROOT  # noqa: E402
from study_lm_extrapolation import ALL_PES, aggregate, fmt_cell, mean_std  # noqa: E402

from posformer.eval.plots import Line, draw_lines, length_axis, metric_axis, new_figure, save_figure  # noqa: E402


# ------------------------------------------------------------------------------------------ LM study
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
    for pe in pes:
        curves = window_curves(rows, pe)
        if not curves:
            continue
        y = np.asarray(curves, dtype=np.float64)  # (seeds, longest window)
        edges = np.unique(np.geomspace(1, y.shape[1], bins + 1).astype(int))
        edges[0] = 0
        mids = [(a + b - 1) / 2 + 1 for a, b in zip(edges[:-1], edges[1:], strict=True)]  # 1-based
        binned = np.stack([y[:, a:b].mean(1) for a, b in zip(edges[:-1], edges[1:], strict=True)], 1)
        std = binned.std(0, ddof=1) if len(curves) > 1 else np.zeros(binned.shape[1])
        lines.append(Line(pe, pe, mids, binned.mean(0).tolist(), std.tolist(), len(curves)))
    return lines


def rank_by(agg: dict[tuple, dict[str, Any]], pes: list[str], key: tuple) -> list[str]:
    """``pes`` by their mean at ``(pe, *key)``, lowest first; a PE without a value there (n/a: it
    cannot represent the length) after the others, in the given order."""

    def rank(pe: str) -> tuple[bool, float]:
        m = agg.get((pe, *key), {}).get("mean", math.nan)
        return (not math.isfinite(m), m if math.isfinite(m) else 0.0)

    return sorted(pes, key=rank)


def lm_section(study: Path, figures: Path, name: str = "lm") -> list[str]:
    """The LM table of ``study``; figures ``<figures>/leaderboard_<name>_*.{png,svg}``."""
    data = json.loads((study / "eval" / "extrapolation.json").read_text())["results"]
    pes = [p for p in ALL_PES if any(r["pe"] == p for r in data)]
    pes += sorted({r["pe"] for r in data} - set(pes))
    L = data[0]["train_len"]
    lengths = sorted({r["length"] for r in data})
    agg = aggregate(data, lambda r: r["pe"], "ppl")
    pos_file = study / "eval_positions" / "extrapolation.json"
    curves = json.loads(pos_file.read_text())["results"] if pos_file.is_file() else []
    windows = data + curves  # both evaluations' nonoverlap windows; the longest are used per run
    use = lm_context_use(windows, pes, L)
    n_seeds = max(a["n"] for a in agg.values())
    head = [
        "PE",
        *[f"{n // L}× ({n})" for n in lengths],
        f"sliding {lengths[-1] // L}×",
        "Δ far−near",
        "ctx gain",
        "+0.1 nats at",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for pe in rank_by(agg, pes, ("nonoverlap", lengths[-1])):
        cells = [fmt_cell(agg[(pe, "nonoverlap", n)]) for n in lengths]
        cells.append(fmt_cell(agg[(pe, "sliding", lengths[-1])]))
        u = use.get(pe, {})
        cells += [f"{u['delta'][0]:+.3f} ± {u['delta'][1]:.3f}" if "delta" in u else "",
                  f"{u['start'][0]:.2f}" if "start" in u else "",
                  fmt_breaks(u.get("breaks", []), lengths[-1])]  # fmt: skip
        lines.append(f"| {pe} | " + " | ".join(cells) + " |")
    for mode in ("nonoverlap", "sliding"):
        fig, ax = new_figure(f"char-LM perplexity, {mode} windows (trained at L={L}; {n_seeds} seeds)")
        series = []
        for pe in pes:
            pts = [(n, agg[(pe, mode, n)]) for n in lengths if agg.get((pe, mode, n), {}).get("n")]
            series.append(Line(pe, pe, [p[0] for p in pts], [p[1]["mean"] for p in pts],
                               [p[1]["std"] for p in pts], n_seeds))  # fmt: skip
        draw_lines(ax, series)
        length_axis(ax, lengths, [L])
        metric_axis(ax, "ppl")
        save_figure(fig, ax, figures / f"leaderboard_{name}_{mode}")
    fig, ax = new_figure(f"loss per position (trained at L={L}; the longest nonoverlap windows)")
    draw_lines(ax, position_lines(windows, pes), markers=False)
    ax.set_xscale("log", base=2)
    ax.axvline(L, color="grey", ls="--", lw=1, label=f"training length {L}")
    ax.set_xlabel("token position in the window, 1-based (log scale)")
    metric_axis(ax, "loss")
    save_figure(fig, ax, figures / f"leaderboard_{name}_position_loss")
    return lines


# ------------------------------------------------------------------------------------------ algorithmic
ALGO_COLUMNS = [
    "PE", "ID EM", "steps", "OOD EM", "OOD token acc",
    "+ randomized: ID EM", "steps", "OOD EM", "OOD token acc", "gain (tok acc, pp)",
    "ordinary eval: ID EM", "OOD token acc",
]  # fmt: skip
ALGO_GAIN_COLUMN = ALGO_COLUMNS.index("gain (tok acc, pp)")


def md_row(cells: list[str]) -> str:
    """One Markdown table row; an empty cell is written as a single space."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def algo_section(study: Path, figures: Path, task: str) -> list[str]:
    s = json.loads((study / "summary.json").read_text())
    ood = {tuple(k.split("|")): v for k, v in s["ood"].items()}
    pes = [p for p in ALL_PES if ("token_acc", p) in ood]
    threshold = s.get("id_threshold", 0.9)
    steps = s.get("steps", {})

    def id_cell(series: str) -> str:
        em = s["id_exact_match"][series]
        return f"{em:.2f}" + ("" if em >= threshold else " ✗")

    def steps_cell(series: str) -> str:
        return f"{steps[series]:.0f}" if series in steps else ""

    lines = [md_row(ALGO_COLUMNS), "|---|" + "---:|" * (len(ALGO_COLUMNS) - 1)]
    gains: list[float] = []
    both_ok: list[float] = []
    for pe in pes:
        rnd = f"{pe} + randomized"
        cells = [
            id_cell(pe),
            steps_cell(pe),
            fmt_cell(ood[("exact_match", pe)]),
            fmt_cell(ood[("token_acc", pe)]),
        ]
        if pe in s["gain_pp"]:
            g = s["gain_pp"][pe]["token_acc"]
            gains.append(g)
            if min(s["id_exact_match"][pe], s["id_exact_match"][rnd]) >= threshold:
                both_ok.append(g)
            cells += [id_cell(rnd), steps_cell(rnd), fmt_cell(ood[("exact_match", rnd)]),
                      fmt_cell(ood[("token_acc", rnd)]), f"{g:+.1f}"]  # fmt: skip
            plain_eval = rnd + ORDINARY_EVAL
            has = ("token_acc", plain_eval) in ood
            cells += [id_cell(plain_eval), fmt_cell(ood[("token_acc", plain_eval)])] if has else ["", ""]
        else:
            why = "not run yet" if reads_positions(pe) else "reads no positions"
            cells += ["–", "–", "–", "–", f"– ({why})", "–", "–"]
        lines.append(md_row([pe, *cells]))
    for label, g in (("every PE", gains), (f"both ID EM ≥ {threshold}", both_ok)):
        if g:
            row = [""] * len(ALGO_COLUMNS)
            row[0] = f"**mean gain, {label}** (n={len(g)})"
            row[ALGO_GAIN_COLUMN] = f"**{statistics.fmean(g):+.1f}**"
            lines.append(md_row(row))
    ordinary = s.get("gain_pp_ordinary_eval") or {}
    if ordinary:
        mean = statistics.fmean(v["token_acc"] for v in ordinary.values())
        lines.append(f"\nMean gain when the randomized runs are evaluated with ordinary positions: "
                     f"{mean:+.1f} pp token accuracy (n={len(ordinary)}).")  # fmt: skip
    lines.append(f"\n✗: in-distribution exact match below {threshold}; that row's OOD numbers do not count.")
    fig, ax = new_figure(f"{task}: OOD token accuracy (mean over OOD lengths; seeds: ± std)")
    import numpy as np

    from posformer.eval.plots import pe_color

    x = np.arange(len(pes))
    for i, pe in enumerate(pes):
        a = ood[("token_acc", pe)]
        ax.bar(i - 0.2, a["mean"], 0.38, yerr=a["std"], color=pe_color(pe), capsize=2)
        b = ood.get(("token_acc", f"{pe} + randomized"))
        if b:
            ax.bar(i + 0.2, b["mean"], 0.38, yerr=b["std"], color=pe_color(pe), alpha=0.45, hatch="//",
                   capsize=2)  # fmt: skip
    # legend keys: zero-height bars (an empty bar() has no patch, so its key loses colour and hatch)
    ax.bar([0], [0], color="grey", label="plain positions")
    ax.bar([0], [0], color="grey", alpha=0.45, hatch="//", label="randomized positions")
    ax.set_xticks(x, pes, rotation=45, ha="right")
    metric_axis(ax, "token_acc")
    save_figure(fig, ax, figures / f"leaderboard_algorithmic_{task}")
    return lines


# ------------------------------------------------------------------------------------------ Multi30k
def spread(mean: float, std: float, n: int) -> str:
    """``mean ± std``, or the bare mean for a single seed (whose std of 0 is no measurement)."""
    return f"{mean:.2f} ± {std:.2f}" if n > 1 else f"{mean:.2f}"


def multi30k_section(study: Path, figures: Path) -> list[str]:
    """BLEU and chrF mean ± std per PE, and each PE's BLEU difference from the first PE (the paper's
    sinusoidal) with its standard error sqrt(s1²/n1 + s2²/n2) (seeds are independent, not paired)."""
    s = json.loads((study / "summary.json").read_text())
    ref, ref_v = next(iter(s["summary"].items()))
    lines = [f"| PE | BLEU | chrF | seeds | BLEU − {ref} (± s.e.) |", "|---|---:|---:|---:|---:|"]
    for pe, v in s["summary"].items():
        diff = ""
        if pe != ref:
            diff = f"{v['bleu_mean'] - ref_v['bleu_mean']:+.2f}"
            if min(v["n"], ref_v["n"]) > 1:  # one seed has no spread: no error bar rather than ± 0
                se = math.sqrt(v["bleu_std"] ** 2 / v["n"] + ref_v["bleu_std"] ** 2 / ref_v["n"])
                diff += f" ± {se:.2f}"
        lines.append(f"| {pe} | {spread(v['bleu_mean'], v['bleu_std'], v['n'])} | "
                     f"{spread(v['chrf_mean'], v['chrf_std'], v['n'])} | {v['n']} | {diff} |")  # fmt: skip
    src = study / "summary_bleu.png"
    for ext in ("png", "svg"):
        (figures / f"leaderboard_multi30k.{ext}").write_bytes(src.with_suffix(f".{ext}").read_bytes())
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--studies", type=Path, default=ROOT / "outputs" / "studies")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    ap.add_argument("--tables", type=Path, default=None, help="default <studies>/leaderboard_tables.md")
    args = ap.parse_args()
    args.figures.mkdir(parents=True, exist_ok=True)
    parts: list[str] = []
    fire_l = args.studies / "lm_small_fire_threshold128"  # the FIRE threshold ablation of docs/leaderboard.md
    sections = [
        ("LM extrapolation (small)", args.studies / "lm_small" / "eval" / "extrapolation.json",
         lambda: lm_section(args.studies / "lm_small", args.figures)),
        ("LM ablation: FIRE with init_threshold = L (small)", fire_l / "eval" / "extrapolation.json",
         lambda: lm_section(fire_l, args.figures, "lm_fire_threshold128")),
        *[(f"Algorithmic: {t} (small)", args.studies / f"algorithmic_{t}_small" / "summary.json",
           lambda t=t: algo_section(args.studies / f"algorithmic_{t}_small", args.figures, t))
          for t in ("reverse", "sort")],
        ("Multi30k", args.studies / "multi30k" / "summary.json",
         lambda: multi30k_section(args.studies / "multi30k", args.figures)),
    ]  # fmt: skip
    for title, needed, build in sections:
        parts.append(f"## {title}\n")
        parts += [*build(), ""] if needed.is_file() else [f"(not run yet: no {needed})", ""]
    text = "\n".join(parts)
    out = args.tables or args.studies / "leaderboard_tables.md"
    out.write_text(text)
    print(text)
    print(f"written: {out}; figures in {args.figures}")


if __name__ == "__main__":
    main()
