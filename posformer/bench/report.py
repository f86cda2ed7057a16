"""The benchmark's tables: one row per PE (``bench.md`` and the console), and the MFU table."""

from __future__ import annotations

from typing import Any

from posformer.bench.config import BASELINE_PE
from posformer.utils.format import fmt, markdown_table

#: cell options: fixed-point, absent values as ``-``; whole numbers get thousands separators (:func:`_cell`)
_CELL = {"sci_from": None, "missing": "-"}
_MFU_COLUMNS = (
    ("pe", "PE"),
    ("d_model", "d_model"),
    ("tok_s", "tok/s"),
    ("model_gflops", "model GFLOP/s"),
    ("matmul_gflops", "matmul GFLOP/s"),
    ("matmul_dtype", "matmul dtype"),
    ("mfu", "MFU"),
    ("attention_share", "attention FLOPs"),
)
_MFU_DIGITS = {"tok_s": 0, "model_gflops": 1, "matmul_gflops": 1}


def _length_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _digits(key: str) -> int:
    """Decimals of a column: ratios and evaluation seconds 2, everything else (tok/s, MB) 0."""
    if key.startswith("ratio") or key == "gen_speedup" or (key.startswith("eval") and key.endswith("_s")):
        return 2
    return 0


def _options(digits: int) -> dict[str, Any]:
    """:func:`fmt` options of a column with ``digits`` decimals."""
    return {**_CELL, "thousands": digits == 0}


def columns(results: dict) -> list[tuple[str, str]]:
    """(row key, header) of the table; one time column per evaluation length, memory for the longest."""
    lengths = results["config"]["eval_lengths"]
    docs = results["config"].get("documents", 1)  # packed documents per training sequence
    cols = [
        ("pe", "PE"),
        ("train_tok_s", "train tok/s" if docs == 1 else f"train tok/s ({docs} documents a row)"),
        ("train_peak_mb", "train MB"),
        ("xt_tok_s", "x-t tok/s"),
        ("ratio_xt", "vs x-t"),
        ("ratio_nope", f"vs {BASELINE_PE}"),
    ]
    if results["config"].get("before"):
        cols.append(("ratio_before", f"vs before ({'+'.join(results['config']['before'])})"))
    cols += [(f"eval_{_length_name(n)}_s", f"eval {_length_name(n)} s") for n in lengths]
    if lengths:
        cols.append((f"eval_{_length_name(max(lengths))}_mb", f"eval {_length_name(max(lengths))} MB"))
    cols += [
        ("gen_cached", "gen cached tok/s"),
        ("gen_uncached", "gen uncached tok/s"),
        ("gen_speedup", "cache x"),
    ]
    return cols


def table_rows(results: dict) -> list[dict[str, Any]]:
    rows = []
    for pe, r in results["pes"].items():
        tr, ev, gn = r.get("train", {}), r.get("eval", {}), r.get("gen", {})
        row: dict[str, Any] = {
            "pe": pe,
            "train_tok_s": tr.get("tok_s"),
            "train_peak_mb": tr.get("peak_mb"),
            "xt_tok_s": tr.get("xt_tok_s"),
            "ratio_xt": tr.get("ratio"),
            "ratio_nope": 1.0 if pe == BASELINE_PE and tr else tr.get("ratio_nope"),
            "ratio_before": tr.get("ratio_before"),
        }
        for length, e in ev.items():
            name = _length_name(int(length))
            row[f"eval_{name}_s"] = e.get("seconds", "OOM" if "error" in e else None)
            row[f"eval_{name}_mb"] = e.get("peak_mb")
        row["gen_cached"], row["gen_uncached"] = gn.get("cached_tok_s"), gn.get("uncached_tok_s")
        row["gen_speedup"] = gn.get("speedup")
        rows.append(row)
    return rows


def _mfu_rows(results: dict) -> list[dict[str, Any]]:
    """MFU table rows, the utilisation and the attention's share of the FLOPs as percentage strings."""
    rows = []
    for key, m in results.get("mfu", {}).items():
        share = m.get("attention_share")
        rows.append(
            {
                **m,
                "pe": m.get("pe", BASELINE_PE),
                "d_model": m.get("d_model", key),
                "mfu": f"{m['mfu']:.0%}",
                "attention_share": None if share is None else f"{share:.0%}",
            }
        )
    return rows


def render_markdown(results: dict) -> str:
    """``bench.md``: a title line, the per-PE table and, if measured, the MFU table."""
    cols = columns(results)
    digits = {k: _digits(k) for k, _ in cols}
    text = f"posformer-bench, {results['meta']['date']}, {results['meta']['machine']}\n\n"
    text += _markdown(table_rows(results), cols, digits)
    if results.get("mfu"):
        text += "\n" + _markdown(_mfu_rows(results), _MFU_COLUMNS, _MFU_DIGITS)
    return text


def _markdown(rows: list[dict[str, Any]], cols: Any, digits: dict[str, int]) -> str:
    options = {k: _options(digits.get(k, 0)) for k, _ in cols}
    return markdown_table(rows, cols, digits=digits, default_align="", cell_options=options)


def print_table(results: dict) -> None:
    """The same tables on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"posformer-bench ({results['meta']['machine']})")
    cols = columns(results)
    for _, h in cols:
        table.add_column(h, justify="right")
    for row in table_rows(results):
        table.add_row(*(fmt(row.get(k), _digits(k), **_options(_digits(k))) for k, _ in cols))
    console = Console()
    if not console.is_terminal:  # a log file: the whole table, never squeezed into 80 columns
        console.width = 240
    console.print(table)
    if results.get("mfu"):
        mt = Table(title="model FLOPs utilisation (training step vs the same-run matmul)")
        for _, h in _MFU_COLUMNS:
            mt.add_column(h, justify="right")
        for row in _mfu_rows(results):
            digits = [_MFU_DIGITS.get(k, 0) for k, _ in _MFU_COLUMNS]
            mt.add_row(*(fmt(row.get(k), n, **_options(n)) for (k, _), n in zip(_MFU_COLUMNS, digits)))
        console.print(mt)
