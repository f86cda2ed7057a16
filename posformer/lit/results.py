"""What a training run reports: the results files and the console summary (its loggers' hparams and the
sweeper's objective: :mod:`posformer.lit.loggers`).

One result row per evaluated length (``RESULT_COLUMNS``). :func:`write_results` writes
``results.json`` (strict JSON), ``results.csv`` and ``results.md`` atomically into the run directory;
:func:`report` prints the table and the output paths.

The JSON and CSV files hold every metric; the tables people read (``results.md``, the console) show
only the metrics that mean something for the run's task type (:func:`posformer.metrics.table_metrics`:
no exact match for language models, no perplexity for synthetic tasks).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posformer.metrics import REGISTRY, headline, names, table_metrics
from posformer.utils.format import FILE_ONLY, fmt, markdown_table, print_table, write_tables

log = logging.getLogger("posformer.cli.train")

#: the metrics of one evaluated length, as logged by the module's test step (``eval/len_<n>/<key>``)
EVAL_KEYS = tuple(names(kinds=("task", "lm", "count")))
#: the counts among them (integers)
COUNTS = tuple(names(kinds=("count",)))
#: the columns of ``results.csv`` (and the keys of a row of ``results.json``)
RESULT_COLUMNS = ("length", "in_distribution", *EVAL_KEYS, "note")
_HEADERS = {"length": "length", "in_distribution": "in-dist", "note": "note"}
_ALIGN = {"in_distribution": "c", "note": "l"}
_DIGITS = {k: REGISTRY[k].digits for k in EVAL_KEYS if k not in COUNTS}


def nan_row(length: int, in_distribution: bool) -> dict[str, Any]:
    """A result row for a length that was not evaluated: NaN metrics, zero counts."""
    metrics = {k: 0 if k in COUNTS else float("nan") for k in EVAL_KEYS}
    return {"length": length, "in_distribution": in_distribution, **metrics}


def table_columns(task_type: str, counts: str = "n_sequences") -> list[tuple[str, str]]:
    """``(key, header)`` of a results table: the metrics ``task_type``'s tables show
    (:func:`posformer.metrics.table_metrics`); ``counts``: the count column (``""``: none); the note."""
    keys = ["length", "in_distribution", *table_metrics(task_type), *([counts] if counts else []), "note"]
    return [(k, _HEADERS[k] if k in _HEADERS else REGISTRY[k].header) for k in keys]


def _table_rows(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> tuple[list, list]:
    """Rows with empty notes as ``""``, and ``columns`` without the note column when no row has one."""
    rows = [{**r, "note": r.get("note") or ""} for r in rows]
    if not any(r["note"] for r in rows):
        columns = [c for c in columns if c[0] != "note"]
    return rows, columns


# ------------------------------------------------------------------------------------------ files
def results_markdown(rows: list[dict[str, Any]], title: str = "", task_type: str = "task") -> str:
    """The results table in Markdown, with the columns of ``task_type`` (:func:`table_columns`)."""
    rows, columns = _table_rows(rows, table_columns(task_type))
    table = markdown_table(rows, columns, digits=_DIGITS, align=_ALIGN, sci_from=None, missing="")
    return (f"## {title}\n\n" if title else "") + table


def pe_label(results: dict[str, Any]) -> str:
    """The PE of a run for titles: its per-layer schedule where it has one (``rope×3+nope×1``, results
    key ``pe_schedule``), else ``pe``."""
    return str(results.get("pe_schedule") or results["pe"])


def _named(results: dict[str, Any], sep: str) -> str:
    """``variant=prope<sep>`` for a run with a variant (``+variant=prope``), else nothing."""
    return f"variant={results['variant']}{sep}" if results.get("variant") else ""


def write_results(out_dir: Path, results: dict[str, Any]) -> None:
    """``results.{json,csv,md}`` in ``out_dir``, each written atomically (:func:`write_tables`)."""
    title = (
        f"{results['task_name']}: {results['model_kind']}, {_named(results, ', ')}pe={pe_label(results)}, "
        f"seed={results['seed']}"
    )
    md = results_markdown(results["results"], title, (results.get("data") or {}).get("task_type", "task"))
    write_tables(out_dir, "results", results["results"], RESULT_COLUMNS, md, results)


# ------------------------------------------------------------------------------------------ console
def print_results(rows: list[dict[str, Any]], title: str, task_type: str = "task") -> None:
    """The results table on the console (and, as Markdown, in the run's log file)."""
    rows, columns = _table_rows(rows, table_columns(task_type, counts=""))
    print_table(rows, columns, title, digits=_DIGITS, align=_ALIGN, logger=log, sci_from=None, missing="")


def _in_multirun() -> bool:
    """A job of a Hydra multirun (its sweep prints one summary table for all jobs)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except ImportError:  # pragma: no cover
        return False


def report(trainer: Any, results: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> None:
    """The results table and the paths of the checkpoint, logs and result files, on stdout.

    In a multirun job they go to the job's log file only: the sweep's summary is the table to read.
    """
    quiet = _in_multirun()
    task_type = (results.get("data") or {}).get("task_type", "task")
    title = (
        f"{results['model_kind']} / {_named(results, ' / ')}pe={pe_label(results)} / "
        f"seed={results['seed']} — "
        f"trained on lengths <= {results['train_length']}"
    )
    if rows and quiet:
        log.info("%s", results_markdown(rows, title, task_type), extra=FILE_ONLY)
    elif rows:
        print_results(rows, title, task_type)
    tb = [lg.log_dir for lg in trainer.loggers if type(lg).__name__ == "TensorBoardLogger"]
    lines = [
        f"checkpoint : {results['checkpoint']['best'] or results['checkpoint']['last'] or 'none saved'}",
        f"tensorboard: {tb[0] if tb else 'disabled'}" + (f"  (tensorboard --logdir {out_dir})" if tb else ""),
        f"results    : {out_dir / 'results.md'} (.json, .csv)",
        f"wall time  : {results['wall_time_s']:.1f} s ({results['global_step']} steps)",
    ]
    for line in lines:
        log.info("%s", line, extra=FILE_ONLY)
        if not quiet:
            print(line, flush=True)
    final = final_line(results, rows)
    if final:  # in a multirun job too: the job's one number to read beside its progress lines
        log.info("%s", final, extra=FILE_ONLY)
        print(final, flush=True)


def final_line(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """``final      : prope · val ppl 7.853 (last validation) · ppl 7.834 at the training length 32 (best
    checkpoint)``: the headline metric of the last validation and of the final evaluation at the
    training length; empty when the run has neither."""
    main = headline((results.get("data") or {}).get("task_type", "task"))
    parts = []
    val = (results.get("val") or {}).get(f"val/{main.name}")
    if val is not None:
        parts.append(f"val {main.header} {fmt(val)} (last validation)")
    ind = [r for r in rows if r.get("in_distribution") and r.get(main.name) is not None]
    if ind:
        evaluated = (results.get("checkpoint") or {}).get("evaluated") or "final weights"
        weights = "final weights" if evaluated == "final weights" else f"checkpoint {Path(evaluated).name}"
        parts.append(f"{main.header} {fmt(ind[-1][main.name])} at length {ind[-1]['length']} ({weights})")
    who = results.get("variant") or pe_label(results)
    return f"final      : {who} · " + " · ".join(parts) if parts else ""
