"""Sweeps: a real two-PE multirun lands in one sweep dir, and scripts/collect_sweep.py aggregates
runs over seeds (mean ± std per group and length) into JSON/CSV/Markdown and a PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collector():
    spec = importlib.util.spec_from_file_location("collect_sweep", ROOT / "scripts" / "collect_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_job(root: Path, num: int, pe: str, seed: int, ems: dict[int, float]) -> None:
    job = root / f"{num}_pe={pe},seed={seed}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- pe={pe}\n- seed={seed}\n")
    rows = [
        {
            "length": n,
            "in_distribution": n <= 16,
            "exact_match": em,
            "token_acc": em,
            "loss": 1 - em,
            "ppl": 2.0,
            "n_sequences": 10,
            "n_tokens": 100,
        }
        for n, em in ems.items()
    ]
    (job / "results.json").write_text(
        json.dumps({"pe": pe, "seed": seed, "train_length": 16, "results": rows})
    )


def test_collector_mean_std(tmp_path):
    sweep = tmp_path / "sweep"
    values = {"rope": [(1.0, 0.2), (0.98, 0.4), (0.99, 0.0)], "alibi": [(1.0, 0.9), (1.0, 0.8), (0.97, 0.85)]}
    num = 0
    for pe, per_seed in values.items():
        for seed, (a, b) in enumerate(per_seed):
            _fake_job(sweep, num, pe, seed, {16: a, 64: b})
            num += 1
    (sweep / "99_pe=t5,seed=0").mkdir()
    (sweep / "99_pe=t5,seed=0" / "error.txt").write_text("error: boom\n")
    summary = _collector().collect(sweep)
    assert summary["groups"] == ["alibi", "rope"] and summary["n_runs"] == 6 and summary["train_length"] == 16
    rows = {(r["group"], r["length"]): r for r in summary["rows"]}
    ood = [b for _, b in values["rope"]]
    assert rows[("rope", 64)]["exact_match_mean"] == pytest.approx(statistics.fmean(ood))
    assert rows[("rope", 64)]["exact_match_std"] == pytest.approx(statistics.stdev(ood))
    assert rows[("rope", 64)]["seeds"] == [0, 1, 2] and not rows[("rope", 64)]["in_distribution"]
    md = (sweep / "summary.md").read_text()
    assert (
        "| group | 16* | 64 |" in md
        and "| rope | 0.990 ± 0.010 | 0.200 ± 0.200 |" in md
        and "failed jobs (1)" in md
    )
    assert (
        (sweep / "summary.csv").read_text().startswith("group,length,in_distribution,n_runs,exact_match_mean")
    )
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_collector_cli_errors(tmp_path, capsys):
    mod = _collector()
    with pytest.raises(SystemExit, match="no results.json under"):
        mod.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="is not a directory"):
        mod.main([str(tmp_path / "missing")])


@pytest.mark.slow  # a multirun subprocess
def test_multirun_two_pes_then_collect(tmp_path):
    data = [
        "data.n_train=64",
        "data.n_val=16",
        "data.n_eval_per_length=16",
        "data.batch_size=16",
        "data.train_len=[1,4]",
        "data.eval_lengths=[4,8]",
    ]
    model = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32"]
    args = [
        "-m",
        "pe=rope,alibi",
        "debug=fdr",
        f"paths.cache_dir={tmp_path}/cache",
        *data,
        *model,
        "callbacks.pe_heatmap=null",
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "posformer.cli.train", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [sweep] = list((tmp_path / "outputs" / "train" / "multiruns").iterdir())  # default paths: under the cwd
    results = sorted(sweep.glob("*/results.json"))
    assert [json.loads(p.read_text())["pe"] for p in results] == ["rope", "alibi"]
    names = [p.parent.name for p in results]  # <num>_<overrides>: long override lists are shortened
    assert (
        names[0].startswith("0_pe=rope,")
        and names[1].startswith("1_pe=alibi,")
        and max(map(len, names)) <= 82
    )
    summary = _collector().collect(sweep)
    assert summary["groups"] == ["alibi", "rope"]
    assert {r["length"] for r in summary["rows"]} == {4, 8}
