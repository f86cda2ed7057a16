"""The one table writer: results as rows or data frames, written as ``<stem>.{json,csv,md}`` and printed
with rich.

A table is rows (mappings, or a pandas ``DataFrame``) and ``(key, header)`` columns; a cell is a value
formatted by :func:`fmt` (floats with fixed decimals, ``None`` as ``–``) or a string made by the
caller. :func:`write_tables` writes a results file set (strict JSON, ``DataFrame.to_csv``, the Markdown
of :func:`markdown_table`); :func:`print_table` prints a table with rich. :func:`by_length` pivots long
rows (one per series and length) into a series × length table, the shape of every extrapolation table.
The Markdown writer is the project's own (a few lines, no padding), so committed tables stay stable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from posformer.io import atomic_write_json, atomic_write_text
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
Columns = Sequence[tuple[Any, str]]


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


def fmt_spread(
    mean: float | None,
    std: float | None,
    digits: int = 3,
    n: int | None = None,
    *,
    count: bool = False,
    sign: bool = False,
    sig_from: float = 1e4,
) -> str:
    """The one ``mean ± std`` cell over seeds: ``n/a`` without a mean (or values, ``n`` 0), ``–`` for a NaN
    mean, the mean alone when the std is undefined (one value); from ``sig_from`` on the mean in 3
    significant digits and the std in 2. ``count``: `` (n=k)`` after it; ``sign``: the mean's sign."""
    if mean is None or n == 0:
        return "n/a"
    if not math.isfinite(mean):
        return MISSING
    large = abs(mean) >= sig_from
    text = f"{mean:.3g}" if large else f"{mean:{'+' if sign else ''}.{digits}f}"
    if std is not None and not math.isnan(std) and n != 1:
        text += f" ± {std:.2g}" if large else f" ± {std:.{digits}f}"
    return text + (f" (n={n})" if count else "")


def _records(rows: Rows) -> list[Mapping[str, Any]]:
    """``rows`` as mappings; a data frame's missing values (NaN) as ``None``."""
    return records(rows) if isinstance(rows, pd.DataFrame) else list(rows)


def cells(
    rows: Rows,
    columns: Columns,
    *,
    digits: Mapping[Any, int] | None = None,
    cell_options: Mapping[Any, Mapping[str, Any]] | None = None,
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
    align: Mapping[Any, str] | None = None,
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
    """CSV text (``DataFrame.to_csv``) with a header row of ``fields``; other keys are ignored, absent
    ones (and ``None``) empty, NaN ``nan``. ``lineterminator``: ``"\\r\\n"`` for RFC 4180."""
    nan = [{k: "nan" if _isnan(r.get(k)) else r.get(k) for k in fields} for r in _records(rows)]
    frame = pd.DataFrame(nan, columns=list(fields), dtype=object)
    return frame.to_csv(index=False, lineterminator=lineterminator)


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def write_tables(
    out_dir: Path | str,
    stem: str,
    rows: Rows,
    fields: Sequence[str],
    markdown: str,
    document: Any = None,
    *,
    indent: int | None = 2,
    lineterminator: str = "\n",
) -> dict[str, Path]:
    """The one results writer: ``<stem>.json`` (``document`` as strict JSON, or as it is when text; none
    without one), ``<stem>.csv`` (:func:`csv_table` of ``rows``' ``fields``) and ``<stem>.md``
    (``markdown``) in ``out_dir``, each atomically; returns their paths by suffix."""
    out = Path(out_dir)
    paths = {}
    if isinstance(document, str):
        paths["json"] = atomic_write_text(out / f"{stem}.json", document)
    elif document is not None:
        paths["json"] = atomic_write_json(out / f"{stem}.json", document, indent=indent)
    csv = csv_table(rows, fields, lineterminator=lineterminator)
    paths["csv"] = atomic_write_text(out / f"{stem}.csv", csv)
    paths["md"] = atomic_write_text(out / f"{stem}.md", markdown)
    return paths


def print_table(
    rows: Rows,
    columns: Columns,
    title: str = "",
    *,
    align: Mapping[Any, str] | None = None,
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


def spread_table(
    agg: Rows, metric: str, digits: int = 3, count: bool = False
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The group × length table of ``metric`` over seeds (rows of :func:`posformer.metrics.aggregate` by
    ``group`` and ``length``, with ``in_distribution``): :func:`fmt_spread` cells, ``(n=k)`` with
    ``count`` (the rows' ``n``)."""
    rows = _records(agg)
    trained = {r["length"] for r in rows if r.get("in_distribution")}

    def cell(r: Mapping[str, Any]) -> str:
        return fmt_spread(r[f"{metric}_mean"], r[f"{metric}_std"], digits, r.get("n"), count=count)

    return by_length(rows, cell, index="group", trained=trained)


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
