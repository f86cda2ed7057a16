"""``posformer-eval`` agrees with training by default: a tiny character LM trained through the real
``posformer-train`` main, then evaluated by the real ``posformer-eval`` main with default settings,
scores the same tokens at the training run's lengths and prints the same perplexity as ``results.md``."""

from __future__ import annotations

import csv
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from posformer.eval.sweep import collect
from tests.cli_cases import QUIET, TINY_MODEL, TINY_RUN, TINY_TRAINING, call, eval_cli, train_cli

#: a text whose validation split (the last 10%) holds 2,000 characters
TEXT = "".join(f"line {i % 17}: to be or not to be, that is the question {i % 5}.\n" for i in range(400))


class _NoCapture:
    """``capsys`` stand-in for a module-scoped fixture (the output stays in pytest's own capture)."""

    def readouterr(self):
        return type("Captured", (), {"out": "", "err": ""})()


def train_lm(root: Path) -> Path:
    """The run dir of a tiny char LM (block 8, evaluated at 8 and 16) trained through the real main."""
    (root / "text.txt").write_text(TEXT)
    run = root / "run"
    args = [
        "data=text",
        f"data.path={root / 'text.txt'}",
        "data.block_size=8",
        "data.eval_lengths=[8,16]",
        "data.batch_size=16",
        "pe=rope",
        *TINY_MODEL,
        *TINY_TRAINING,
        *QUIET,
        "callbacks.model_checkpoint.monitor=null",
    ]
    with pytest.MonkeyPatch.context() as mp:
        code, text = train_cli(args, run, root / "cache", mp, _NoCapture(), tiny=[])
    assert code == 0 and (run / "results.md").is_file(), text
    return run


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    return train_lm(tmp_path_factory.mktemp("agree"))


def _md_ppl(run: Path) -> dict[int, tuple[str, int]]:
    """``results.md``'s perplexity cell and ``results.json``'s scored tokens per length."""
    rows = json.loads((run / "results.json").read_text())["results"]
    tokens = {int(r["length"]): int(r["n_tokens"]) for r in rows}
    md = (run / "results.md").read_text().splitlines()
    header = [c.strip() for c in md[2].strip("|").split("|")]
    out = {}
    for line in md[4:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(header) and cells[0].isdigit():
            out[int(cells[0])] = (cells[header.index("ppl")], tokens[int(cells[0])])
    return out


def test_eval_defaults_score_what_training_scored(lm_run, monkeypatch, capsys):
    run = lm_run
    trained = _md_ppl(run)
    assert set(trained) == {8, 16}
    out = run.parent / "eval"
    code, text = eval_cli(
        [f"eval.checkpoints=[{run / 'checkpoints' / 'last.ckpt'}]", "trainer=cpu"], out, monkeypatch, capsys
    )
    assert code == 0, text[-3000:]
    rows = json.loads((out / "extrapolation.json").read_text())["results"]
    got = {r["length"]: r for r in rows if r["mode"] == "nonoverlap"}
    assert sorted(got) == [8, 16, 32, 64, 128]  # defaults: 1x .. 16x the training length
    for length, (ppl_cell, tokens) in trained.items():
        assert got[length]["status"] == "ok"
        assert got[length]["scored_tokens"] == tokens  # the same targets as training scored
        assert f"{got[length]['ppl']:.3f}" == ppl_cell, (length, got[length]["ppl"], ppl_cell)
    # every length scores the same count, and the console says how many
    assert {r["scored_tokens"] for r in rows} == {trained[8][1]}
    assert re.search(rf"scored tokens.*\n(.*\n)*.*\b{trained[8][1]}\b", text), text[-2000:]


# ------------------------------------------------------------------------------ seeds
def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def seed_sweep(tmp_path_factory) -> Path:
    """A real ``posformer-train -m seed=0,1`` (in-process) of the tiny char LM: its sweep dir."""
    root = tmp_path_factory.mktemp("seeds")
    (root / "text.txt").write_text(TEXT)
    sweep = root / "sweep"
    argv = ["posformer-train", "-m", "seed=0,1", "data=text", f"data.path={root / 'text.txt'}"]
    argv += ["data.block_size=8", "data.eval_lengths=[8,16]", "data.batch_size=16", "pe=rope"]
    argv += [*TINY_MODEL, *TINY_TRAINING, *QUIET, "callbacks.model_checkpoint.monitor=null"]
    argv += [f"hydra.sweep.dir={sweep}", f"paths.root_dir={root}", f"paths.cache_dir={root / 'cache'}"]
    from posformer.cli.train import main

    with pytest.MonkeyPatch.context() as mp:
        code, text = call(main, argv, mp, _NoCapture())
    assert code == 0 and (sweep / "summary.csv").is_file(), text
    return sweep


@pytest.mark.slow  # a multirun (two training jobs)
def test_eval_over_a_seed_sweep_prints_and_writes_mean_std_n(seed_sweep, monkeypatch, capsys):
    out = seed_sweep.parent / "eval"
    args = [f"eval.sweep_dir={seed_sweep}", "eval.which=last", "trainer=cpu"]
    code, text = eval_cli(args, out, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert "over seeds: mean ± std (n)" in text and "(n=2)" in text, text[-3000:]
    agg = {(r["group"], r["mode"], int(r["length"])): r for r in _csv(out / "extrapolation_seeds.csv")}
    rows = json.loads((out / "extrapolation.json").read_text())["results"]
    ppl = sorted(r["ppl"] for r in rows if r["mode"] == "nonoverlap" and r["length"] == 8)
    assert len(ppl) == 2 and ppl[0] != ppl[1]  # two seeds, two models
    cell = agg[("rope", "nonoverlap", 8)]
    assert cell["n"] == "2" and cell["seeds"] == "0 1"
    assert float(cell["ppl_mean"]) == pytest.approx(statistics.fmean(ppl), rel=1e-9)
    assert float(cell["ppl_std"]) == pytest.approx(statistics.stdev(ppl), rel=1e-9)
    # the same mean and std as the training sweep's own summary at its lengths
    summary = {(r["group"], int(r["length"])): r for r in _csv(seed_sweep / "summary.csv")}
    for length in (8, 16):
        mine, theirs = agg[("rope", "nonoverlap", length)], summary[("rope", length)]
        assert float(mine["ppl_mean"]) == pytest.approx(float(theirs["ppl_mean"]), rel=1e-5)
        assert float(mine["ppl_std"]) == pytest.approx(float(theirs["ppl_std"]), rel=1e-3)


@pytest.mark.slow  # a multirun (two training jobs)
def test_one_seed_writes_an_empty_std_never_zero(seed_sweep, tmp_path, monkeypatch, capsys):
    """n = 1: the std is undefined, an empty cell in posformer-eval's and the training sweep's CSV."""
    job = next(p for p in sorted(seed_sweep.iterdir()) if (p / "results.json").is_file())
    out = tmp_path / "eval"
    code, text = eval_cli(
        [f"eval.checkpoints=[{job / 'checkpoints' / 'last.ckpt'}]", "eval.lengths=[8,16]", "trainer=cpu"],
        out,
        monkeypatch,
        capsys,
    )
    assert code == 0, text[-3000:]
    assert "over seeds: mean" not in text  # one model per group: the per-series table says it all
    rows = _csv(out / "extrapolation_seeds.csv")
    assert rows and all(r["n"] == "1" and r["ppl_std"] == "" and r["ppl_mean"] for r in rows)
    one = tmp_path / "one_seed"
    shutil.copytree(job, one / job.name)
    shutil.copy(seed_sweep / "multirun.yaml", one / "multirun.yaml")
    collect(one)
    rows = _csv(one / "summary.csv")
    assert rows and all(r["n_runs"] == "1" and r["ppl_std"] == "" and r["ppl_mean"] for r in rows)


# ------------------------------------------------------------------------------ tasks: one scorer
def test_task_exact_match_agrees_with_training(tmp_path, monkeypatch, capsys):
    """A synthetic-task run: posformer-eval's exact match and token accuracy at the training run's
    lengths are results.json's (one scorer, metrics.sequence_stats, the same evaluation sets)."""
    run = tmp_path / "run"
    code, text = train_cli([], run, tmp_path / "cache", monkeypatch, capsys, tiny=TINY_RUN)
    assert code == 0, text[-3000:]
    trained = {r["length"]: r for r in json.loads((run / "results.json").read_text())["results"]}
    out = tmp_path / "eval"
    lengths = sorted(trained)
    ckpt = run / "checkpoints" / "last.ckpt"
    args = [f"eval.checkpoints=[{ckpt}]", f"eval.lengths=[{','.join(map(str, lengths))}]", "trainer=cpu"]
    code, text = eval_cli(args, out, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    got = {r["length"]: r for r in json.loads((out / "extrapolation.json").read_text())["results"]}
    assert sorted(got) == lengths
    for length in lengths:  # training's values passed through Lightning's float32 logging: 1e-6
        assert got[length]["n_sequences"] == trained[length]["n_sequences"] > 0
        assert got[length]["exact_match"] == pytest.approx(trained[length]["exact_match"], abs=1e-6)
        assert got[length]["token_acc"] == pytest.approx(trained[length]["token_acc"], abs=1e-6)
        assert got[length]["loss"] == pytest.approx(trained[length]["loss"], rel=1e-5)
