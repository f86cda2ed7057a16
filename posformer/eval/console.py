"""What ``posformer-eval`` prints: the extrapolation results as tables, one line per output path.

One table per task type (and LM scoring mode): a row per series (checkpoint × scaling), a column per
evaluated length (``*`` = in the training range), and in each cell the metric that means something
for the task type (:func:`posformer.metrics.headline`: exact match for synthetic tasks, perplexity
for language models). The same tables go, as Markdown, to the run's ``eval.log``; the full report
(both metrics, memory, reasons for ``n/a``) is ``extrapolation.md``. While it runs,
:class:`EvalProgress` shows a bar on a terminal and one line per finished row elsewhere.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from posformer.eval.results import RESULTS_JSON, RESULTS_MD, length_cells
from posformer.eval.seeds import aggregate_seeds, has_seeds, seed_sections, write_seed_summary
from posformer.eval.settings import MODES
from posformer.eval.store import Results
from posformer.metrics import headline
from posformer.utils.format import fmt, print_table

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
        for name, table, columns in seed_sections(agg):
            print_table(
                table, columns, f"{name} over seeds: mean ± std (n)", align={"group": "l"}, logger=log
            )
    figures = sorted(p.name for p in out_dir.glob("*.png"))
    log.info("results: %s (.json, .csv); over seeds: %s (.csv)", out_dir / RESULTS_MD, seeds_md.name)
    if figures:
        log.info("figures: %s in %s (and .svg where written)", ", ".join(figures), out_dir)


class EvalProgress:
    """Progress over the (subject, mode, length) rows and the batches of the current one.

    On a terminal: a rich bar. When stdout is not a terminal (a pipe, a file, a CI log): one plain line
    per finished row, printed (and flushed) as soon as the row is done, e.g.
    ``[3/12] rope · seed 0 nonoverlap length 256: ppl 7.95 (2048 tokens, 1.2 s)`` (:func:`row_line`).
    ``enabled=False`` (``eval.progress=false``) shows neither. ``terminal``: ``None`` asks
    ``sys.stdout.isatty()``.
    """

    def __init__(self, enabled: bool, total_pairs: int, *, terminal: bool | None = None):
        if terminal is None:
            isatty = getattr(sys.stdout, "isatty", None)
            terminal = bool(isatty()) if callable(isatty) else False
        self.enabled = enabled
        self.lines = enabled and not terminal
        self.total, self.done = total_pairs, 0
        self.bar = None
        if enabled and terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self.pairs = self.bar.add_task("lengths", total=total_pairs)
            self.batches = self.bar.add_task("batches", total=1)

    def __enter__(self) -> EvalProgress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start(self, desc: str, n_batches: int) -> None:
        if self.bar is not None:
            self.bar.reset(self.batches, total=max(n_batches, 1), description=desc)

    def batch(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.batches)

    def pair(self) -> None:
        """One more row counted (done now or earlier)."""
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.pairs)

    def skip(self, label: str, n: int) -> None:
        """``n`` rows of ``label`` already in the results: counted; one line when printing lines."""
        for _ in range(n):
            self.pair()
        if self.lines and n:
            line = f"{label}: {n} row(s) already in {RESULTS_JSON}, skipped"
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def row(self, row: dict[str, Any]) -> None:
        """A finished row: counted; its line printed when stdout is not a terminal."""
        self.pair()
        if self.lines:
            print(f"[{self.done}/{self.total}] {row_line(row)}", flush=True)


def row_line(row: dict[str, Any]) -> str:
    """One result row in a line: ``<series> [<LM mode>] length <n>: <main metric> (<tokens>, <time>)``.

    The metric is the one the tables show for the task type (perplexity for language models, exact
    match for tasks); a row that could not run says ``n/a`` and why.
    """
    lm = row.get("task_type") == "lm"
    where = f"{row['series']}{' ' + str(row['mode']) if lm else ''} length {row['length']}"
    main = headline("lm" if lm else "task")
    if row.get("status") == "ok":
        outcome = f"{main.header} {fmt(row.get(main.name), main.brief)}"
    else:
        reason = (str(row.get("reason") or "").strip().splitlines() or [""])[0][:160]
        outcome = f"{row.get('status', 'n/a')}" + (f" ({reason})" if reason else "")
    tokens = row.get("scored_tokens")
    details = [f"{tokens} tokens"] if tokens is not None and row.get("status") == "ok" else []
    details.append(f"{row.get('seconds', 0.0):.1f} s")
    return f"{where}: {outcome} ({', '.join(details)})"
