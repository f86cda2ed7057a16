"""The Python API (posformer/api.py): train, evaluate and load_run from a plain process, no Hydra app.

docs/api.md's notebook runs as written (its python blocks, in order, in a temporary folder); the
other tests pin the results objects against the files the run wrote, the one-line errors raised
before any write, and that a caller's own Hydra set-up survives a call.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import posformer
from posformer.api import as_overrides, override_value

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Work in ``tmp_path`` (runs go to ./outputs) with the data cache there too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("POSFORMER_ROOT", raising=False)
    monkeypatch.setenv("POSFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


@pytest.mark.slow
def test_api_doc_notebook_runs_as_written(in_tmp, capsys):
    blocks = _python_blocks(API_DOC)
    assert len(blocks) == 6
    ns: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for block in blocks:
            exec(block, ns)  # noqa: S102 - the documented example, run as a user would
    finally:
        torch.set_num_threads(threads)
    result, ev, run = ns["result"], ns["ev"], ns["run"]
    # the run dir is where the command line would put it, and holds what it would write
    assert result.run_dir.parent == in_tmp / "outputs" / "train" / "runs"
    for name in ("config.yaml", "results.json", "results.md", "tokenizer/meta.json"):
        assert (result.run_dir / name).is_file(), name
    written = json.loads((result.run_dir / "results.json").read_text())
    assert result.results == written and result.pe == "alibi" and result.global_step == 40
    assert sorted(result.metrics) == [32, 64, 128] and result.metrics[32]["in_distribution"] is True
    assert result.last_checkpoint is not None and result.last_checkpoint.is_file()
    # the evaluation scores the same tokens as training's final evaluation: the same numbers
    [label] = ev.labels
    for length in (32, 64, 128):
        assert ev.metric("ppl")[label][length] == pytest.approx(result.metrics[length]["ppl"], rel=1e-5)
    assert ev.files["json"].is_file() and ev.output_dir == in_tmp / "eval_alibi"
    # sampling: text of the corpus' characters, reproducible with the seed
    text = ns["text"]
    assert isinstance(text, str) and len(text) == 40 and set(text) <= set(Path("corpus.txt").read_text())
    assert run.generate("the cat", max_new_tokens=40, temperature=0.8, top_k=10, seed=0) == text
    assert run.generate("the cat", max_new_tokens=40, temperature=0.8, top_k=10, seed=1) != text
    assert run.metrics[32]["ppl"] == pytest.approx(result.metrics[32]["ppl"])
    # the last cell: one line with the fix, and no run dir made for it
    out = capsys.readouterr().out
    assert "did you mean trainer.max_steps?" in out
    assert len(list((in_tmp / "outputs" / "train" / "runs").iterdir())) == 1 + 4
    # named variants over two seeds: labelled by the variant and seed, aggregated over the seeds
    study, agg = ns["study"], ns["agg"]
    assert label == "alibi · seed 0"
    assert study.labels == ["prope · seed 0", "prope · seed 1", "alibi · seed 0", "alibi · seed 1"]
    assert list(agg["group"]) == ["prope", "prope", "alibi", "alibi"] and list(agg["length"]) == [32, 64] * 2
    assert list(agg["ppl_n"]) == [2] * 4 and list(agg["n_runs"]) == [2] * 4
    ppl = study.metric("ppl")
    for row in agg.itertuples():
        pair = [ppl[f"{row.group} · seed {s}"][row.length] for s in (0, 1)]
        assert row.ppl_mean == pytest.approx(sum(pair) / 2) and row.ppl_std == pytest.approx(
            abs(pair[0] - pair[1]) / 2**0.5
        )
    assert "| prope | " in study.table("ppl") and " ± " in study.table("ppl")


def test_overrides_from_keyword_arguments():
    assert as_overrides(["pe=rope"], trainer={"max_steps": 9, "precision": "32-true"}, seed=3) == [
        "pe=rope",
        "trainer.max_steps=9",
        "trainer.precision='32-true'",
        "seed=3",
    ]
    assert override_value([16, 32]) == "[16,32]" and override_value(None) == "null"
    assert override_value(True) == "true" and override_value("true") == "'true'"
    assert override_value("/a b/it's.txt") == "'/a b/it\\'s.txt'"
    assert override_value(Path("/data/x.txt")) == "/data/x.txt"
    with pytest.raises(posformer.ConfigError, match="one string"):
        as_overrides("pe=rope")


def test_train_bad_value_raises_one_line_before_any_write(in_tmp):
    run_dir = in_tmp / "run"
    with pytest.raises(posformer.ConfigError) as err:
        posformer.train(["data.batch_size=0"], run_dir=run_dir)
    assert "\n" not in str(err.value) and "batch_size" in str(err.value)
    with pytest.raises(posformer.ConfigError, match="did you mean optim.weight_decay"):
        posformer.train(optim={"weight_decy": 0.1}, run_dir=run_dir)
    assert not run_dir.exists() and not (in_tmp / "outputs").exists()


def test_a_callers_hydra_survives(in_tmp):
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_module("posformer.configs", version_base="1.3"):
        mine = GlobalHydra.instance().hydra
        with pytest.raises(posformer.ConfigError):
            posformer.train(["trainer.max_step=1"])
        assert GlobalHydra.instance().hydra is mine


def test_evaluate_and_load_a_task_run(tiny_run_dir, tmp_path):
    ev = posformer.evaluate(
        tiny_run_dir, lengths=[4, 8], output_dir=tmp_path / "ev", overrides=["trainer=cpu"]
    )
    exact = ev.metric("exact_match")
    assert len(exact) == 1 and sorted(next(iter(exact.values()))) == [4, 8]
    assert json.loads(ev.files["json"].read_text())["results"] == ev.rows
    run = posformer.load_run(tiny_run_dir)
    assert run.tokenizer is None and run.kind == "decoder" and run.checkpoint.name.startswith("last")
    out = run.generate([5, 6, 7], max_new_tokens=4, temperature=0)
    assert len(out.split()) <= 4  # symbol ids (stops at EOS)
    with pytest.raises(posformer.DataError, match="list of symbol ids"):
        run.generate("abc")
    with pytest.raises(posformer.ConfigError, match="encoder-decoder"):
        run.translate([5, 6])


def test_missing_targets_are_one_line(tmp_path):
    with pytest.raises(posformer.CheckpointError, match="no such checkpoint file or run directory"):
        posformer.evaluate(tmp_path / "nope")
    with pytest.raises(posformer.CheckpointError, match="no such run dir"):
        posformer.load_run(tmp_path / "nope")
    with pytest.raises(posformer.CheckpointError, match="no checkpoints/ folder"):
        posformer.load_run(tmp_path)
