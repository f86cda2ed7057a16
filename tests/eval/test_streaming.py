"""StreamingLLM-style evaluation (posformer.eval.streaming): sinks + a recent window per scored token.

Checked against an explicit reference (one forward per target over the kept tokens, built with plain
Python lists), against ``nonoverlap`` when the cache holds the whole window, and through the harness
(``eval.streaming``) with a PE that cannot represent long positions (a learned table).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posformer.errors import ConfigError
from posformer.eval.harness import evaluate_subjects
from posformer.eval.settings import EvalSettings, Subject
from posformer.eval.streaming import STREAMING, StreamingSpec, parse_streaming, score_streaming
from posformer.eval.windows import nonoverlap_windows, score_lm_windows, sliding_windows


def reference_nll(model, stream: torch.Tensor, windows, spec: StreamingSpec) -> tuple[float, int]:
    """Explicit StreamingLLM: for every scored target, the kept tokens of its window and their positions."""
    total, count = 0.0, 0
    for w in windows:
        for t in range(w.length - w.n_scored, w.length):
            if t < spec.budget:
                kept = list(range(t + 1))
            else:
                kept = list(range(spec.sink)) + list(range(t - spec.window + 1, t + 1))
            positions = kept if spec.positions == "original" else list(range(len(kept)))
            ids = stream[[w.start + k for k in kept]].unsqueeze(0)  # (1, T)
            with torch.no_grad():
                logits = model(ids, positions=torch.tensor([positions]))  # (1, T, V)
            target = stream[w.start + t + 1]
            total += float(F.cross_entropy(logits[0, -1:].double(), target.view(1)))
            count += 1
    return total, count


@pytest.mark.parametrize("pe", ["rope", "alibi", "nope"])
@pytest.mark.parametrize("positions", ["cache", "original"])
def test_matches_the_explicit_reference(pe, positions, tiny_model):
    model = tiny_model(pe, n_layers=2).double()
    stream = torch.randint(3, 13, (40,), generator=torch.Generator().manual_seed(0))
    spec = StreamingSpec(sink=2, window=5, positions=positions)
    for windows in (nonoverlap_windows(39, 16), sliding_windows(39, 16, 6)):
        out = score_streaming(model, stream, windows, spec=spec, batch=2)
        ref, count = reference_nll(model, stream, windows, spec)
        assert out["scored_tokens"] == count == 39  # every target once
        assert out["nll_sum"] == pytest.approx(ref, rel=1e-7)  # the scorer takes float32 logits


def test_cache_positions_differ_from_original_for_rope(tiny_model):
    model = tiny_model("rope").double()
    stream = torch.randint(3, 13, (33,), generator=torch.Generator().manual_seed(1))
    windows = nonoverlap_windows(32, 32)
    cache = score_streaming(model, stream, windows, spec=StreamingSpec(2, 5, "cache"), batch=1)
    orig = score_streaming(model, stream, windows, spec=StreamingSpec(2, 5, "original"), batch=1)
    assert cache["nll_sum"] != pytest.approx(orig["nll_sum"], rel=1e-6)


def test_a_cache_as_long_as_the_window_is_nonoverlap_bitwise(tiny_model):
    model = tiny_model("rope")
    stream = torch.randint(3, 13, (65,), generator=torch.Generator().manual_seed(2))
    windows = nonoverlap_windows(64, 16)
    ref = score_lm_windows(model, stream, windows, batch=3)
    with torch.no_grad():
        out = score_streaming(model, stream, windows, spec=StreamingSpec(4, 12), batch=3)
    assert out["nll_sum"] == ref["nll_sum"] and out["scored_tokens"] == ref["scored_tokens"] == 64


def test_batching_does_not_change_the_score(tiny_model):
    model = tiny_model("alibi").double()
    stream = torch.randint(3, 13, (50,), generator=torch.Generator().manual_seed(3))
    windows, spec = nonoverlap_windows(49, 24), StreamingSpec(1, 6)
    one, many = (score_streaming(model, stream, windows, spec=spec, batch=b) for b in (1, 4))
    assert one["nll_sum"] == pytest.approx(many["nll_sum"], rel=1e-12)
    assert one["n_forwards"] == 2 * (1 + 24 - 7) + 1  # per window of 24: a prefix + one per token past 7; + 1


@pytest.mark.parametrize(
    "value,match",
    [
        ({"sink": -1, "window": 4}, r"eval\.streaming\.sink=-1 must be an integer >= 0"),
        ({"sink": 4}, r"eval\.streaming\.window=None must be an integer >= 1"),
        ({"sink": 4, "window": 8, "positons": "cache"}, r"unknown key\(s\) \['positons'\]"),
        ({"window": 8, "positions": "absolute"}, r"positions='absolute' must be one of cache, original"),
        (7, r"eval\.streaming=7 must be a mapping or null"),
    ],
)
def test_bad_specs_are_one_line_before_any_work(value, match, read_extrapolate):
    with pytest.raises(ConfigError, match=match) as info:
        read_extrapolate(streaming=value)
    assert "\n" not in str(info.value)
    assert parse_streaming({"window": 8}) == StreamingSpec(4, 8, "cache")  # sink defaults to 4
    assert parse_streaming(None) is None and parse_streaming({}) is None


def test_modes_need_the_spec():
    with pytest.raises(ConfigError, match=r"eval\.modes.*streaming.*eval\.streaming"):
        EvalSettings(lengths=[8], modes=("streaming",))
    settings = EvalSettings(lengths=[8], streaming={"sink": 1, "window": 3})
    assert settings.modes == ("nonoverlap", "sliding", STREAMING)  # the spec adds the mode


def test_harness_rows_with_cache_positions_past_a_learned_table(tmp_path, tiny_model):
    """A learned table of 12 positions cannot read 24 tokens; through a cache of 2 + 10 it can (cache
    positions), while original positions still reach 23 and the row is n/a with the PE's reason."""
    model = tiny_model("learned", pe_options={"max_len": 12})
    stream = torch.randint(3, 13, (97,), generator=torch.Generator().manual_seed(4))
    rows = {}
    for positions in ("cache", "original"):
        settings = EvalSettings(
            lengths=[12, 24],
            modes=("nonoverlap",),
            n_tokens=96,
            progress=False,
            streaming={"sink": 2, "window": 10, "positions": positions},
        )
        out = tmp_path / positions
        subject = Subject(label="learned", model=model, task_type="lm", data=stream, train_len=12)
        results = evaluate_subjects([subject], settings, out, tensorboard=False, plots=False)
        rows[positions] = {(r["mode"], r["length"]): r for r in results.rows}
    cache, orig = rows["cache"], rows["original"]
    assert cache[("nonoverlap", 24)]["status"] == "n/a"  # the table is too short for a plain window
    assert cache[(STREAMING, 24)]["status"] == "ok" and math.isfinite(cache[(STREAMING, 24)]["ppl"])
    assert cache[(STREAMING, 24)]["scored_tokens"] == 96
    assert orig[(STREAMING, 24)]["status"] == "n/a" and "12" in orig[(STREAMING, 24)]["reason"]
    # at 12 = sink + window the cache holds every window: streaming is nonoverlap
    assert cache[(STREAMING, 12)]["ppl"] == cache[("nonoverlap", 12)]["ppl"]
    assert "## streaming" in (tmp_path / "cache" / "extrapolation.md").read_text()
