"""Positions a PE represents in the model's dtype: xPos' decay factors leave a dtype's range.

xPos scales query pair i by ``ζ_i^(m/γ)`` and key pair i by ``ζ_i^(-n/γ)``: past ``m = γ·ln(1/tiny)/
ln(1/ζ_0)`` the query scale of pair 0 is no longer a normal number, and a little later the key scale
overflows (inf, then NaN scores): 3,967 positions in float16 and 35,695 in float32 for the default
``scale_base`` 512, so the 64k evaluation produced NaN in every dtype. ``max_positions_in(dtype)`` is
that limit; the model refuses a longer input in one line (``posformer-eval`` reports n/a with the
reason), training refuses before any work. A small ``scale_base`` brings the limits within reach of
a CPU test (the limit is proportional to it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_cases import TINY, assert_clean_failure, eval_cli, train_cli

from posformer.errors import PositionRangeError
from posformer.pe.rope.xpos import XPosEncoding

SCALE_BASE = 16.0  # limits: 124 positions in float16, 1,116 in float32


def _limit(dtype: torch.dtype, scale_base: float = SCALE_BASE) -> int:
    tiny = max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny)  # the tables are float32
    return int(scale_base * math.log(1 / tiny) / math.log(1.4 / 0.4)) + 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_limit_is_where_the_scales_leave_the_dtype(dtype: torch.dtype) -> None:
    """At the last position the query scale of pair 0 is a normal number and the key scale finite; a
    little past the limit (20 %) the key scale is inf in the dtype: the limit is real, not loose."""
    pe = XPosEncoding(d_model=16, n_heads=2, causal=True, scale_base=SCALE_BASE)
    n = pe.max_positions_in(dtype)
    assert n == _limit(dtype)
    assert pe.max_positions_in(torch.float32) == pe.max_positions_in(torch.bfloat16)  # one exponent range
    inside = torch.tensor([[n - 1]])
    q, k = pe.decay(inside, is_query=True).to(dtype), pe.decay(inside, is_query=False).to(dtype)
    assert q.abs().min() >= torch.finfo(dtype).tiny and torch.isfinite(k).all()
    past = torch.tensor([[int(1.2 * n)]])
    assert not torch.isfinite(pe.decay(past, is_query=False).to(dtype)).all()
    if dtype == torch.float64:  # its tables are float32: float64 does not reach further
        assert n == pe.max_positions_in(torch.float32)
    assert XPosEncoding(d_model=16, n_heads=2, causal=True).max_positions_in(torch.float16) == 3967


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_model_past_its_range_refuses_in_one_line_instead_of_nan(
    tiny_model: Any, dtype: torch.dtype
) -> None:
    """Within the limit the logits are finite (float16 under autocast, as a GPU's 16-mixed); one
    position past it the model refuses, naming the limit, the dtype and the fixes; with the check
    switched off the same input gives non-finite logits (what the check prevents)."""
    model = tiny_model("xpos", pe_options={"scale_base": SCALE_BASE})
    n = _limit(dtype)

    def logits(length: int) -> torch.Tensor:
        ids = torch.randint(4, 13, (1, length))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float16):
            return model(ids)

    assert torch.isfinite(logits(n)).all()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        PositionRangeError,
        match=rf"represents {n} positions in {name}, but the input needs position {n} .*scale_base=16",
    ):
        logits(n + 1)
    model.pe.max_positions_in = lambda dtype: None
    assert not torch.isfinite(logits(2 * n)).all()


def test_packed_rows_past_the_range_read_their_true_top(tiny_model: Any) -> None:
    """A bound is not the largest position: packed documents restart at 0, so rows longer than the
    limit whose documents are shorter are fine (the tensor is read once the bound reaches the limit)."""
    model = tiny_model("xpos", pe_options={"scale_base": 1.0})  # float32: 70 positions
    assert model.pe.max_positions_in(torch.float32) == 70
    segments = (torch.arange(100) // 50).unsqueeze(0)  # two documents of 50 tokens
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(4, 13, (1, 100)), segment_ids=segments)).all()
        with pytest.raises(PositionRangeError, match="represents 70 positions in float32"):
            model(torch.randint(4, 13, (1, 100)))


def test_xpos_refuses_a_scale_that_does_not_decay() -> None:
    with pytest.raises(Exception, match=r"scale_base=0.*must be > 0"):
        XPosEncoding(d_model=16, n_heads=2, causal=True, scale_base=0)


def test_training_past_the_range_is_refused_before_any_work(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The longest training sequence of the tiny task needs more positions than xPos represents in
    float32 with ``scale_base=0.1`` (7): refused in one line that names the dtype and the fixes."""
    run = tmp_path / "run"
    code, text = train_cli(
        ["pe=xpos", "model.pe_options.scale_base=0.1"], run, cache_dir, monkeypatch, capsys
    )
    assert_clean_failure(
        code, text, "pe='xpos' represents 7 positions in float32, but training needs", "scale_base=0.1"
    )
    assert not (run / "checkpoints").exists()


def test_the_final_evaluation_reports_lengths_past_the_range(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Training fits (``scale_base=1``: 70 positions), the evaluation length 40 (83 tokens) does not:
    its row says so instead of a NaN perplexity; posformer-eval of the run does the same."""
    import json

    run = tmp_path / "run"
    args = ["pe=xpos", "model.pe_options.scale_base=1", "data.eval_lengths=[4,40]"]
    code, text = train_cli(
        args, run, cache_dir, monkeypatch, capsys, tiny=[*TINY, "callbacks.model_checkpoint.monitor=null"]
    )
    assert code == 0, text[-3000:]
    rows = {r["length"]: r for r in json.loads((run / "results.json").read_text())["results"]}
    assert math.isfinite(rows[4]["loss"]) and "PE has 70" in rows[40]["note"], rows
    out = tmp_path / "eval"
    ckpt = run / "checkpoints" / "last.ckpt"
    code, text = eval_cli(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4,40]", "trainer=cpu"], out, monkeypatch, capsys
    )
    assert code == 0, text[-3000:]
    rows = {r["length"]: r for r in json.loads((out / "extrapolation.json").read_text())["results"]}
    assert rows[4]["status"] == "ok" and math.isfinite(rows[4]["loss"]), rows[4]
    assert rows[40]["status"] == "n/a" and rows[40].get("loss") is None, rows[40]
    assert "represents 70 positions in float32" in rows[40]["reason"] and "scale_base=1" in rows[40]["reason"]
