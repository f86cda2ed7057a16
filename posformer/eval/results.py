"""Extrapolation results as tables: ``extrapolation.{json,csv,md}`` (:func:`write_results`; the output
dir's lock and merge are :mod:`posformer.eval.store`) and the Markdown report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posformer.eval.settings import MODES
from posformer.metrics import names
from posformer.utils.format import by_length, fmt, markdown_table, write_tables

RESULTS_JSON, RESULTS_CSV, RESULTS_MD = "extrapolation.json", "extrapolation.csv", "extrapolation.md"
_WHO = ("label", "checkpoint", "pe", "scaling", "task_type", "mode", "length", "stride", "train_len")
_COST = ("scored_tokens", "n_sequences", "peak_mem_mb", "peak_mem_delta_mb", "seconds", "reason")
#: the columns of ``extrapolation.csv`` (the JSON rows hold these and a few more, e.g. ``position_loss``)
CSV_FIELDS = (*_WHO, "in_distribution", "status", *names(lead="lm"), *_COST)


def write_results(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``extrapolation.{json,csv,md}`` in ``out_dir`` (the JSON keeps NaN; the CSV has RFC 4180 lines)."""
    text = json.dumps({"meta": meta, "results": rows}, indent=1)
    md = markdown_report(rows, meta)
    write_tables(out_dir, "extrapolation", rows, CSV_FIELDS, md, text, lineterminator="\r\n")


def series_labels(rows: list[dict[str, Any]]) -> list[str]:
    """The distinct ``series`` of ``rows`` in first-seen order."""
    return list(dict.fromkeys(r["series"] for r in rows))


def markdown_report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Markdown tables: one per (task type, mode, metric); rows = series, columns = lengths."""
    lines = ["# Length extrapolation", ""]
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lm_rows = [r for r in rows if r["task_type"] == "lm"]
    task_rows = [r for r in rows if r["task_type"] != "lm"]
    if lm_rows:
        toks = sorted({r["scored_tokens"] for r in lm_rows if r.get("scored_tokens")})
        lines += [
            f"Language modelling: perplexity (loss in nats) with the same number of scored tokens at every "
            f"length: {', '.join(map(str, toks)) or '–'}. `*` = training length; `n/a` = the PE cannot "
            "represent the length (reason below).",
            "",
        ]
        for mode in MODES:
            sub = [r for r in lm_rows if r["mode"] == mode]
            if sub:
                stride_note = ""
                if mode == "sliding":
                    strides = sorted({(r["length"], r["stride"]) for r in sub})
                    stride_note = " (stride: " + ", ".join(f"{s} @ {L}" for L, s in strides) + ")"
                lines += [f"## {mode}{stride_note}", "", length_table(sub, "ppl", "loss")]
    if task_rows:
        lines += ["Synthetic tasks: exact-match (token accuracy). `*` = in the training range.", ""]
        lines += ["## exact match", "", length_table(task_rows, "exact_match", "token_acc")]
    na = [r for r in rows if r["status"] != "ok"]
    if na:
        lines += ["## Not evaluated", ""]
        for status, reason in sorted({(r["status"], r["reason"]) for r in na}):
            match = [r for r in na if (r["status"], r["reason"]) == (status, reason)]
            who = sorted({r["series"] for r in match})
            lens = sorted({r["length"] for r in match})
            lines.append(f"- {', '.join(who)} at lengths {lens} ({status.replace('_', ' ')}): {reason}")
        lines.append("")
    mem = [r for r in rows if r.get("peak_mem_mb") is not None and r["status"] == "ok"]
    if mem:
        lines += ["## Peak memory (MiB; process peak / increase during the length)", ""]
        lines.append(length_table(mem, "peak_mem_mb", "peak_mem_delta_mb", digits=0))
    return "\n".join(lines)


def length_table(rows: list[dict[str, Any]], main: str, second: str = "", digits: int = 3) -> str:
    """One series × length table (and a blank line) of :func:`length_cells`."""
    return markdown_table(*length_cells(rows, main, second, digits), default_align="", missing="")


def length_cells(
    rows: list[dict[str, Any]], main: str, second: str = "", digits: int = 3
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The rows and columns of a series × length table (:func:`~posformer.utils.format.by_length`); a
    cell is ``main`` (``main (second)``), the status of a row that did not run, or empty. The header
    marks in-distribution lengths with ``*``; of several rows for a (series, length) pair, the first."""

    def cell(r: dict[str, Any]) -> str:
        if r["status"] != "ok":
            return str(r["status"] or "n/a").replace("_", " ")
        return fmt(r.get(main), digits) + (f" ({fmt(r.get(second), digits)})" if second else "")

    return by_length(rows, cell, trained={r["length"] for r in rows if r.get("in_distribution")})
