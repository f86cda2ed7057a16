"""The one number formatter and table writers shared by training, evaluation and the benchmark."""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

#: what an absent value prints as
MISSING = "–"
#: ``extra=`` of a log record for the run's log file only (the console filter of the command-line
#: mains, :mod:`posformer.cli.quiet`, drops it): e.g. the Markdown twin of a table printed with rich
FILE_ONLY = {"posformer_file_only": True}


def fmt(
    value: Any,
    digits: int = 3,
    *,
    sci_from: float | None = 1e4,
    thousands: bool = False,
    missing: str = MISSING,
) -> str:
    """A value for a table cell: floats with ``digits`` decimals (large ones in ``%g``), ``None`` as ``–``.

    ``nan``/``inf`` print as such; booleans as ``yes``/``no``; everything else with ``str``.
    ``sci_from``: floats at least this large print in ``%g`` (``None``: always fixed-point);
    ``thousands``: group the digits of floats and integers with ``,``; ``missing``: what ``None`` prints as.
    """
    if value is None:
        return missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    sep = "," if thousands else ""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if sci_from is None or abs(value) < sci_from:
            return f"{value:{sep}.{digits}f}"
        return f"{value:.{max(digits, 3)}g}"
    if thousands and isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    digits: Mapping[str, int] | None = None,
    align: Mapping[str, str] | None = None,
    default_align: str = "r",
    cell_options: Mapping[str, Mapping[str, Any]] | None = None,
    **fmt_options: Any,
) -> str:
    """A Markdown table: ``columns`` are ``(key, header)`` pairs; numbers right-aligned by default.

    ``digits`` gives per-column decimals (default 3); ``align`` per-column ``l``/``c``/``r`` (``""``: no
    alignment mark, ``---``), ``default_align`` for the other columns; ``fmt_options`` (``sci_from``,
    ``thousands``, ``missing``) go to :func:`fmt` for every cell, ``cell_options`` per column over them.
    """
    digits, align, cell_options = digits or {}, align or {}, cell_options or {}
    head = "| " + " | ".join(h for _, h in columns) + " |"
    marks = {"l": ":---", "c": ":---:", "r": "---:", "": "---"}
    rule = "|" + "|".join(marks[align.get(k, default_align)] for k, _ in columns) + "|"
    options = {k: {**fmt_options, **cell_options.get(k, {})} for k, _ in columns}
    body = [
        "| " + " | ".join(fmt(r.get(k), digits.get(k, 3), **options[k]) for k, _ in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body]) + "\n"


def csv_table(
    rows: Sequence[Mapping[str, Any]], fields: Sequence[str], *, lineterminator: str = "\n"
) -> str:
    """CSV text with a header row of ``fields``; keys not in ``fields`` are ignored, absent ones (and
    ``None``) empty. ``lineterminator``: ``"\\r\\n"`` for the :mod:`csv` module's default (RFC 4180)."""
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=list(fields), extrasaction="ignore", lineterminator=lineterminator
    )
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    title: str = "",
    *,
    digits: Mapping[str, int] | None = None,
    align: Mapping[str, str] | None = None,
    logger: logging.Logger | None = None,
    **fmt_options: Any,
) -> str:
    """Print a table on the console (``rich``; plain Markdown without it) and return its Markdown.

    Arguments as :func:`markdown_table` (``align`` ``l``/``c``/``r``, numbers right by default).
    ``logger``: also log the Markdown there, for the log file only (:data:`FILE_ONLY`).
    """
    text = markdown_table(rows, columns, digits=digits, align=align, **fmt_options)
    if logger is not None:
        logger.info("%s\n%s", title, text, extra=FILE_ONLY)
    try:
        from rich.console import Console
        from rich.table import Table
    except ModuleNotFoundError:  # pragma: no cover - rich is a dependency of the progress bar
        print((f"{title}\n\n" if title else "") + text, flush=True)
        return text
    from rich.markup import escape

    justify = {"l": "left", "c": "center", "r": "right", "": "left"}
    align, digits = align or {}, digits or {}
    table = Table()
    for key, header in columns:
        table.add_column(escape(header), justify=justify[align.get(key, "r")])
    for r in rows:
        table.add_row(*(escape(fmt(r.get(k), digits.get(k, 3), **fmt_options)) for k, _ in columns))
    console = Console()
    if title:  # a line of its own: a rich title wraps at the table's width
        console.print(escape(title), style="bold")
    console.print(table)
    return text
