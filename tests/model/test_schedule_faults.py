"""Bad per-layer schedules through the real ``posformer-train`` (in-process): each is refused in one line
naming the value, the limit and the fix, before any work, leaving the run dir's earlier files as they
were: windows too wide for an integer, kind names that are not names (a dot, a slash), temperatures that
are negative or overflow, settings the kind ignores, and a ``model.pe`` that no layer of a preset trains.
"""

from __future__ import annotations

import json

import pytest

from tests.cli_cases import QUIET, TINY_DATA, TINY_TRAINING, assert_untouched, one_clear_line, train_cli

#: the presets' layer counts kept (their patterns need them), the width shrunk
SMALL = [*TINY_DATA, *TINY_TRAINING, *QUIET, "model.d_model=16", "model.n_heads=2", "model.d_ff=32"]

CASES = {
    "window_beyond_an_integer": (
        ["model=decoder_gemma3", "model.layer_kinds.local.span.window=99999999999999999999999"],
        ["span.window=99999999999999999999999", "positive integer up to 2147483647", "span: full"],
    ),
    "kind_name_with_a_dot": (
        ["model=decoder_gemma3", "+model.layer_kinds={a.b: {pe: rope}}", "model.layers.pattern=[a.b]"],
        ["kind named 'a.b'", "no dot or slash", "e.g. 'a_b'"],
    ),
    "kind_name_with_a_slash": (
        ["model=decoder_gemma3", "+model.layer_kinds={a/b: {pe: rope}}", "model.layers.pattern=[a/b]"],
        ["kind named 'a/b'", "no dot or slash", "e.g. 'a_b'"],
    ),
    "negative_temperature": (
        ["model=decoder_irope", "model.layer_kinds.nope_global.temperature.attn_scale=-1e30"],
        ["temperature.attn_scale=-1e+30", "from 0 (exclusive) to 100", "attn_scale=0.1"],
    ),
    "overflowing_temperature": (
        ["model=decoder_irope", "model.layer_kinds.nope_global.temperature.attn_scale=1e300"],
        ["temperature.attn_scale=1e+300", "from 0 (exclusive) to 100", "NaN"],
    ),
    "vanishing_floor_scale": (
        ["model=decoder_irope", "model.layer_kinds.nope_global.temperature.floor_scale=1e-300"],
        ["temperature.floor_scale=1e-300", "from 1 to", "floor_scale=8192"],
    ),
    "setting_the_kind_ignores": (
        ["model=decoder_irope", "+model.layer_kinds.nope_global.temperature.scale=3"],
        ["temperature.scale=3 has no effect for kind=llama4", "floor_scale, attn_scale", "kind=logn"],
    ),
    "alibi_over_irope": (
        ["model=decoder_irope", "pe=alibi"],
        ["model.pe='alibi' trains no layer", "rope_chunked: rope, nope_global: nope", "Drop pe=alibi"],
    ),
    "alibi_over_gemma3": (
        ["model=decoder_gemma3", "pe=alibi"],
        ["model.pe='alibi' trains no layer", "local: rope, global: rope", "model=decoder_tiny"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_schedule_is_one_line_before_any_work(case, out_dir, cache_dir, monkeypatch, capsys):
    overrides, needles = CASES[case]
    code, text = train_cli(overrides, out_dir, cache_dir, monkeypatch, capsys, tiny=SMALL)
    one_clear_line(code, text, code or 1, *needles)
    assert code != 0
    assert "loss became nan" not in text and "parameters, seed" not in text  # refused before the model
    assert_untouched(out_dir)
    assert not list(out_dir.rglob("*.png"))


def test_a_preset_with_its_own_pe_trains_and_is_labelled_by_it(tmp_path, cache_dir, monkeypatch, capsys):
    run = tmp_path / "run"
    code, text = train_cli(["model=decoder_irope"], run, cache_dir, monkeypatch, capsys, tiny=SMALL)
    assert code == 0, text[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["pe_schedule"] == "rope×3+nope×1"
