"""The one number formatter and table writer: Markdown and CSV text, and rich tables on the console.

A table is rows (mappings, or a pandas ``DataFrame``) and ``(key, header)`` columns; a cell is a value
formatted by :func:`fmt` (floats with fixed decimals, ``None`` as ``–``) or a string made by the
caller. :func:`by_length` turns long rows (one per series and length) into the rows of a series ×
length table, the shape of every extrapolation table. JSON files are written by
:func:`posformer.io.atomic_write_json`.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from posformer.metrics import records

#: what an absent value prints as
MISSING = "–"
#: ``extra=`` of a log record for the run's log file only (the console filter of the command-line
#: mains, :mod:`posformer.cli.quiet`, drops it): e.g. the Markdown twin of a table printed with rich
FILE_ONLY = {"posformer_file_only": True}
#: Markdown alignment marks, and rich's justification, of ``l``/``c``/``r`` (``""``: no mark, left)
_MARKS = {"l": ":---", "c": ":---:", "r": "---:", "": "---"}
_JUSTIFY = {"l": "left", "c": "center", "r": "right", "": "left"}

Rows = Sequence[Mapping[str, Any]] | pd.DataFrame
Columns = Sequence[tuple[str, str]]


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


def fmt_spread(mean: float | None, std: float | None, digits: int = 3, n: int | None = None) -> str:
    """``mean ± std`` of a cell over seeds: the mean alone when the std is undefined (one value), ``n/a``
    without a mean; `` (n=k)`` when ``n`` is given."""
    if mean is None:
        return "n/a"
    spread = f" ± {fmt(std, digits)}" if std is not None else ""
    return fmt(mean, digits) + spread + (f" (n={n})" if n is not None else "")


def _records(rows: Rows) -> list[Mapping[str, Any]]:
    """``rows`` as mappings; a data frame's missing values (NaN) as ``None``."""
    return records(rows) if isinstance(rows, pd.DataFrame) else list(rows)


def cells(
    rows: Rows,
    columns: Columns,
    *,
    digits: Mapping[str, int] | None = None,
    cell_options: Mapping[str, Mapping[str, Any]] | None = None,
    **fmt_options: Any,
) -> list[list[str]]:
    """The table's cells as text: :func:`fmt` with ``digits`` per column (default 3), ``fmt_options``
    (``sci_from``, ``thousands``, ``missing``) for every cell and ``cell_options`` per column over them."""
    digits, cell_options = digits or {}, cell_options or {}
    options = {k: {**fmt_options, **cell_options.get(k, {})} for k, _ in columns}
    return [[fmt(r.get(k), digits.get(k, 3), **options[k]) for k, _ in columns] for r in _records(rows)]


def markdown_table(
    rows: Rows,
    columns: Columns,
    *,
    align: Mapping[str, str] | None = None,
    default_align: str = "r",
    blank: str = "  ",
    **cell_args: Any,
) -> str:
    """A Markdown table: ``columns`` are ``(key, header)`` pairs; numbers right-aligned by default.

    ``align`` gives per-column ``l``/``c``/``r`` (``""``: no alignment mark, ``---``), ``default_align``
    the other columns'; ``blank``: what an empty cell is between its bars; ``cell_args`` go to
    :func:`cells` (``digits``, ``cell_options``, ``sci_from``, ``thousands``, ``missing``).
    """
    align = align or {}

    def line(values: Sequence[str]) -> str:
        return "|" + "|".join(f" {v} " if v else blank for v in values) + "|"

    rule = "|" + "|".join(_MARKS[align.get(k, default_align)] for k, _ in columns) + "|"
    body = [line(c) for c in cells(rows, columns, **cell_args)]
    return "\n".join([line([h for _, h in columns]), rule, *body]) + "\n"


def csv_table(rows: Rows, fields: Sequence[str], *, lineterminator: str = "\n") -> str:
    """CSV text with a header row of ``fields``; keys not in ``fields`` are ignored, absent ones (and
    ``None``) empty. ``lineterminator``: ``"\\r\\n"`` for the :mod:`csv` module's default (RFC 4180)."""
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=list(fields), extrasaction="ignore", lineterminator=lineterminator
    )
    writer.writeheader()
    writer.writerows(_records(rows))
    return buf.getvalue()


def print_table(
    rows: Rows,
    columns: Columns,
    title: str = "",
    *,
    align: Mapping[str, str] | None = None,
    logger: logging.Logger | None = None,
    **cell_args: Any,
) -> str:
    """Print a table on the console with rich (cells never wrap) and return its Markdown.

    Arguments as :func:`markdown_table` (``align`` ``l``/``c``/``r``, numbers right by default).
    ``logger``: also log the Markdown there, for the log file only (:data:`FILE_ONLY`).
    """
    text = markdown_table(rows, columns, align=align, **cell_args)
    if logger is not None:
        logger.info("%s\n%s", title, text, extra=FILE_ONLY)
    align, body = align or {}, cells(rows, columns, **cell_args)
    table = Table()
    for key, header in columns:
        table.add_column(escape(header), justify=_JUSTIFY[align.get(key, "r")])
    for row in body:
        table.add_row(*map(escape, row))
    console = Console()
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, (_, h) in enumerate(columns)]
    console.width = max(console.width, sum(w + 3 for w in widths) + 1)  # no cell wraps
    if title:  # a line of its own: a rich title wraps at the table's width
        console.print(escape(title), style="bold")
    console.print(table)
    return text


def by_length(
    rows: Rows,
    cell: Callable[[Mapping[str, Any]], str],
    *,
    index: str = "series",
    header: str = "model",
    trained: Collection[Any] = (),
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The rows (one per ``index`` value, first-seen order) and columns (the sorted lengths, ``*`` on
    those in ``trained``) of a series × length table whose cells are ``cell(row)``; a (series, length)
    without a row has no cell (the writer's ``missing``), one with several rows the first one's."""
    rows = _records(rows)
    frame = pd.DataFrame({"key": [r[index] for r in rows], "length": [r["length"] for r in rows]})
    frame["cell"] = [cell(r) for r in rows]
    frame = frame.drop_duplicates(["key", "length"])
    wide = frame.pivot(index="key", columns="length", values="cell").reindex(frame["key"].unique())
    table = [
        {index: key, **{str(n): c for n, c in row.items() if isinstance(c, str)}}
        for key, row in wide.iterrows()
    ]
    lengths = sorted(wide.columns)
    return table, [(index, header), *((str(n), f"{n}*" if n in trained else str(n)) for n in lengths)]
