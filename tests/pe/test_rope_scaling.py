"""Rotary context-extension scalings against frequencies computed by hand from each formula.

Setting: rotary_dim R = 8 (d_model 16, 2 heads), base 10000, so the unscaled frequencies are
θ_i = 10000^(-2i/8) = 1, 0.1, 0.01, 0.001 (wavelengths 2π/θ_i = 6.28, 62.8, 628, 6283).
"""

from __future__ import annotations

import math

import pytest
import torch

from posformer.errors import ConfigError
from posformer.pe import build_encoding

THETA = [1.0, 0.1, 0.01, 0.001]


def rope(scaling=None, pe="rope", **kw):
    return build_encoding(pe, d_model=16, n_heads=2, causal=True, scaling=scaling, **kw)


def freqs(scaling, seq_len=16, pe="rope"):
    inv, factor, key = rope(scaling, pe=pe).frequencies(seq_len)
    return inv.tolist(), factor, key


def test_unscaled():
    inv, factor, _ = freqs(None)
    assert inv == pytest.approx(THETA, rel=1e-12) and factor == 1.0


def test_linear_position_interpolation():
    inv, factor, _ = freqs({"type": "linear", "factor": 4})
    assert inv == pytest.approx([0.25, 0.025, 0.0025, 0.00025], rel=1e-12) and factor == 1.0
    # equivalently: positions divided by s
    r_lin, r0 = rope({"type": "linear", "factor": 4}), rope()
    x = torch.randn(1, 2, 12, 8)
    pos = torch.arange(12).unsqueeze(0)
    torch.testing.assert_close(r_lin.rotate(x, pos, is_query=True), r0.rotate(x, pos / 4.0, is_query=True))


def test_ntk_aware():
    # base' = 10000 * 4^(8/6)
    base = 10000 * 4 ** (8 / 6)
    inv, factor, _ = freqs({"type": "ntk", "factor": 4})
    assert inv == pytest.approx([1.0, base**-0.25, base**-0.5, base**-0.75], rel=1e-12) and factor == 1.0
    # the highest frequency is kept, the lowest is interpolated by exactly s
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(0.001 / 4, rel=1e-12)


def test_dynamic_ntk_unchanged_up_to_the_original_length():
    cfg = {"type": "dynamic_ntk", "factor": 2, "original_max_len": 16}
    for T in (1, 8, 16):
        inv, factor, _ = freqs(cfg, seq_len=T)
        assert inv == pytest.approx(THETA, rel=1e-12) and factor == 1.0
    # T = 32: base' = 10000 * (2 * 32/16 - 1)^(8/6) = 10000 * 3^(4/3)
    base = 10000 * 3 ** (4 / 3)
    inv, _, _ = freqs(cfg, seq_len=32)
    assert inv == pytest.approx([1.0, base**-0.25, base**-0.5, base**-0.75], rel=1e-12)
    # the rotation of the first 16 positions is the unscaled one
    r, r0 = rope(cfg), rope()
    x = torch.randn(1, 2, 16, 8)
    pos = torch.arange(16).unsqueeze(0)
    torch.testing.assert_close(r.rotate(x, pos, is_query=True), r0.rotate(x, pos, is_query=True))
    # the cache key depends on the length past L only
    assert rope(cfg).frequencies(8)[2] == rope(cfg).frequencies(16)[2] != rope(cfg).frequencies(32)[2]


def test_yarn():
    # L = 2048. Reference ramp (Peng et al.'s code, HF): correction dim d(r) = R ln(L / (2π r)) / (2 ln base)
    # d(32) = 8 ln(2048 / 64π) / (2 ln 1e4) = 1.008 -> floor 1;  d(1) = 8 ln(2048 / 2π) / (2 ln 1e4) = 2.513
    # -> ceil 3
    # ramp_i = clamp((i - 1) / (3 - 1), 0, 1) = [0, 0, 0.5, 1]; γ_i = 1 - ramp_i = [1, 1, 0.5, 0]
    # θ'_i = θ_i / s (1 - γ_i) + θ_i γ_i with s = 4
    assert 8 * math.log(2048 / (64 * math.pi)) / (2 * math.log(1e4)) == pytest.approx(1.008, abs=1e-3)
    assert 8 * math.log(2048 / (2 * math.pi)) / (2 * math.log(1e4)) == pytest.approx(2.513, abs=1e-3)
    cfg = {"type": "yarn", "factor": 4, "original_max_len": 2048}
    inv, factor, _ = freqs(cfg)
    assert inv == pytest.approx([1.0, 0.1, 0.5 * 0.01 / 4 + 0.5 * 0.01, 0.001 / 4], rel=1e-12)
    assert factor == pytest.approx(0.1 * math.log(4) + 1)  # attention temperature sqrt(1/t)
    # the factor scales cos and sin, so |rotated| = factor * |x| on the rotary dims (logits by factor^2)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64).float()
    out = rope(cfg).rotate(x, torch.arange(5).unsqueeze(0), is_query=True)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1) * factor)
    # explicit attention_factor and beta overrides
    assert freqs({**cfg, "attention_factor": 1.0})[1] == 1.0
    inv_b, _, _ = freqs({**cfg, "beta_fast": 1e6, "beta_slow": 0.5})  # low = 0, high = ceil(d(0.5)) = 3
    assert inv_b[0] == 1.0 and inv_b[3] == pytest.approx(0.001 / 4)
    assert inv_b[1] == pytest.approx(0.1 / 4 * (1 / 3) + 0.1 * (2 / 3))


def test_llama3():
    # L = 1024, s = 8, low_freq_factor 1, high_freq_factor 4: wavelengths > 1024 are divided by s,
    # < 256 kept, in between smoothed with smooth = (L/λ - 1) / (4 - 1).
    cfg = {"type": "llama3", "factor": 8, "original_max_len": 1024}
    inv, factor, _ = freqs(cfg)
    lam2 = 2 * math.pi / 0.01  # 628.3: the medium band
    smooth = (1024 / lam2 - 1) / 3
    assert inv == pytest.approx([1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8], rel=1e-12)
    assert factor == 1.0
    # low_freq_factor 2, high 8: wavelengths > 512 divided by s (628 now is), < 128 kept, no medium band here
    inv2, _, _ = freqs({**cfg, "low_freq_factor": 2.0, "high_freq_factor": 8.0})
    assert inv2 == pytest.approx([1.0, 0.1, 0.01 / 8, 0.001 / 8], rel=1e-12)
    # L = 8192 (Llama 3.1): λ = 628 < 8192/4 is kept, 6283 is in [2048, 8192] -> smoothed
    inv3, _, _ = freqs({**cfg, "original_max_len": 8192})
    smooth3 = (8192 / (2 * math.pi / 0.001) - 1) / 3
    assert inv3 == pytest.approx([1.0, 0.1, 0.01, (1 - smooth3) * 0.001 / 8 + smooth3 * 0.001], rel=1e-12)


@pytest.mark.parametrize("pe", ["rope", "xpos"])
def test_frequency_keys_and_angles_follow_the_scaling(pe):
    r = rope(None, pe=pe)
    pos = torch.arange(10).unsqueeze(0)
    cos0, _ = r.cos_sin(pos)
    keys = {freqs(None, pe=pe)[2]}
    for cfg in (
        {"type": "linear", "factor": 2},
        {"type": "linear", "factor": 4},
        {"type": "ntk", "factor": 2},
        {"type": "yarn", "factor": 2, "original_max_len": 64},
        {"type": "yarn", "factor": 2, "original_max_len": 128},
        {"type": "llama3", "factor": 2, "original_max_len": 64},
    ):
        keys.add(freqs(cfg, pe=pe)[2])
        r.scaling = cfg  # nothing computed under another scaling may be reused
        cos, _ = r.cos_sin(pos)
        assert not torch.allclose(cos, cos0)
    assert len(keys) == 7
    r.scaling = None
    torch.testing.assert_close(r.cos_sin(pos)[0], cos0)


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"type": "bogus", "factor": 2}, "unknown scaling.type"),
        ({"type": "linear", "factor": 0.5}, "factor"),
        ({"type": "linear"}, "factor"),
        ({"type": "yarn", "factor": 2}, "original_max_len"),
        ({"type": "dynamic_ntk", "factor": 2}, "original_max_len"),
        ({"type": "llama3", "factor": 2}, "original_max_len"),
    ],
)
def test_invalid_scaling(cfg, match):
    with pytest.raises(ConfigError, match=match):
        rope(cfg)


def test_no_scaling_type_none():
    inv, factor, _ = freqs({"type": "none"})
    assert inv == pytest.approx(THETA) and factor == 1.0


# ------------------------------------------------------------------------------------ cached decoding
SCALINGS = {
    "none": None,
    "linear": {"type": "linear", "factor": 4},
    "ntk": {"type": "ntk", "factor": 4},
    "dynamic_ntk": {"type": "dynamic_ntk", "factor": 4, "original_max_len": 4},
    "yarn": {"type": "yarn", "factor": 4, "original_max_len": 4},
    "llama3": {"type": "llama3", "factor": 4, "original_max_len": 4},
    "longrope": {
        "type": "longrope",
        "factor": 4,
        "original_max_len": 4,
        "short_factor": [1.0, 1.0, 1.5, 2.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
    },
}
#: scalings whose frequencies change with the sequence length (the cache is replayed for them)
LENGTH_DEPENDENT = {"dynamic_ntk", "longrope"}


def test_every_scaling_type_is_checked_for_cached_decoding():
    from posformer.pe.rope.scaling import ROPE_SCALINGS

    assert set(SCALINGS) - {"none"} == set(ROPE_SCALINGS)


@pytest.mark.parametrize("pe", ["rope", "xpos"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_cached_decoding_equals_full_forward(pe, scaling, tiny_model):
    """Token-by-token decoding with the KV cache gives the full forward's logits at every step (to 1e-5),
    for every scaling, including dynamic NTK (whose frequencies change as the sequence grows past
    original_max_len = 4: its keys are cached unrotated and rotated at use)."""
    model = tiny_model(pe, n_layers=2).double()
    cfg = SCALINGS[scaling]
    for m in model.modules():
        if hasattr(m, "set_scaling") and getattr(m, "caps", None) is not None and m.caps.rotary_scalable:
            m.set_scaling(cfg)
    assert model.pe.caps.rotary_depends_on_length == (scaling in LENGTH_DEPENDENT)
    ids = torch.randint(3, 13, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    with torch.no_grad():
        prefix = model(ids[:, :2], cache=cache)  # a 2-token prompt, then one token per step
        steps = [prefix] + [model(ids[:, t : t + 1], cache=cache) for t in range(2, 12)]
        for t, out in enumerate(steps[1:], start=3):
            full = model(ids[:, :t])  # (B, t, V)
            torch.testing.assert_close(out[:, -1], full[:, -1], rtol=0, atol=1e-5)


def test_dynamic_ntk_capability_follows_set_scaling():
    r = rope({"type": "dynamic_ntk", "factor": 2, "original_max_len": 8})
    assert r.caps.rotary_depends_on_length
    r.set_scaling({"type": "yarn", "factor": 2, "original_max_len": 8})
    assert not r.caps.rotary_depends_on_length
    r.set_scaling(None)
    assert not r.caps.rotary_depends_on_length and not type(r).capabilities.rotary_depends_on_length


def test_cached_decoding_equals_full_forward_encoder_decoder_dynamic_ntk(tiny_model):
    model = tiny_model("rope", kind="encoder_decoder", n_decoder_layers=2).double()
    model.pe_dec.set_scaling(SCALINGS["dynamic_ntk"])
    assert model.pe_dec.caps.rotary_depends_on_length
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 13, (2, 5), generator=g), torch.randint(3, 13, (2, 9), generator=g)
    with torch.no_grad():
        memory = model.encode(src)
        cache = model.new_cache()
        for t in range(9):
            step = model.decode(tgt[:, t : t + 1], memory, cache=cache)
            full = model.decode(tgt[:, : t + 1], memory)
            torch.testing.assert_close(step[:, -1], full[:, -1], rtol=0, atol=1e-5)
