"""Tables and figures of ``docs/leaderboard.md`` from the studies' outputs or their committed records.

Reads what exists of ``<studies>/{algorithmic_<task>_small, multi30k}`` and the records of
``{lm_small, lm_small_fire_threshold128, indirect_index}``; writes ``<figures>/leaderboard_*.{png,svg}``
(one colour per PE, the same in every figure: :func:`posformer.utils.figures.pe_color`) and the
Markdown tables to ``--tables`` (and stdout). The LM sections are built from their records
(``<records>/<study>/``, else the study's own ``<studies>/<study>/records``); the algorithmic and
Multi30k sections from the study's ``summary.json`` when the study ran here, else from its records
(``<records>/<study>/``, the committed ``docs/studies/``); the indirect-indexing section (PoPE against
RoPE, next to the paper's numbers) from its records alone. A fresh clone rebuilds them byte for byte.
A study with neither is skipped with a note.

    posformer-study leaderboard                     # figures into docs/figures
    posformer-study leaderboard --studies outputs/studies --figures /tmp/fig
    python scripts/leaderboard.py                   # the same
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from posformer.studies import algorithmic_summary, lm, multi30k
from posformer.studies.aggregate import fmt_cell, record_cells
from posformer.studies.algorithmic_summary import ORDINARY_EVAL, mean_gains, reads_positions
from posformer.studies.common import all_pes, project_root
from posformer.studies.context_use import fmt_breaks, lm_context_use, position_lines, rank_by
from posformer.studies.figures import cell_lines, plot_bleu
from posformer.studies.ledger import read_records, recorded
from posformer.utils.figures import draw_lines, length_figure, metric_axis, new_figure, pe_color, save_figure
from posformer.utils.format import fmt_spread, markdown_table

__all__ = [
    "add_arguments",
    "algo_section",
    "build",
    "indirect_section",
    "lm_section",
    "multi30k_section",
    "run_study",
]

#: the algorithmic table's columns: plain runs, randomized-positions runs, randomized runs evaluated with
#: ordinary positions
ALGO_COLUMNS = [
    *("PE", "ID EM", "steps", "OOD EM", "OOD token acc"),
    *("+ randomized: ID EM", "steps", "OOD EM", "OOD token acc", "gain (tok acc, pp)"),
    *("ordinary eval: ID EM", "OOD token acc"),
]
ALGO_GAIN_COLUMN = ALGO_COLUMNS.index("gain (tok acc, pp)")
#: the LM sections: title, folder under the studies' outputs, name of their figures (the second: the FIRE
#: threshold ablation of docs/leaderboard.md)
LM_SECTIONS = [
    ("LM extrapolation (small)", "lm_small", "lm"),
    (
        "LM ablation: FIRE with init_threshold = L (small)",
        "lm_small_fire_threshold128",
        "lm_fire_threshold128",
    ),
]
#: the algorithmic tasks of the leaderboard
TASKS = ("reverse", "sort")
#: indirect indexing: the records' folder, and the paper's in-distribution exact match (%) per PE
#: (Gopalakrishnan et al. 2025, PoPE, Table 1)
INDIRECT = "indirect_index"
INDIRECT_PAPER = {"pope": 94.82, "rope": 11.16}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the leaderboard builder."""
    ap.add_argument(
        "--studies", type=Path, default=None, help="the studies' outputs (default outputs/studies)"
    )
    ap.add_argument("--figures", type=Path, default=None, help="default docs/figures")
    ap.add_argument("--tables", type=Path, default=None, help="default <studies>/leaderboard_tables.md")
    help_records = "the studies' committed records, read for a study without outputs (default docs/studies)"
    ap.add_argument("--records", type=Path, default=None, help=help_records)


# ------------------------------------------------------------------------------------------ LM study
def lm_section(records: dict[str, dict[str, Any]], figures: Path, name: str = "lm") -> list[str]:
    """The LM table of a ledger's ``records`` (:mod:`posformer.studies.lm`; ranked by perplexity at the
    longest length, with the context-use columns); figures ``<figures>/leaderboard_<name>_*.{png,svg}``."""
    pes = [p for p in all_pes() if any(r["pe"] == p for r in records.values())]
    pes += sorted({r["pe"] for r in records.values()} - set(pes))
    L = next(iter(records.values()))["train_len"]
    lengths = sorted({r["length"] for rec in records.values() for r in rec["rows"]})
    agg = record_cells(records, "pe", "ppl")
    windows = lm.record_rows(records)  # each run's loss per position over its longest windows
    use = lm_context_use(windows, pes, L)
    columns = [
        ("pe", "PE"),
        *((str(n), f"{n // L}× ({n})") for n in lengths),
        ("sliding", f"sliding {lengths[-1] // L}×"),
    ]
    columns += [("delta", "Δ far−near"), ("gain", "ctx gain"), ("breaks", "+0.1 nats at"), ("n", "n")]
    rows = []
    for pe in rank_by(agg, pes, ("nonoverlap", lengths[-1])):
        u = use.get(pe, {})
        n = sum(rec["pe"] == pe for rec in records.values())
        delta = {"mean": u["delta"][0], "std": u["delta"][1], "n": n} if "delta" in u else None
        rows.append(
            {
                "pe": pe,
                **{str(x): fmt_cell(agg[(pe, "nonoverlap", x)]) for x in lengths},
                "sliding": fmt_cell(agg[(pe, "sliding", lengths[-1])]),
                "delta": fmt_cell(delta, 3, sign=True) if delta else "",
                "gain": f"{u['start'][0]:.2f}" if "start" in u else "",
                "breaks": fmt_breaks(u.get("breaks", []), lengths[-1]),
                "n": str(n),
            }
        )
    lm_figures(agg, pes, lengths, L, windows, figures, name)
    return markdown_table(rows, columns, align={"pe": ""}).splitlines()


def lm_figures(
    agg: dict,
    pes: list[str],
    lengths: list[int],
    L: int,
    windows: list[dict[str, Any]],
    figures: Path,
    name: str,
) -> None:
    """Perplexity against length per mode, and the loss per position, of the LM study."""
    n_seeds = max(a["n"] for a in agg.values())
    low = min(a["n"] for a in agg.values() if a["n"])
    seeds = f"{n_seeds} seed{'s' * (n_seeds > 1)}" if low == n_seeds else f"{low}–{n_seeds} seeds per PE"
    for mode in ("nonoverlap", "sliding"):
        title = f"char-LM perplexity, {mode} windows (trained at L={L}; {seeds})"
        series = cell_lines(agg, pes, mode, lengths)  # the zoom panel parts the flat PEs near the lowest
        length_figure(figures / f"leaderboard_{name}_{mode}", title, series, "ppl", lengths, [L])
    fig, ax = new_figure(f"loss per position (trained at L={L}; the longest nonoverlap windows)")
    draw_lines(ax, position_lines(windows, pes), markers=False)
    ax.set_xscale("log", base=2)
    ax.axvline(L, color="grey", ls="--", lw=1, label=f"training length {L}")
    ax.set_xlabel("token position in the window, 1-based (log scale)")
    metric_axis(ax, "loss")
    save_figure(fig, ax, figures / f"leaderboard_{name}_position_loss")


# ------------------------------------------------------------------------------------------ algorithmic
def algo_section(source: Path, figures: Path, task: str) -> list[str]:
    """The algorithmic table and figure of ``source``: a study's ``summary.json``, else the records of a
    ledger alone (the study's defaults: every PE, the records' training lengths, the default
    in-distribution threshold)."""
    if (source / "summary.json").is_file():
        return algo_table(json.loads((source / "summary.json").read_text()), figures, task)
    records = read_records(source)
    hi = algorithmic_summary.train_range(records)[1]
    summary = algorithmic_summary.summarise(records, all_pes(), hi, algorithmic_summary.ID_THRESHOLD)
    return algo_table(algorithmic_summary.to_json(summary), figures, task)


def algo_table(s: dict[str, Any], figures: Path, task: str) -> list[str]:
    """One row per PE: plain and randomized runs side by side, the gain and the ordinary-eval columns;
    the mean gains; figure ``<figures>/leaderboard_algorithmic_<task>``. ``s``: a ``summary.json``."""
    ood = {tuple(k.split("|")): v for k, v in s["ood"].items()}
    pes = [p for p in all_pes() if ("token_acc", p) in ood]
    threshold = s.get("id_threshold", 0.9)
    steps = s.get("steps", {})

    def id_cell(series: str) -> str:
        em = s["id_exact_match"][series]
        return f"{em:.2f}" + ("" if em >= threshold else " ✗")

    def steps_cell(series: str) -> str:
        return f"{steps[series]:.0f}" if series in steps else ""

    rows: list[list[str]] = []
    for pe in pes:
        rnd = f"{pe} + randomized"
        cells = [
            id_cell(pe),
            steps_cell(pe),
            fmt_cell(ood[("exact_match", pe)]),
            fmt_cell(ood[("token_acc", pe)]),
        ]
        if pe in s["gain_pp"]:
            cells += [id_cell(rnd), steps_cell(rnd), fmt_cell(ood[("exact_match", rnd)])]
            cells += [fmt_cell(ood[("token_acc", rnd)]), f"{s['gain_pp'][pe]['token_acc']:+.1f}"]
            plain_eval = rnd + ORDINARY_EVAL
            has = ("token_acc", plain_eval) in ood
            cells += [id_cell(plain_eval), fmt_cell(ood[("token_acc", plain_eval)])] if has else ["", ""]
        else:
            why = "not run yet" if reads_positions(pe) else "reads no positions"
            cells += ["–", "–", "–", "–", f"– ({why})", "–", "–"]
        rows.append([pe, *cells])
    gains = {pe: s["gain_pp"][pe] for pe in pes if pe in s["gain_pp"]}
    for label, n, mean in mean_gains(gains, s["id_exact_match"], threshold):  # in the gain column
        row = [""] * len(ALGO_COLUMNS)
        row[0], row[ALGO_GAIN_COLUMN] = f"**mean gain, {label}** (n={n})", f"**{mean['token_acc']:+.1f}**"
        rows.append(row)
    algo_figure(ood, pes, figures / f"leaderboard_algorithmic_{task}", task)
    columns = list(enumerate(ALGO_COLUMNS))
    table = markdown_table([dict(enumerate(r)) for r in rows], columns, align={0: ""}, blank=" ")
    return [*table.splitlines(), *algo_notes(s, threshold)]


def algo_notes(s: dict[str, Any], threshold: float) -> list[str]:
    """The ordinary-eval mean gain and the ✗ note under the algorithmic table."""
    lines = []
    for _, n, mean in mean_gains(s.get("gain_pp_ordinary_eval") or {}):  # every PE
        lines.append(
            "\nMean gain when the randomized runs are evaluated with ordinary positions: "
            f"{mean['token_acc']:+.1f} pp token accuracy (n={n})."
        )
    lines.append(f"\n✗: in-distribution exact match below {threshold}; that row's OOD numbers do not count.")
    return lines


def algo_figure(ood: dict[tuple, dict[str, Any]], pes: list[str], path: Path, task: str) -> None:
    """OOD token accuracy per PE: plain bars and hatched randomized-positions bars, ± std over seeds."""
    import numpy as np

    fig, ax = new_figure(f"{task}: OOD token accuracy (mean over OOD lengths; seeds: ± std)")
    x = np.arange(len(pes))
    for i, pe in enumerate(pes):
        a = ood[("token_acc", pe)]
        ax.bar(
            i - 0.2, a["mean"], 0.38, yerr=a["std"] or 0.0, color=pe_color(pe), capsize=2
        )  # 1 seed: no bar
        b = ood.get(("token_acc", f"{pe} + randomized"))
        if b:
            style = {"color": pe_color(pe), "alpha": 0.45, "hatch": "//", "capsize": 2}
            ax.bar(i + 0.2, b["mean"], 0.38, yerr=b["std"] or 0.0, **style)
    # legend keys: zero-height bars (an empty bar() has no patch, so its key loses colour and hatch)
    ax.bar([0], [0], color="grey", label="plain positions")
    ax.bar([0], [0], color="grey", alpha=0.45, hatch="//", label="randomized positions")
    ax.set_xticks(x, pes, rotation=45, ha="right")
    metric_axis(ax, "token_acc")
    save_figure(fig, ax, path)


# ------------------------------------------------------------------------------------------ Multi30k
def multi30k_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    """BLEU and chrF mean ± std per PE, and each PE's BLEU difference from the first PE (the paper's
    sinusoidal) with its standard error sqrt(s1²/n1 + s2²/n2) (seeds are independent, not paired)."""
    ref, ref_v = next(iter(summary.items()))
    rows = []
    for pe, v in summary.items():
        diff = ""
        if pe != ref:
            diff = f"{v['bleu_mean'] - ref_v['bleu_mean']:+.2f}"
            if min(v["n"], ref_v["n"]) > 1:  # one seed has no spread: no error bar rather than ± 0
                se = math.sqrt(v["bleu_std"] ** 2 / v["n"] + ref_v["bleu_std"] ** 2 / ref_v["n"])
                diff += f" ± {se:.2f}"
        rows.append({"pe": pe, **multi30k.spreads(v), "n": v["n"], "diff": diff})
    columns = [
        ("pe", "PE"),
        ("bleu", "BLEU"),
        ("chrf", "chrF"),
        ("n", "seeds"),
        ("diff", f"BLEU − {ref} (± s.e.)"),
    ]
    return markdown_table(rows, columns, align={"pe": ""}).splitlines()


def multi30k_section(source: Path, figures: Path) -> list[str]:
    """The Multi30k table and BLEU figure of ``source``: a study's ``summary.json`` (its figure is copied),
    else the records of a ledger alone."""
    if not (source / "summary.json").is_file():
        rows, summary, steps = multi30k.records_summary(read_records(source))
        plot_bleu(rows, list(summary), figures / "leaderboard_multi30k.png", steps)
        return multi30k_table(summary)
    for ext in ("png", "svg"):
        (figures / f"leaderboard_multi30k.{ext}").write_bytes((source / f"summary_bleu.{ext}").read_bytes())
    return multi30k_table(json.loads((source / "summary.json").read_text())["summary"])


# ------------------------------------------------------------------------------------------ indirect indexing
def run_means(rows: list[dict[str, Any]], in_distribution: bool) -> float | None:
    """Mean exact match of one run's evaluated rows (ordinary positions) in, or out of, its training range;
    ``None`` without such rows."""
    ems = [
        r["exact_match"]
        for r in rows
        if r["mode"] == "task" and r["status"] == "ok" and bool(r["in_distribution"]) is in_distribution
    ]
    return sum(ems) / len(ems) if ems else None


def indirect_section(source: Path) -> list[str]:
    """The indirect-indexing table of a ledger's records: per PE, exact match (%) in the training range
    and beyond it (each run's mean over lengths, then mean ± std over seeds), the seeds, the paper's."""
    records = read_records(source)
    pes = [p for p in all_pes() if any(r["pe"] == p for r in records.values())]
    lengths = sorted({r["length"] for rec in records.values() for r in rec["rows"]})
    ids = [r["length"] for rec in records.values() for r in rec["rows"] if r["in_distribution"]]
    rows = []
    for pe in pes:
        runs = [rec["rows"] for rec in records.values() if rec["pe"] == pe]
        cells = {}
        for key, in_dist in (("id", True), ("ood", False)):
            vals = [100 * v for v in (run_means(r, in_dist) for r in runs) if v is not None]
            mean = sum(vals) / len(vals) if vals else None
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
            cells[key] = fmt_spread(mean, std, 2, len(vals))
        paper = INDIRECT_PAPER.get(pe)
        rows.append({"pe": pe, **cells, "n": str(len(runs)), "paper": f"{paper:.2f}" if paper else "–"})
    ood = [n for n in lengths if n > max(ids)]
    columns = [
        ("pe", "PE"),
        ("id", f"exact match %, lengths {min(ids)}–{max(ids)} (in distribution)"),
        ("ood", f"exact match %, lengths {', '.join(map(str, ood))}"),
        ("n", "seeds"),
        ("paper", "paper, in distribution (%)"),
    ]
    return markdown_table(rows, columns, align={"pe": ""}).splitlines()


# ------------------------------------------------------------------------------------------ the page
Builder = Callable[[], list[str]]


def sections(studies: Path, figures: Path, records: Path) -> list[tuple[str, Builder | None, str]]:
    """Every section of the page: its title, what builds it (``None``: nothing to build it from) and
    what is missing then. The LM sections read the committed records, else the study's own; the others
    the study's ``summary.json`` when it ran here, else its committed records."""
    out: list[tuple[str, Builder | None, str]] = []
    for title, folder, name in LM_SECTIONS:
        ledgers = [records / folder, studies / folder / "records"]
        ledger = next((d for d in ledgers if recorded(d)), None)
        build_lm = (lambda d=ledger, n=name: lm_section(read_records(d), figures, n)) if ledger else None
        out.append((title, build_lm, f"no records in {ledgers[0]} or {ledgers[1]}"))
    others = [
        (f"Algorithmic: {t} (small)", f"algorithmic_{t}_small", partial(algo_section, task=t)) for t in TASKS
    ]
    for title, folder, section in [*others, ("Multi30k", "multi30k", multi30k_section)]:
        study, ledger = studies / folder, records / folder
        source = study if (study / "summary.json").is_file() else ledger if recorded(ledger) else None
        build_it = partial(section, source, figures) if source else None
        out.append((title, build_it, f"no {study / 'summary.json'} and no records in {ledger}"))
    ledger = records / INDIRECT
    build_indirect = partial(indirect_section, ledger) if recorded(ledger) else None
    out.append(("Indirect indexing: PoPE and RoPE", build_indirect, f"no records in {ledger}"))
    return out


def build(studies: Path, figures: Path, records: Path) -> str:
    """The Markdown of every section (a note for those not run yet); writes the figures."""
    figures.mkdir(parents=True, exist_ok=True)
    parts: list[str] = []
    for title, build_section, missing in sections(studies, figures, records):
        parts.append(f"## {title}\n")
        parts += [*build_section(), ""] if build_section else [f"(not run yet: {missing})", ""]
    return "\n".join(parts)


def run_study(args: argparse.Namespace) -> None:
    """Build the page (see the module docstring), write the tables to ``--tables`` and print them."""
    root = project_root()
    studies = args.studies or root / "outputs" / "studies"
    figures = args.figures or root / "docs" / "figures"
    text = build(studies, figures, args.records or root / "docs" / "studies")
    out = args.tables or studies / "leaderboard_tables.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written: {out}; figures in {figures}")
