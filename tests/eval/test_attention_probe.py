"""The attention probe (posformer/eval/attention_probe.py, posformer-inspect attention_probe=true): the
recorded probabilities are the model's attention (the forward is unchanged, rows sum to one, sinks take
their share), the first-token mass and entropy against distance follow their formulas, and inspect
writes JSON, CSV, Markdown and PNG+SVG; bad probe keys are refused in one line."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from posformer.cli.inspect import compose_config, inspect_pe
from posformer.errors import ConfigError
from posformer.eval.attention_probe import attention_probabilities, distance_bins, probe_stats
from posformer.model import ModelConfig, build_model


def _model(pe: str = "alibi", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="decoder", vocab_size=32, d_model=16, n_heads=2, n_layers=2, dropout=0.0, pe=pe, **kw
    )
    return build_model(cfg).eval()


@pytest.mark.parametrize("pe", ["rope", "alibi", "content_rel"])
def test_the_probe_records_the_models_attention_and_changes_no_output(pe: str) -> None:
    model = _model(pe)
    ids = torch.randint(1, 32, (3, 12))
    with torch.no_grad():
        before = model(ids)
    probs = attention_probabilities(model, ids)  # (L, B, H, T, T)
    assert probs.shape == (2, 3, 2, 12, 12)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 2, 12))
    assert probs.triu(1).abs().max() == 0  # causal
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before)  # no record left behind, same forward
    assert "_attention_probe" not in model.__dict__


def test_sinks_take_their_share_of_the_recorded_mass() -> None:
    model = _model(layer_kinds={"s": {"sinks": True}}, layers={"pattern": ["s"]})
    with torch.no_grad():
        for block in model.blocks:
            block.self_attn.sinks.fill_(3.0)
    probs = attention_probabilities(model, torch.randint(1, 32, (2, 6)))
    assert probs.sum(-1).max() < 0.999


def test_first_token_mass_and_entropy_follow_their_formulas() -> None:
    t = 9
    uniform = torch.ones(t, t).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)  # causal uniform attention
    sink = torch.zeros(t, t)
    sink[:, 0] = 1.0  # all mass on token 0
    probs = torch.stack([uniform, sink]).view(2, 1, 1, t, t).expand(2, 2, 3, t, t)
    stats = probe_stats(probs)
    want_uniform = sum(1 / (i + 1) for i in range(1, t)) / (t - 1)
    assert stats["first_token_mass"][0] == pytest.approx([want_uniform] * 3)
    assert stats["first_token_mass"][1] == pytest.approx([1.0] * 3)
    assert stats["distance_bins"] == [[1, 2], [2, 4], [4, 8], [8, 9]] == [list(b) for b in distance_bins(t)]
    assert stats["entropy"][0] == pytest.approx(stats["uniform_entropy"])  # uniform: log(i + 1)
    assert stats["entropy"][1] == pytest.approx([0.0] * 4, abs=1e-6)
    assert stats["uniform_entropy"][1] == pytest.approx((math.log(3) + math.log(4)) / 2)


def test_write_probe_writes_json_csv_markdown_and_the_figure(tmp_path: Path) -> None:
    from posformer.eval.attention_probe import write_probe

    stats = probe_stats(attention_probabilities(_model(), torch.randint(1, 32, (2, 10))))
    paths = write_probe(stats, tmp_path, "alibi", {"source": "random"})
    assert sorted(p.name for p in paths) == sorted(p.name for p in tmp_path.iterdir())
    rows = list(csv.DictReader((tmp_path / "attention_entropy.csv").open()))
    assert len(rows) == 2 * len(distance_bins(10))
    assert float(rows[0]["entropy"]) == pytest.approx(stats["entropy"][0][0], abs=1e-6)
    assert (tmp_path / "attention_probe.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.slow
def test_inspect_writes_the_probe_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = compose_config(
        [
            "pe=alibi",
            "model.d_model=16",
            "model.n_heads=2",
            "max_len=16",
            "attention_probe=true",
            "probe_batch=2",
        ]
    )
    result = inspect_pe(cfg, tmp_path)
    names = {
        "attention_probe.json",
        "attention_probe.md",
        "attention_probe.png",
        "attention_probe.svg",
        "attention_first_token.csv",
        "attention_entropy.csv",
    }
    assert names <= {p.name for p in tmp_path.iterdir()}
    saved = json.loads((tmp_path / "attention_probe.json").read_text())
    assert saved["first_token_mass"] == result["attention_probe"]["first_token_mass"]
    rows = list(csv.DictReader((tmp_path / "attention_first_token.csv").open()))
    assert len(rows) == saved["layers"] * saved["heads"]
    assert float(rows[1]["first_token_mass"]) == pytest.approx(saved["first_token_mass"][0][1], abs=1e-6)
    assert "First-token attention mass" in (tmp_path / "attention_probe.md").read_text()
    assert (tmp_path / "attention_probe.png").read_bytes()[:4] == b"\x89PNG"
    assert "attention probe" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["probe_batch=0"], "probe_batch=0 must be"),
        (["probe_source=file"], "probe_source='file' is unknown"),
        (["probe_source=data"], "probe_source=data reads the training data of a checkpoint"),
    ],
)
def test_bad_probe_keys_are_refused_in_one_line(overrides: list[str], needle: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:  # refused when the config is composed, before any work
        inspect_pe(compose_config(["pe=rope", "max_len=8", "attention_probe=true", *overrides]), tmp_path)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_the_probe_refuses_an_encoder_decoder_model() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="encoder_decoder", vocab_size=16, d_model=16, n_heads=2))
    with pytest.raises(ConfigError, match="decoder-only"):
        attention_probabilities(model, torch.ones(1, 4, dtype=torch.long))
