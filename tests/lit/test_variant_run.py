"""A run with a named variant, end to end (slow: tiny trainings): its name in the results, config.yaml, the
checkpoint, TensorBoard's run, the printed lines and posformer.evaluate's labels and rows; an LM run's
TensorBoard curves are loss and perplexity against length; a user's own variant group on the command
line (--config-dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import posformer

TINY = [
    "data=corpus",
    "data.block_size=16",
    "data.batch_size=8",
    "data.eval_lengths=[16,32]",
    "data.eval_tokens=256",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=2",
    "model.d_ff=32",
    "trainer=cpu",
    "trainer.max_steps=6",
    "trainer.val_check_interval=4",
    "callbacks.pe_heatmap=null",
]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("POSFORMER_PEAK_FLOPS", raising=False)
    return tmp_path


@pytest.mark.slow
def test_a_variant_run_carries_its_name_everywhere(in_tmp, capsys):
    result = posformer.train([*TINY, "+variant=irope"])
    run = result.run_dir
    assert result.results["variant"] == "irope" and result.results["pe_schedule"] == "rope×1+nope×1"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["variant"]["name"] == "irope" and config["model"]["layers"]["pattern"][1] == "nope_global"
    ckpt = torch.load(result.last_checkpoint, map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["variant"] == "irope"
    assert "decoder, variant=irope, pe=rope×1+nope×1" in (run / "results.md").read_text()
    # TensorBoard: the run named by the variant; an LM's curves are perplexity and loss, no task metric
    events = list((run / "tensorboard" / "irope").rglob("events.out.tfevents*"))
    text = b"".join(p.read_bytes() for p in events).decode("latin-1")
    assert "eval/ppl_vs_length" in text and "eval/loss_vs_length" in text
    assert "exact_match_vs_length" not in text and "hp/ppl_train_len" in text
    out = capsys.readouterr().out
    assert "final      : irope · val ppl " in out and "at length 16 (checkpoint " in out
    # posformer.evaluate: labelled by the variant and seed; its rows say the variant
    ev = posformer.evaluate(run, lengths=[16, 32], n_tokens=256, output_dir="ev", overrides=["trainer=cpu"])
    assert ev.labels == ["irope · seed 0"] and {r["variant"] for r in ev.rows} == {"irope"}
    rows = json.loads(ev.files["json"].read_text())["results"]
    assert {r["label"] for r in rows} == {"irope · seed 0"}


@pytest.mark.slow
def test_no_variant_keeps_the_files_and_labels_of_before(in_tmp):
    result = posformer.train([*TINY, "pe=alibi"])
    assert "variant" not in result.results
    assert "variant" not in yaml.safe_load((result.run_dir / "config.yaml").read_text())
    ckpt = torch.load(result.last_checkpoint, map_location="cpu", weights_only=True)
    assert "variant" not in ckpt["hyper_parameters"]
    assert list((result.run_dir / "tensorboard").glob("events.out.tfevents*"))  # no sub-folder


@pytest.mark.slow
def test_a_users_own_variant_group_from_the_command_line(tmp_path):
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "mine.yaml").write_text(
        "# @package variant\ndefaults:\n  - /pe@_here_: alibi\n  - _self_\nname: my-alibi\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "posformer.cli.train", "--config-dir", str(tmp_path), "+variant=mine"]
    out = subprocess.run([*cmd, "--cfg", "job"], capture_output=True, text=True, env=env, check=True).stdout
    job = yaml.safe_load(out)
    assert job["variant"] == {"pe": "alibi", "pe_options": {"biased_heads": None}, "name": "my-alibi"}
