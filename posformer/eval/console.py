"""What ``posformer-eval`` prints: the extrapolation results as tables, one line per output path.

One table per task type (and LM scoring mode): a row per series (checkpoint × scaling), a column per
evaluated length (``*`` = in the training range), and in each cell the metric that means something
for the task type (:func:`posformer.metrics.headline`: exact match for synthetic tasks, perplexity
for language models). The same tables go, as Markdown, to the run's ``eval.log``; the full report
(both metrics, memory, reasons for ``n/a``) is ``extrapolation.md``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posformer.eval.results import RESULTS_MD, length_cells
from posformer.eval.seeds import aggregate_seeds, has_seeds, seed_sections, write_seed_summary
from posformer.eval.settings import MODES
from posformer.eval.store import Results
from posformer.metrics import headline
from posformer.utils.format import print_table, spread_table

log = logging.getLogger("posformer.eval")


def token_counts(rows: list[dict[str, Any]]) -> str:
    """The scored tokens of ``rows`` that ran: one number, ``a–b`` when they differ, ``""`` for none."""
    counts = sorted({int(r["scored_tokens"]) for r in rows if r["status"] == "ok" and r.get("scored_tokens")})
    if not counts:
        return ""
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def length_rows(rows: list[dict[str, Any]], metric: str, digits: int) -> tuple[list[dict], list]:
    """Table rows (one per series) and ``(key, header)`` columns (one per length) of ``metric``
    (:func:`~posformer.eval.results.length_cells`), then the scored tokens of the series (``tokens``)."""
    table, columns = length_cells(rows, metric, digits=digits)
    for t in table:
        t["tokens"] = token_counts([r for r in rows if r["series"] == t["series"]])
    return table, [*columns, ("tokens", "scored tokens")]


def print_results(results: Results, out_dir: Path | str) -> None:
    """The tables of ``results`` (see the module docstring), then the paths of the output files."""
    out_dir = Path(out_dir)
    for task_type in ("task", "lm"):
        main = headline(task_type)
        rows = [r for r in results.rows if (r["task_type"] == "lm") == (task_type == "lm")]
        for mode in MODES if task_type == "lm" else (None,):
            sub = [r for r in rows if mode is None or r["mode"] == mode]
            if not sub:
                continue
            table, columns = length_rows(sub, main.name, main.brief)
            title = f"{main.title}{f' ({mode} windows)' if mode else ''} by length (* = trained)"
            print_table(table, columns, title, align={"series": "l"}, logger=log)
    agg = aggregate_seeds(results.rows)
    seeds_md = write_seed_summary(agg, out_dir)
    if has_seeds(agg):  # a seed sweep: its mean ± std (n) per model, as the training sweep summary
        for name, rows, metric, digits in seed_sections(agg):
            table, columns = spread_table(rows, metric, digits, count=True)
            print_table(
                table, columns, f"{name} over seeds: mean ± std (n)", align={"group": "l"}, logger=log
            )
    figures = sorted(p.name for p in out_dir.glob("*.png"))
    log.info("results: %s (.json, .csv); over seeds: %s (.csv)", out_dir / RESULTS_MD, seeds_md.name)
    if figures:
        log.info("figures: %s in %s (and .svg where written)", ", ".join(figures), out_dir)
