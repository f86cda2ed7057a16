"""The main job (``make run`` = ``posformer-train -m experiment=extrapolation``): a character LM on a
corpus posformer generates (no download), the same text everywhere; its summary names the PEs that did
not learn in distribution against the corpus' unigram perplexity; a short real multirun shows ALiBi
flat and sinusoidal climbing past the training length."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posformer.data import build_datamodule
from posformer.data.corpus import CorpusDataModule, generate, unigram_ppl
from posformer.errors import ConfigError
from posformer.eval.sweep import not_learned_line, unigram_baseline


def test_corpus_is_deterministic_sized_and_english_like() -> None:
    a, b = generate(5000, seed=0), generate(5000, seed=0)
    assert a == b and len(a) == 5000
    assert generate(5000, seed=1) != a
    assert a[0].isupper() and ". " in a and "\n\n" in a
    assert set(a) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .\n")


def test_unigram_ppl_is_the_character_distribution_perplexity() -> None:
    assert unigram_ppl("abab", "abab") == pytest.approx(2.0, rel=1e-9)  # add-one: p = 3/6 each
    # an unseen character gets add-one mass: p(a) = p(b) = 3/7, p(c) = 1/7
    assert unigram_ppl("abab", "abc") == pytest.approx(math.exp(-(2 * math.log(3 / 7) + math.log(1 / 7)) / 3))
    text = generate(50_000)
    assert 10 < unigram_ppl(text[:45_000], text[45_000:]) < 30  # ~32 symbols, skewed


def test_corpus_datamodule_reports_its_unigram_baseline(tmp_path: Path) -> None:
    cfg = {"name": "corpus", "n_chars": 20_000, "block_size": 16, "eval_lengths": [16, 64]}
    cfg["cache_dir"] = tmp_path
    dm = build_datamodule(cfg, "decoder", seed=0)
    assert isinstance(dm, CorpusDataModule)
    summary = dm.config_summary()
    assert summary["train_tokens"] == 18_000 and summary["val_tokens"] == 2_000
    assert summary["unigram_ppl"] == pytest.approx(unigram_ppl(*dm.read_splits()), abs=1e-4)
    again = build_datamodule({**cfg}, "decoder", seed=5)  # another run seed: the same corpus
    assert np.array_equal(again.val_stream, dm.val_stream)


def test_corpus_refuses_a_too_small_corpus_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.n_chars=10 must be an integer >= 1000"):
        build_datamodule({"name": "corpus", "n_chars": 10, "cache_dir": tmp_path}, "decoder", seed=0)


def _row(group: str, length: int, ind: bool, **metrics: float) -> dict:
    row = {"group": group, "pe": group, "length": length, "in_distribution": ind}
    for m in ("ppl", "exact_match"):
        row[f"{m}_mean"] = metrics.get(m)
    return row


def test_not_learned_line_names_models_at_the_unigram_baseline_and_states_the_rule() -> None:
    rows = [_row("nope", 32, True, ppl=12.0), _row("alibi", 32, True, ppl=2.0)]
    rows.append(_row("nope", 64, False, ppl=30.0))
    line = not_learned_line(rows, "ppl", 20.0)
    assert line.endswith(": nope") and "half the unigram perplexity 20" in line
    assert not_learned_line(rows, "ppl", 30.0).endswith(": none")
    assert not_learned_line(rows, "ppl", None) == ""  # no baseline, no claim
    tasks = [_row("nope", 8, True, exact_match=0.07), _row("rope", 8, True, exact_match=1.0)]
    assert not_learned_line(tasks, "exact_match", None).endswith("at a training length): nope")
    runs = [{"data": {"unigram_ppl": 19.2}}, {"data": {}}]
    assert unigram_baseline(runs) == 19.2 and unigram_baseline([{"data": {}}]) is None


@pytest.mark.slow
def test_main_job_shows_alibi_flat_and_sinusoidal_climbing(tmp_path: Path) -> None:
    """The main job, shortened (2 PEs, 300 steps): the finding is already there."""
    cmd = [sys.executable, "-m", "posformer.cli.train", "-m", "experiment=extrapolation"]
    cmd += ["pe=alibi,sinusoidal", "trainer.max_steps=300", "trainer.val_check_interval=300"]
    cmd += ["data.eval_tokens=2048", "callbacks.pe_heatmap=null"]
    cmd += [f"hydra.sweep.dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "did not learn in distribution (perplexity at the training length >= " in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    ppl = {(r["group"], r["length"]): r["ppl_mean"] for r in summary["rows"]}
    assert ppl[("alibi", 256)] < 1.2 * ppl[("alibi", 32)]  # flat past the training length
    assert ppl[("sinusoidal", 256)] > 3 * ppl[("sinusoidal", 32)]  # climbs
    assert summary["not_learned"].endswith(": none")
    assert (tmp_path / "summary.png").stat().st_size > 10_000
