"""A named variant is the label of its runs: sweep job labels and groups, the summary table and figure
(a colour of its own per variant; runs without one keep their PE's), and EvalResult.aggregate() over
seeds (posformer.api). No training here: results files and rows written by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from posformer.api import EvalResult, run_dir_labels
from posformer.eval.sweep import aggregate as sweep_aggregate
from posformer.eval.sweep import collect
from posformer.eval.sweep_jobs import job_label, load_jobs
from posformer.utils.figures import Line, mean_lines, pe_color, pe_marker, variant_styles


def test_job_label_names_the_variant_in_place_of_the_pe():
    swept = ["pe", "variant", "seed"]
    assert job_label(["pe=rope", "+variant=prope", "seed=1"], swept, "rope", "prope") == "prope · seed 1"
    assert job_label(
        ["+variant=irope", "model.d_model=32"], ["variant", "model.d_model"], "rope", "irope"
    ) == ("irope · d_model 32")
    assert job_label(["pe=rope", "seed=1"], ["pe", "seed"], "rope") == "rope · seed 1"  # as before


def _line(label: str, pe: str, variant: str | None = None) -> Line:
    return Line(label, pe, [32.0, 64.0], [2.0, 3.0], variant=variant)


def test_every_variant_gets_its_own_colour_and_marker():
    lines = [_line("rope", "rope", "rope"), _line("prope", "rope", "prope"), _line("irope", "rope", "irope")]
    lines.append(_line("alibi", "alibi", "alibi"))
    styles = variant_styles(lines)
    assert len({c for c, _ in styles.values()}) == 4 and len({m for _, m in styles.values()}) == 4
    # a variant named as a PE keeps that PE's style; the others take styles no line has
    assert styles["rope"] == (pe_color("rope"), pe_marker("rope"))
    assert styles["alibi"] == (pe_color("alibi"), pe_marker("alibi"))
    # beside a plain PE line (no variant), which keeps its colour, no variant takes that colour
    mixed = variant_styles(
        [_line("alibi", "alibi"), _line("my", "alibi", "my"), _line("alibi2", "rope", "alibi")]
    )
    assert pe_color("alibi") not in {c for c, _ in mixed.values()} and len(mixed) == 2
    assert variant_styles([_line("rope", "rope")]) == {}


def test_mean_lines_carry_the_variant():
    agg = pd.DataFrame(
        [
            {
                "group": g,
                "pe": "rope",
                "variant": v,
                "length": 32,
                "ppl_mean": 2.0,
                "ppl_std": None,
                "ppl_n": 1,
            }
            for g, v in (("prope", "prope"), ("rope", None))
        ]
    )
    assert [line.variant for line in mean_lines(agg, "ppl")] == ["prope", None]


def _job(sweep: Path, num: int, variant: str, seed: int, ppl: float) -> None:
    job = sweep / f"{num}_variant-{variant}_seed-{seed}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- +variant={variant}\n- seed={seed}\n")
    rows = [
        {"length": L, "in_distribution": L == 32, "loss": math.log(ppl * k), "ppl": ppl * k, "n_sequences": 4}
        for L, k in ((32, 1.0), (64, 1.5))
    ]
    results = {"pe": "rope", "variant": variant, "seed": seed, "train_length": 32, "results": rows}
    results["data"] = {"task_type": "lm"}
    (job / "results.json").write_text(json.dumps(results))


def test_a_variant_sweep_is_one_table_and_figure_with_the_names(tmp_path):
    sweep = tmp_path / "sweep"
    for i, (variant, seed, ppl) in enumerate([("rope", 0, 2.0), ("rope", 1, 2.2), ("prope", 0, 3.0)]):
        _job(sweep, i, variant, seed, ppl)
    runs, _ = load_jobs(sweep)
    assert [r["_group"] for r in runs] == ["rope", "rope", "prope"]
    rows = sweep_aggregate(runs)
    assert [(r["group"], r["variant"], r["length"], r["n_runs"]) for r in rows] == [
        ("rope", "rope", 32, 2),
        ("rope", "rope", 64, 2),
        ("prope", "prope", 32, 1),
        ("prope", "prope", 64, 1),
    ]
    summary = collect(sweep, metric="ppl")
    assert "| rope | 2.100 ± 0.141 |" in summary["markdown"] and "| prope | 3.000 |" in summary["markdown"]
    assert Path(summary["figure"]).is_file()


def test_a_sweep_without_variants_keeps_its_rows(tmp_path):
    sweep = tmp_path / "plain"
    _job(sweep, 0, "x", 0, 2.0)
    runs, _ = load_jobs(sweep)
    for r in runs:
        r.pop("variant")
    rows = sweep_aggregate(runs)
    assert "variant" not in rows[0] and set(rows[0]) >= {"group", "pe", "length", "ppl_mean"}


def _row(label: str, length: int, ppl: float, **extra) -> dict:
    row = {"label": label, "series": label, "pe": "rope", "task_type": "lm", "mode": "nonoverlap"}
    return row | {"length": length, "in_distribution": length == 32, "status": "ok", "ppl": ppl} | extra


def test_eval_result_aggregates_the_seeds_of_each_variant(tmp_path):
    rows = [
        _row("prope · seed 0", 32, 4.0, variant="prope"),
        _row("prope · seed 1", 32, 6.0, variant="prope"),
        _row("prope · seed 0", 64, 5.0, variant="prope"),
        _row("alibi · seed 0", 32, 3.0, variant="alibi"),
        _row("prope · seed 0", 32, 9.0, mode="sliding", variant="prope"),  # another window mode
    ]
    ev = EvalResult(tmp_path, rows, {})
    agg = ev.aggregate()
    got = list(zip(agg["group"], agg["length"], agg["ppl_mean"], agg["ppl_n"], agg["seeds"], strict=True))
    assert got[:2] == [("prope", 32, 5.0, 2, [0, 1]), ("prope", 64, 5.0, 1, [0])]
    assert got[2] == ("alibi", 32, 3.0, 1, [0])
    assert agg["ppl_std"].iloc[0] == pytest.approx(2**0.5) and math.isnan(agg["ppl_std"].iloc[1])
    assert ev.aggregate("sliding")["ppl_mean"].tolist() == [9.0]
    assert "| prope | 5.000 ± 1.414 | 5.000 |" in ev.table("ppl")
    with pytest.raises(Exception, match="no ok rows in mode 'strided'"):
        ev.aggregate("strided")


def _run_dir(
    root: Path, name: str, seed: int, pe: str = "rope", variant: str | None = None, base=1e4
) -> Path:
    run = root / name
    run.mkdir()
    text = f"seed: {seed}\nmodel:\n  pe: {pe}\n  pe_options:\n    base: {base}\ndata:\n  seed: {seed}\n"
    text += f"paths:\n  output_dir: {run}\n"
    if variant:
        text += f"variant:\n  name: {variant}\n"
    (run / "config.yaml").write_text(text)
    return run


def test_plain_run_dirs_are_labelled_by_variant_or_differing_settings_and_seed(tmp_path):
    runs = [_run_dir(tmp_path, f"v{s}", s, variant="prope") for s in (0, 1)]
    runs.append(_run_dir(tmp_path, "a0", 0, pe="alibi", variant="alibi", base=2.0))
    assert run_dir_labels(runs) == ["prope · seed 0", "prope · seed 1", "alibi · seed 0"]
    plain = [_run_dir(tmp_path, "p0", 0, base=500.0), _run_dir(tmp_path, "p1", 0)]
    assert run_dir_labels(plain) == ["rope · base 500.0 · seed 0", "rope · base 10000.0 · seed 0"]
    twins = [_run_dir(tmp_path, "t0", 0), _run_dir(tmp_path, "t1", 0)]
    assert run_dir_labels(twins) == ["rope · seed 0 [t0]", "rope · seed 0 [t1]"]
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "multirun.yaml").write_text("{}")
    assert run_dir_labels([tmp_path / "sweep"]) is None  # a sweep dir: posformer-eval's own labels
