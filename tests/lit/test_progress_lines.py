"""Training piped to a file prints plain progress lines, not a bar (``posformer-train ... > run.log``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from posformer.lit.progress import PlainProgress, StepProgressBar, progress_bar
from tests.cli_cases import TINY_DATA, TINY_MODEL


def test_a_log_file_gets_plain_lines_and_a_terminal_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert isinstance(progress_bar(), PlainProgress)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert isinstance(progress_bar(), StepProgressBar)


def test_piped_training_prints_periodic_lines_with_step_loss_rate_and_eta(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from posformer.training import run

    monkeypatch.delenv("POSFORMER_PEAK_FLOPS", raising=False)

    overrides = [
        *TINY_MODEL,
        *TINY_DATA,
        "trainer.max_steps=40",
        "trainer.val_check_interval=20",
        "logger=none",
        "callbacks.pe_heatmap=null",
        "trainer=cpu",
        "pe=alibi",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        run(compose("train", overrides=overrides))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("alibi step ")]
    assert 15 <= len(lines) <= 21, lines  # about twenty a run
    last = lines[-1]
    pattern = r"^alibi step 40/40 \(100%\) · loss [\d.]+ · val exact [\d.]+ · [\d,]+ tok/s \(MFU n/a\)"
    assert re.search(pattern, last), last  # the CPU, no POSFORMER_PEAK_FLOPS: no peak, no MFU
    assert "elapsed · eta 0:00" in last
    # the last line: the validation's value and the step it was taken at (the last, 40, here)
    assert re.search(
        r"alibi finished at step 40 in [\d:]+ · final val exact [\d.]+ \(validated at step 40\)", out
    )
    assert re.search(
        r"final      : alibi · val exact match [\d.]+ \(last validation\) · exact match [\d.]+ at length", out
    )
    assert "\r" not in out  # nothing redrawn in place: a log file reads top to bottom
