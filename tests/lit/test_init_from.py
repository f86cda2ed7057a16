"""``posformer-train init_from=<ckpt>``: a new run that starts from a checkpoint's weights (fine-tuning).

Unlike ``ckpt_path=`` (which resumes a run: optimizer, schedule, step and data position), the run
starts at step 0 with a new optimizer and schedule. The model built from the config must have every
tensor of the checkpoint with the same shape (options without parameters, a rotary scaling, may
differ); anything else is one line before the run dir is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from posformer.checkpoints import safe_load_checkpoint
from tests.cli_cases import assert_clean_failure, one_clear_line, train_cli


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return safe_load_checkpoint(path)["state_dict"]


@pytest.mark.slow  # two tiny training runs (~10 s)
def test_a_new_run_starts_from_the_weights_and_may_change_the_rotary_scaling(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # a learning rate of 1e-9: the weights the run ends with are within 1e-7 of the ones it started from
    frozen = ["optim.lr=1e-9", "optim.weight_decay=0"]
    code, text = train_cli(
        [f"init_from={tiny_checkpoint}", *frozen], tmp_path / "run", tmp_path / "cache", monkeypatch, capsys
    )
    assert code == 0, text[-2000:]
    start, end = _weights(tiny_checkpoint), _weights(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert start.keys() == end.keys()
    for key in start:
        torch.testing.assert_close(end[key], start[key], rtol=0, atol=1e-7, msg=key)
    assert safe_load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 4  # from 0
    scaled = ["model.pe_options.scaling={type: linear, factor: 2}"]
    args = [f"init_from={tiny_checkpoint}", *scaled]
    code, text = train_cli(args, tmp_path / "scaled", tmp_path / "cache", monkeypatch, capsys)
    assert code == 0, text[-2000:]


def test_another_network_is_one_line_before_anything_is_written(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    run = tmp_path / "run"
    code, text = train_cli(
        [f"init_from={tiny_checkpoint}", "model.d_model=32"], run, tmp_path / "cache", monkeypatch, capsys
    )
    line = one_clear_line(code, text, 1, "init_from=", "does not fit the configured model")
    assert "in the checkpoint" in line and "config.yaml" in line  # the shapes, and where its settings are
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()


def test_init_from_and_a_resume_are_refused_together(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    copy = tmp_path / "copy.ckpt"
    shutil.copy(tiny_checkpoint, copy)
    code, text = train_cli(
        [f"init_from={copy}", f"ckpt_path={copy}"], tmp_path / "run", tmp_path / "cache", monkeypatch, capsys
    )
    assert_clean_failure(code, text, "init_from=", "ckpt_path resumes another run", "keep one")
    assert not (tmp_path / "run" / "config.yaml").exists()
