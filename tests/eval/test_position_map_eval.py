"""``posformer-eval eval.position_map=...``: one series per map beside the unmapped one, and a bad map (or one
the checkpoint's PE cannot take) is one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_cases import assert_clean_failure, eval_cli


@pytest.mark.slow  # the session's tiny run, then an evaluation of three series (~5 s)
def test_each_map_is_its_own_series(tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    maps = "[null,{kind: selfextend, group: 2, window: 4},{kind: rerope, window: 3}]"
    base = [f"eval.checkpoints=[{tiny_checkpoint}]", "eval.lengths=[16]", "trainer=cpu"]
    base.append("eval.modes=[nonoverlap]")
    code, text = eval_cli([*base, f"eval.position_map={maps}"], tmp_path / "maps", monkeypatch, capsys)
    assert code == 0, text[-3000:]
    rows = json.loads((tmp_path / "maps" / "extrapolation.json").read_text())["results"]
    by = {r["scaling"]: r for r in rows if r["status"] == "ok"}
    assert set(by) == {"none", "selfextend(group=2,window=4)", "rerope(window=3)"}, set(by)
    losses = {name: r["loss"] for name, r in by.items()}
    assert len(set(losses.values())) == 3, losses  # each map changes the distances at 16 tokens
    code, text = eval_cli(
        [*base, "eval.position_map={kind: dca, window: 3}"], tmp_path / "bad", monkeypatch, capsys
    )
    assert_clean_failure(
        code, text, "eval.position_map: dca has no option 'window'", "chunk_size, local_window"
    )
