"""The metrics registry (what each metric is computed from, where it is shown), the one mean ± std over
seeds, and the table writer every results file and console table goes through."""

from __future__ import annotations

import math
import statistics

import pandas as pd
import pytest
import torch

from posformer import metrics
from posformer.metrics import REGISTRY, aggregate, headline, names, records, reduce, table_metrics
from posformer.utils.format import by_length, fmt_spread, markdown_table


# ------------------------------------------------------------------------------------------ registry
def test_every_list_of_metric_names_is_the_registry() -> None:
    """The results files, logs and figures of training, posformer-eval and the sweeps read their metric
    columns from the registry: a metric added there reaches all of them."""
    from posformer.eval import plots, results, seeds, sweep
    from posformer.eval import tasks as eval_tasks
    from posformer.lit import modules
    from posformer.lit import results as lit_results

    scored = {m.name for m in REGISTRY.values() if m.kind in ("task", "lm")}
    assert set(lit_results.EVAL_KEYS) == scored | {"n_sequences", "n_tokens"}
    assert lit_results.RESULT_COLUMNS[2:-1] == lit_results.EVAL_KEYS
    assert set(modules.VAL_METRICS) == scored
    assert {c for c in results.CSV_FIELDS if c in REGISTRY} == scored | {"n_sequences", "peak_mem_mb"}
    assert {c.rsplit("_", 1)[0] for c in seeds.CSV_FIELDS if c.endswith("_mean")} == scored
    assert {c.rsplit("_", 1)[0] for c in sweep.CSV_FIELDS if c.endswith("_mean")} == scored
    assert set(plots.SCALAR_METRICS) == scored | {"peak_mem_mb"}
    assert set(metrics.SUMS) == {s for m in REGISTRY.values() for s in m.sums}
    zeros = {k: torch.zeros((), dtype=torch.float64) for k in metrics.SUMS}
    assert list(eval_tasks.read_totals(zeros)) == list(metrics.SUMS)  # posformer-eval adds training's sums


def test_the_orders_of_the_files_and_tables() -> None:
    """Training's files lead with the task metrics, posformer-eval's with the language-model ones; a
    results table shows its task type's metrics first; an unknown task type is shown as a task."""
    assert names() == ["exact_match", "token_acc", "loss", "ppl"]
    assert names(lead="lm") == ["loss", "ppl", "exact_match", "token_acc"]
    assert table_metrics("task") == ["exact_match", "token_acc", "loss"]
    assert table_metrics("lm") == table_metrics("translation") == ["loss", "ppl", "token_acc"]
    assert table_metrics("classification") == table_metrics("task")
    assert headline("task").name == "exact_match" and headline("translation").name == "ppl"
    assert REGISTRY["ppl"].higher_is_better is False and REGISTRY["exact_match"].higher_is_better is True
    assert (
        REGISTRY["token_acc"].axis == "token accuracy (fraction of tokens)" and REGISTRY["token_acc"].fraction
    )


def test_reduce_divides_the_sums_and_leaves_nothing_scored_undefined() -> None:
    stats = {"loss_sum": 6.0, "n_tokens": 4.0, "n_correct_tokens": 3.0, "n_sequences": 2.0, "n_exact": 1.0}
    expected = {"exact_match": 0.5, "token_acc": 0.75, "loss": 1.5, "ppl": math.exp(1.5)}
    assert reduce(stats) == {**expected, "n_sequences": 2, "n_tokens": 4}
    empty = reduce(dict.fromkeys(metrics.SUMS, 0.0))
    assert all(math.isnan(empty[k]) for k in ("exact_match", "token_acc", "loss", "ppl"))
    assert reduce({"loss_sum": 2000.0, "n_tokens": 1.0})["ppl"] == math.exp(metrics.PPL_MAX_LOSS)
    assert set(reduce({"loss_sum": 2.0, "n_tokens": 1.0})) == {
        "loss",
        "ppl",
        "n_tokens",
    }  # what the sums give


def test_sequence_stats_counts_scored_tokens_and_exact_rows() -> None:
    logits = torch.full((2, 3, 4), -10.0)
    logits[0, :, 1] = 10.0  # row 0 predicts 1 everywhere
    logits[1, :, 2] = 10.0  # row 1 predicts 2 everywhere
    labels = torch.tensor([[1, 1, -100], [2, 3, -100]])
    stats = metrics.sequence_stats(logits, labels)
    values = {k: float(v) for k, v in stats.items()}
    assert values["n_tokens"] == 4 and values["n_correct_tokens"] == 3
    assert values["n_sequences"] == 2 and values["n_exact"] == 1 and values["loss_sum"] > 0
    assert all(v.dtype == torch.float64 for v in stats.values())


# ------------------------------------------------------------------------------------------ over seeds
def test_aggregate_mean_std_count_in_first_seen_group_order() -> None:
    values = [7.157497662356597, 3.6108976833344886, 7.513763114866316]  # pandas' own mean/std differ here
    rows = [{"g": "rope", "v": v} for v in values]
    rows += [{"g": "alibi", "v": 1.0}, {"g": "alibi", "v": None}, {"g": "nope", "v": float("nan")}]
    agg = records(aggregate(rows, ["g"], ["v"]))
    assert [a["g"] for a in agg] == ["rope", "alibi", "nope"]
    rope, alibi, nope = agg
    assert rope["v_mean"] == statistics.fmean(values) and rope["v_std"] == statistics.stdev(values)
    assert rope["v_n"] == 3
    assert alibi == {"g": "alibi", "v_mean": 1.0, "v_std": None, "v_n": 1}  # one value: std undefined, not 0
    assert nope["v_mean"] is None and nope["v_std"] is None and nope["v_n"] == 0  # did not run: no mean


def test_aggregate_extra_columns_and_absent_values() -> None:
    rows = [{"g": "a", "pe": "rope", "seed": 1}, {"g": "a", "pe": "rope", "seed": 0, "v": 2.0}]
    agg = records(aggregate(rows, ["g"], ["v", "w"], pe=("pe", metrics.first), seeds=("seed", sorted)))
    assert agg[0]["pe"] == "rope" and agg[0]["seeds"] == [0, 1]
    assert agg[0]["v_mean"] == 2.0 and agg[0]["w_mean"] is None and agg[0]["w_n"] == 0
    assert metrics.mean_std([1.0, None, 3.0])[0] == 2.0 and math.isnan(metrics.mean_std([4.0])[1])
    assert all(math.isnan(x) for x in metrics.mean_std([]))


def test_aggregate_sorts_within_the_first_seen_first_key() -> None:
    rows = [{"g": g, "L": n, "v": 1.0} for g, n in (("b", 16), ("a", 8), ("b", 8), ("a", 4))]
    agg = aggregate(rows, ["g", "L"], ["v"], sort_rest=True)
    assert list(zip(agg["g"], agg["L"])) == [("b", 8), ("b", 16), ("a", 4), ("a", 8)]
    assert list(aggregate(rows, ["g", "L"], ["v"])["L"]) == [16, 8, 8, 4]  # first-seen without it


# ------------------------------------------------------------------------------------------ tables
def test_by_length_rows_columns_and_markdown() -> None:
    rows = [
        {"series": "b", "length": 16, "in_distribution": False, "v": 2.0},
        {"series": "b", "length": 8, "in_distribution": True, "v": 1.0},
        {"series": "a", "length": 8, "in_distribution": True, "v": 3.0},
        {"series": "a", "length": 8, "in_distribution": True, "v": 9.0},  # a second row: the first counts
    ]
    table, columns = by_length(rows, lambda r: f"{r['v']:.1f}", trained={8})
    assert columns == [("series", "model"), ("8", "8*"), ("16", "16")]
    assert table == [{"series": "b", "8": "1.0", "16": "2.0"}, {"series": "a", "8": "3.0"}]
    text = markdown_table(table, columns, align={"series": "l"}, missing="")
    assert text.splitlines() == [
        "| model | 8* | 16 |",
        "|:---|---:|---:|",
        "| b | 1.0 | 2.0 |",
        "| a | 3.0 |  |",
    ]
    assert markdown_table(pd.DataFrame(table), columns, blank=" ", missing="").endswith("| a | 3.0 | |\n")


@pytest.mark.parametrize(
    ("mean", "std", "n", "cell"),
    [(1.23456, 0.1, 3, "1.235 ± 0.100 (n=3)"), (1.23456, None, 1, "1.235 (n=1)"), (None, None, 0, "n/a")],
)
def test_fmt_spread(mean, std, n, cell) -> None:
    assert fmt_spread(mean, std, 3, n, count=True) == cell
