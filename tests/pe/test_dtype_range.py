"""Positions a PE represents in the model's dtype: xPos' decay factors leave a dtype's range.

xPos scales query pair i by ``ζ_i^(m/γ)`` and key pair i by ``ζ_i^(-n/γ)``: past ``m = γ·ln(1/tiny)/
ln(1/ζ_0)`` the query scale of pair 0 is no longer a normal number, and a little later the key scale
overflows (inf, then NaN scores): 3,967 positions in float16 and 35,695 in float32 for the default
``scale_base`` 512, so the 64k evaluation produced NaN in every dtype. ``max_positions_in(dtype)`` is
that limit ``n``. The score depends on ``m - n`` only, so a forward without a cache over ``0 … T-1``
centres its positions past ``n`` (``rotary_origin``: ``T // 2``) and represents ``2n - 1``; cached
decoding, packed rows and training keep ``n``. A longer input is refused in one line
(``posformer-eval`` reports n/a with the reason), training refuses before any work. A small
``scale_base`` brings the limits within reach of a CPU test (the limit is proportional to it).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from posformer.errors import PositionRangeError
from posformer.pe.rope.xpos import XPosEncoding
from tests.cli_cases import TINY, assert_clean_failure, eval_cli, train_cli

SCALE_BASE = 16.0  # limits: 124 positions in float16, 1,116 in float32


def _limit(dtype: torch.dtype, scale_base: float = SCALE_BASE, margin: float = 1.0) -> int:
    tiny = max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny)  # the tables are float32
    return int(scale_base * math.log(1 / (tiny * margin)) / math.log(1.4 / 0.4)) + 1


def _centred_limit(dtype: torch.dtype, scale_base: float = SCALE_BASE) -> int:
    """Centred: shifted positions within ``c`` of the origin, where the smaller factor keeps the 2^10
    margin over the smallest normal number; never fewer positions than uncentred."""
    return max(_limit(dtype, scale_base), 2 * _limit(dtype, scale_base, 2.0**10) - 1)


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
    """The centred limit ``m`` gives finite logits (float16 under autocast, as a GPU's 16-mixed; its
    range is too small for centring to gain: ``m = n``); one more is refused, naming the limit, the
    dtype and the fixes; with the check and the centring switched off, ``2m`` positions give
    non-finite logits (what both prevent)."""
    model = tiny_model("xpos", pe_options={"scale_base": SCALE_BASE})
    m = _centred_limit(dtype)
    assert (m > _limit(dtype)) is (dtype == torch.float32)

    def logits(length: int) -> torch.Tensor:
        ids = torch.randint(4, 13, (1, length))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float16):
            return model(ids)

    assert torch.isfinite(logits(m)).all()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        PositionRangeError,
        match=rf"represents {m} positions in {name}, but the input needs position {m} .*scale_base=16",
    ):
        logits(m + 1)
    model.pe.max_positions_in = lambda dtype, centred=False: None
    model.pe.rotary_origin = lambda length, dtype: 0
    assert not torch.isfinite(logits(2 * m)).all()


def test_the_origin_moves_only_past_the_uncentred_limit() -> None:
    """Up to ``n`` positions the origin is 0 (the paper's factors: runs within the range are unchanged);
    past it, the middle, so the shifted positions stay within ``c`` of it (the margin's own limit)."""
    pe = XPosEncoding(d_model=16, n_heads=2, causal=True, scale_base=SCALE_BASE)
    n, c = pe.max_positions_in(torch.float32), _limit(torch.float32, margin=2.0**10)
    t = pe.max_positions_in(torch.float32, centred=True)
    assert t == _centred_limit(torch.float32) == 2 * c - 1 and n < t < 2 * n - 1
    assert pe.rotary_origin(n, torch.float32) == 0 and pe.rotary_origin(n + 1, torch.float32) == (n + 1) // 2
    o = pe.rotary_origin(t, torch.float32)
    assert -o > -c and t - 1 - o < c
    assert pe.max_positions_in(torch.float16, centred=True) == pe.max_positions_in(torch.float16)
    default = XPosEncoding(d_model=16, n_heads=2, causal=True)  # scale_base 512: the 64k evaluation fits
    assert default.max_positions_in(torch.bfloat16, centred=True) >= 65536
    scaling = {"type": "dynamic", "factor": 2.0, "original_max_len": 64}
    dynamic = XPosEncoding(d_model=16, n_heads=2, causal=True, scale_base=SCALE_BASE, scaling=scaling)
    # dynamic NTK: its frequencies follow the largest position, so moving the origin would change them
    assert dynamic.rotary_origin(t, torch.float32) == 0
    assert dynamic.max_positions_in(torch.float32, centred=True) == n
    for base in ("rope", "alibi"):  # no other PE moves its origin
        from posformer.pe import build_encoding

        other = build_encoding(base, d_model=16, n_heads=2, causal=True)
        assert other.rotary_origin(10**6, torch.float16) == 0


def _exact_reference(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 with xPos' factors kept in float64 and measured from 0 (uncentred): the
    paper's scores, exact where float32 tables overflow (float64's range reaches ``e^709``)."""
    ref = copy.deepcopy(model).double()
    pe = ref.pe
    pe.decay = lambda positions, *, is_query: _decay64(pe, positions, is_query)
    pe.max_positions_in = lambda dtype, centred=False: None
    pe.rotary_origin = lambda length, dtype: 0
    return ref


def _decay64(pe: XPosEncoding, positions: torch.Tensor, is_query: bool) -> torch.Tensor:
    r = pe.rotary_dim
    zeta = (torch.arange(0, r, 2, dtype=torch.float64) / r + pe.gamma) / (1 + pe.gamma)  # (R/2,)
    power = positions.to(torch.float64).unsqueeze(-1) / pe.scale_base  # (B|1, T, 1)
    scale = zeta ** (power if is_query else -power)  # (B|1, T, R/2)
    return torch.cat((scale, scale), -1).unsqueeze(1)  # (B|1, 1, T, R): the half layout


@pytest.mark.parametrize("flush", [False, True], ids=["subnormals", "flushed"])
def test_centred_positions_give_the_papers_scores(tiny_model: Any, flush: bool) -> None:
    """Past the uncentred limit, up to the centred one, a float32 forward equals the paper's xPos
    computed exactly (float64 factors from origin 0) to 1e-5, with padding too, also where subnormals
    are flushed (posformer's CPU runs); uncentred the same forward is NaN. Centred without the margin
    (``2n - 1`` positions) the flushed forward is off at the window's ends: what the margin is for.
    Uncentred, at ``n`` positions, flushing costs up to 1e-3 (the limit has no margin, as before)."""
    model = tiny_model("xpos", pe_options={"scale_base": SCALE_BASE})
    ref = _exact_reference(model)
    n, t = _limit(torch.float32), _centred_limit(torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(4, 13, (2, t))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, -300:] = False  # a right-padded row
    torch.set_flush_denormal(flush)
    try:
        with torch.no_grad():
            got, want = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
            assert torch.isfinite(got[mask]).all()
            torch.testing.assert_close(got[mask].double(), want[mask], rtol=1e-5, atol=1e-5)
            short = ids[:, :n]  # uncentred up to n, as before: no margin, so flushing costs a little there
            tol = 1e-3 if flush else 1e-5
            torch.testing.assert_close(model(short).double(), ref(short), rtol=tol, atol=tol)
            model.pe.max_positions_in = lambda dtype, centred=False: None  # no limit: 2n - 1, centred
            model.pe.rotary_origin = lambda length, dtype: length // 2
            wide = torch.randint(4, 13, (1, 2 * n - 1))
            error = (model(wide).double() - ref(wide)).abs().max()
            assert error > 1e-2 if flush else error < 1e-5
            model.pe.rotary_origin = lambda length, dtype: 0
            assert not torch.isfinite(model(ids, attention_mask=mask)[mask]).all()
    finally:
        torch.set_flush_denormal(False)


def test_cached_decoding_keeps_the_uncentred_limit(tiny_model: Any) -> None:
    """A KV cache stores rotated keys, so decoding keeps origin 0 and refuses past ``n`` (the same
    tokens without a cache are fine, centred)."""
    model = tiny_model("xpos", pe_options={"scale_base": 1.0})  # float32: 70 positions, 129 centred
    ids = torch.randint(4, 13, (1, 71))
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()
        with pytest.raises(PositionRangeError, match="represents 70 positions in float32"):
            model(ids, cache=model.new_cache())
        cache = model.new_cache()
        model(ids[:, :70], cache=cache)
        with pytest.raises(PositionRangeError, match="represents 70 positions in float32"):
            model(ids[:, 70:], cache=cache)


def test_packed_rows_past_the_range_read_their_true_top(tiny_model: Any) -> None:
    """A bound is not the largest position: packed documents restart at 0, so rows longer than the
    limit whose documents are shorter are fine (the tensor is read once the bound reaches the limit);
    packed rows are not centred, so a longer document is refused at the uncentred limit."""
    model = tiny_model("xpos", pe_options={"scale_base": 1.0})  # float32: 70 positions, 129 centred
    assert model.pe.max_positions_in(torch.float32) == 70
    two = (torch.arange(200) // 100).unsqueeze(0)  # two documents of 100 tokens
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(4, 13, (1, 100)), segment_ids=two[:, ::2])).all()
        with pytest.raises(PositionRangeError, match="represents 70 positions in float32"):
            model(torch.randint(4, 13, (1, 200)), segment_ids=two)
        with pytest.raises(PositionRangeError, match="represents 129 positions in float32"):
            model(torch.randint(4, 13, (1, 130)))


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
    """Training fits (``scale_base=1``: 70 positions); the evaluation length 40 (83 tokens) is past
    that but within the centred range (129) and gets a finite loss; length 70 (143 tokens) does not
    fit: its row says so instead of a NaN perplexity; posformer-eval of the run does the same."""
    import json

    run = tmp_path / "run"
    args = ["pe=xpos", "model.pe_options.scale_base=1", "data.eval_lengths=[4,40,70]"]
    code, text = train_cli(
        args, run, cache_dir, monkeypatch, capsys, tiny=[*TINY, "callbacks.model_checkpoint.monitor=null"]
    )
    assert code == 0, text[-3000:]
    rows = {r["length"]: r for r in json.loads((run / "results.json").read_text())["results"]}
    assert math.isfinite(rows[4]["loss"]) and math.isfinite(rows[40]["loss"]), rows
    assert "PE has 129" in rows[70]["note"], rows
    out = tmp_path / "eval"
    ckpt = run / "checkpoints" / "last.ckpt"
    code, text = eval_cli(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4,40,70]", "trainer=cpu"], out, monkeypatch, capsys
    )
    assert code == 0, text[-3000:]
    rows = {r["length"]: r for r in json.loads((out / "extrapolation.json").read_text())["results"]}
    for length in (4, 40):
        assert rows[length]["status"] == "ok" and math.isfinite(rows[length]["loss"]), rows[length]
    assert rows[70]["status"] == "n/a" and rows[70].get("loss") is None, rows[70]
    reason = rows[70]["reason"]
    assert "represents 129 positions in float32" in reason and "scale_base=1" in reason
