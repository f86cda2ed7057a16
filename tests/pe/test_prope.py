"""p-RoPE (proportional RoPE, Gemma 4): ``model.pe_options.proportion``.

The frequencies keep their exponents over all rotated dims, ``θ_i = base^(-2i/R)``, and the slowest
``R/2 - int(p·R//2)`` are zeroed (their pairs pass through unrotated). Checked against a float64
formula always and against HF's ``proportional`` rope init (frequencies and the rotation applied to q)
when transformers is installed; not the same thing as ``rotary_fraction``.
"""

from __future__ import annotations

import pytest
import torch

from posformer.errors import ConfigError
from posformer.pe import build_encoding


def prope(head_dim: int = 32, proportion: float = 0.25, n_heads: int = 2, **kw):
    return build_encoding(
        "rope", d_model=head_dim * n_heads, n_heads=n_heads, causal=True, proportion=proportion, **kw
    )


def formula(head_dim: int, proportion: float, base: float) -> torch.Tensor:
    """float64 reference: base^(-2i/Dh) for i < int(p·Dh//2), 0 for the rest (Dh/2,)."""
    k = int(proportion * head_dim // 2)
    out = torch.zeros(head_dim // 2, dtype=torch.float64)
    for i in range(k):
        out[i] = base ** (-2.0 * i / head_dim)
    return out


@pytest.mark.parametrize("head_dim,proportion,base", [(32, 0.25, 10000.0), (16, 0.5, 1e6), (64, 0.3, 500.0)])
def test_frequencies_match_the_float64_formula(head_dim, proportion, base):
    inv_freq, factor, _ = prope(head_dim, proportion, base=base).frequencies(8)
    assert inv_freq.dtype == torch.float64 and factor == 1.0
    torch.testing.assert_close(inv_freq, formula(head_dim, proportion, base), rtol=1e-15, atol=0)
    assert int((inv_freq > 0).sum()) == int(proportion * head_dim // 2)


def test_proportion_one_is_plain_rope_bitwise(tiny_model):
    plain, explicit = tiny_model("rope"), tiny_model("rope", pe_options={"proportion": 1.0})
    ids = torch.randint(3, 13, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(plain(ids), explicit(ids))
    assert plain.pe.rotary_key(9) == explicit.pe.rotary_key(9)  # same cache key: same shared tables


def test_zeroed_pairs_pass_through_and_scores_stay_relative():
    pe = prope(head_dim=16, proportion=0.5, n_heads=1)  # 8 pairs, the first 4 rotate
    x = torch.randn(1, 1, 5, 16, dtype=torch.float64)  # (B, H, T, Dh)
    pos = torch.tensor([[0, 7, 100, 1000, 12345]])
    y = pe.apply_rotary(x, pe.rotary_tables(pos, is_query=True))
    still = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])  # half layout: pair i is (i, i + 8)
    moved = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
    assert torch.equal(y[..., still], x[..., still])  # cos 0 = 1, sin 0 = 0: bit for bit
    assert not torch.allclose(y[0, 0, 1:][:, moved], x[0, 0, 1:][:, moved])
    # q·k depends on m - n only
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        rq = pe.apply_rotary(q, pe.rotary_tables(torch.tensor([[m]]), is_query=True))
        rk = pe.apply_rotary(k, pe.rotary_tables(torch.tensor([[n]]), is_query=False))
        return (rq * rk).sum()

    torch.testing.assert_close(score(10, 3), score(507, 500), rtol=0, atol=1e-5)


def test_differs_from_rotary_fraction():
    """rotary_fraction=0.25 respaces the exponents over R = Dh/4 (slowest ≈ 1/base, reached in 4 pairs);
    proportion=0.25 keeps them over Dh (slowest kept = base^(-2·3/32)) and zeroes the rest."""
    base = 10000.0
    frac = build_encoding("rope", d_model=64, n_heads=2, causal=True, rotary_fraction=0.25, base=base)
    prop = prope(32, 0.25, base=base)
    f_frac, f_prop = frac.frequencies(8)[0], prop.frequencies(8)[0]
    assert f_frac.shape == (4,) and f_prop.shape == (16,)
    torch.testing.assert_close(f_frac[-1], torch.tensor(base ** (-6 / 8), dtype=torch.float64))
    torch.testing.assert_close(f_prop[3], torch.tensor(base ** (-6 / 32), dtype=torch.float64))
    assert f_prop[0] == f_frac[0] == 1.0 and not torch.allclose(f_frac, f_prop[:4])


def test_linear_scaling_divides_the_kept_frequencies():
    inv, _, key = prope(32, 0.25, scaling={"type": "linear", "factor": 4.0}).frequencies(8)
    torch.testing.assert_close(inv, formula(32, 0.25, 10000.0) / 4, rtol=1e-15, atol=0)
    assert key != prope(32, 0.25).frequencies(8)[2] != prope(32, 1.0).frequencies(8)[2]


@pytest.mark.parametrize(
    "proportion,match",
    [
        (0.0, r"proportion=0\.0.*\(0, 1\]"),
        (1.5, r"proportion=1\.5"),
        (0.01, r"proportion=0\.01.*= 0 of the 16.*at least 0\.0625"),
    ],
)
def test_bad_proportion_is_one_line(proportion, match):
    with pytest.raises(ConfigError, match=match) as info:
        prope(32, proportion)
    assert "\n" not in str(info.value)


def test_cached_decoding_equals_full_forward(tiny_model):
    model = tiny_model("rope", n_layers=2, d_model=32, n_heads=2, pe_options={"proportion": 0.5}).double()
    ids = torch.randint(3, 13, (2, 10), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(ids[:, :2], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(2, 10)]
        for t, out in enumerate(steps[1:], start=3):
            torch.testing.assert_close(out[:, -1], model(ids[:, :t])[:, -1], rtol=0, atol=1e-9)


# ------------------------------------------------------------------------------ against HF
def hf_proportional(head_dim: int, proportion: float, base: float, factor: float | None = None):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if "proportional" not in ROPE_INIT_FUNCTIONS:
        pytest.skip(f"transformers {transformers.__version__} has no proportional rope type")
    params = {"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": proportion}
    if factor is not None:
        params["factor"] = factor
    cfg = transformers.PretrainedConfig(hidden_size=2 * head_dim, num_attention_heads=2)
    cfg.rope_parameters = params
    cfg.head_dim = head_dim
    return ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu")


@pytest.mark.parametrize(
    "head_dim,proportion,base,factor",
    [
        (32, 0.25, 1e6, None),
        (256, 0.25, 1e6, None),
        (16, 0.5, 10000.0, None),
        (64, 0.75, 10000.0, 8.0),
    ],
)
def test_frequencies_match_hf_proportional(head_dim, proportion, base, factor):
    hf_inv, hf_factor = hf_proportional(head_dim, proportion, base, factor)
    scaling = {"type": "linear", "factor": factor} if factor else None
    inv, ours_factor, _ = prope(head_dim, proportion, base=base, scaling=scaling).frequencies(16)
    assert hf_inv.shape == inv.shape and ours_factor == hf_factor
    assert torch.equal(hf_inv == 0, inv == 0)  # the same frequencies are zeroed
    torch.testing.assert_close(inv.float(), hf_inv, rtol=1e-6, atol=0)  # HF computes in float32


def test_rotation_matches_hf_apply_rotary_pos_emb():
    """HF's Gemma-style rotation (cat(freqs, freqs), rotate_half over the full head) on q and k."""
    hf_inv, _ = hf_proportional(32, 0.25, 1e4)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    pos = torch.arange(0, 600, 37).unsqueeze(0)  # (1, T)
    freqs = pos.double().unsqueeze(-1) * hf_inv.double()  # (1, T, Dh/2)
    emb = torch.cat((freqs, freqs), -1)
    q, k = torch.randn(1, 2, pos.shape[1], 32), torch.randn(1, 2, pos.shape[1], 32)  # (B, H, T, Dh)
    hq, hk = apply_rotary_pos_emb(q, k, emb.cos().float(), emb.sin().float())
    pe = prope(32, 0.25)
    ours_q = pe.apply_rotary(q, pe.rotary_tables(pos, is_query=True))
    ours_k = pe.apply_rotary(k, pe.rotary_tables(pos, is_query=False))
    # HF's frequencies are float32 (relative rounding 6e-8 x angles up to 555 rad): 1e-4, not 1e-6
    torch.testing.assert_close(ours_q, hq, rtol=0, atol=1e-4)
    torch.testing.assert_close(ours_k, hk, rtol=0, atol=1e-4)
    assert torch.equal(ours_q[..., 4:16], q[..., 4:16]) and not torch.allclose(ours_q[..., :4], q[..., :4])
