"""The benchmark's tables: one row per PE (``bench.md`` and the console), and the MFU table."""

from __future__ import annotations

from typing import Any

from posformer.bench.config import BASELINE_PE
from posformer.utils.format import markdown_table
from posformer.utils.format import print_table as print_rich

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


def _length_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _digits(key: str) -> int:
    """Decimals of a column: ratios and evaluation seconds 2, GFLOP/s 1, everything else (tok/s, MB) 0."""
    if key.startswith("ratio") or key == "gen_speedup" or (key.startswith("eval") and key.endswith("_s")):
        return 2
    return 1 if key.endswith("gflops") else 0


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


def _tables(results: dict) -> list[tuple[str, list[dict[str, Any]], Any, dict[str, Any]]]:
    """``(title, rows, columns, cell arguments)`` of the per-PE table and, if measured, the MFU table."""
    tables = [(f"posformer-bench ({results['meta']['machine']})", table_rows(results), columns(results))]
    if results.get("mfu"):
        title = "model FLOPs utilisation (training step vs the same-run matmul)"
        tables.append((title, _mfu_rows(results), _MFU_COLUMNS))
    return [(title, rows, cols, _cell_args(cols)) for title, rows, cols in tables]


def _cell_args(cols: Any) -> dict[str, Any]:
    """:func:`~posformer.utils.format.cells` arguments: :func:`_digits` decimals per column, fixed-point,
    absent values as ``-``, thousands separators in whole numbers."""
    options = {k: {"sci_from": None, "missing": "-", "thousands": _digits(k) == 0} for k, _ in cols}
    return {"digits": {k: _digits(k) for k, _ in cols}, "cell_options": options}


def render_markdown(results: dict) -> str:
    """``bench.md``: a title line, the per-PE table and, if measured, the MFU table."""
    title = f"posformer-bench, {results['meta']['date']}, {results['meta']['machine']}\n\n"
    return title + "\n".join(markdown_table(r, c, default_align="", **a) for _, r, c, a in _tables(results))


def print_table(results: dict) -> None:
    """The same tables on the console (rich, :func:`posformer.utils.format.print_table`)."""
    for title, rows, cols, args in _tables(results):
        print_rich(rows, cols, title, align={"pe": "l"}, **args)
