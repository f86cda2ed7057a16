"""PoPE (polar coordinate positions, ``pe=pope``): the reference, the formula, the model paths.

Checked against x-transformers' ``PolarEmbedding`` + ``apply_polar_pos_emb`` on copied weights (the
phase bias and the frequencies), against a float64 formula of the paper's score, and in the model:
fused attention, cached decoding equal to the full forward, bad options refused in one line.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.model import attention
from posformer.pe import build_encoding
from posformer.pe.rope.polar import PolarEncoding

H, DH = 4, 16


def pope(seed: int = 0, **kw) -> PolarEncoding:
    """A PoPE of H heads of DH dims with a phase bias off zero (uniform over its range)."""
    torch.manual_seed(seed)
    return build_encoding("pope", d_model=H * DH, n_heads=H, causal=True, bias_init="uniform", **kw)


@pytest.mark.parametrize("length", [64, 1024])
def test_equals_x_transformers_apply_polar_pos_emb(length: int) -> None:
    """q and k equal x-transformers' ``apply_polar_pos_emb`` (float64 angles, copied δ and θ) within 1e-6;
    the query carries √2 (attention divides by √(2·Dh)), so the scores equal its ``q·k/√Dh``."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    pe = pope()
    ref = xt.PolarEmbedding(DH, H).double()
    with torch.no_grad():
        ref.learned_bias.copy_(pe.phase_bias.view(H, 1, DH))
        ref.inv_freq.copy_(pe.inv_freq())
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, H, length, DH, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(length)
    freqs, bias = ref(pos)
    q_ref, k_ref = xt.apply_polar_pos_emb(q, freqs), xt.apply_polar_pos_emb(k, freqs + bias)  # (2, H, T, 2Dh)
    q_out = pe.rotate(q, pos[None], is_query=True)
    k_out = pe.rotate(k, pos[None], is_query=False)
    assert q_out.shape == k_out.shape == (2, H, length, 2 * DH)
    assert (q_out / math.sqrt(2) - q_ref).abs().max() < 1e-6
    assert (k_out - k_ref).abs().max() < 1e-6
    scores = q_out @ k_out.transpose(-1, -2) / math.sqrt(2 * DH)  # what attention computes
    scores_ref = q_ref @ k_ref.transpose(-1, -2) * DH**-0.5  # x-transformers' Attend (scale dim_head**-0.5)
    assert (scores - scores_ref).abs().max() < 1e-5 * scores_ref.abs().max()


def test_scores_are_the_float64_formula() -> None:
    """``Σ_c softplus(q_c)·softplus(k_c)·cos((i - j)·θ_c - δ_{h,c}) / √Dh``, θ_c = base^(-c/Dh)."""
    pe = pope(base=500.0)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, H, 1, DH, generator=g) for _ in range(2))
    theta = 500.0 ** (-torch.arange(DH, dtype=torch.float64) / DH)  # (Dh,)
    delta = pe.phase_bias.detach().double().clamp(-2 * math.pi, 0)  # (H, Dh)
    mag = torch.nn.functional.softplus(q.double()) * torch.nn.functional.softplus(k.double())  # (1, H, 1, Dh)
    for i, j in [(0, 0), (5, 2), (300, 17), (40_000, 39_990)]:
        expect = (mag[0, :, 0] * torch.cos((i - j) * theta - delta)).sum(-1) / math.sqrt(DH)  # (H,)
        qi = pe.rotate(q, torch.tensor([[i]]), is_query=True)
        kj = pe.rotate(k, torch.tensor([[j]]), is_query=False)
        got = (qi * kj).sum(-1).flatten().double() / math.sqrt(2 * DH)
        torch.testing.assert_close(got, expect, atol=2e-6, rtol=1e-5)


def test_phase_bias_is_clamped_and_learns() -> None:
    pe = pope()
    with torch.no_grad():
        pe.phase_bias.fill_(1.0)  # outside [-2π, 0]: used as 0
    zero = build_encoding("pope", d_model=H * DH, n_heads=H, causal=True)
    k = torch.randn(1, H, 3, DH)
    pos = torch.tensor([[0, 1, 2]])
    assert torch.equal(pe.rotate(k, pos, is_query=False), zero.rotate(k, pos, is_query=False))
    pe = pope()
    pe.rotate(k, pos, is_query=False).sum().backward()
    assert pe.phase_bias.grad is not None and pe.phase_bias.grad.abs().sum() > 0


def _ids(b: int, t: int, seed: int = 3) -> Tensor:
    return torch.randint(3, 13, (b, t), generator=torch.Generator().manual_seed(seed))


def test_model_takes_fused_attention_and_cached_decoding_equals_full_forward(tiny_model) -> None:
    model = tiny_model("pope", pe_options={"bias_init": "uniform"})
    assert model.pe.caps.hooks == {"rotary"} and model.pe.caps.bias is None
    ids = _ids(2, 11)
    with torch.no_grad():
        full = model(ids)  # (2, 11, V)
        cache = model.new_cache()
        steps = [model(ids[:, :4], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(4, 11)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_fused_choice_for_widened_queries(tiny_model, monkeypatch) -> None:
    """q and k are 2·Dh wide, v Dh: the decision is RoPE's (fused SDPA)."""
    model = tiny_model("pope")
    seen: list[str] = []
    original = attention.choose

    def spy(q: Tensor, k: Tensor, ctx, **kw) -> str:
        assert q.shape[-1] == k.shape[-1] == 2 * model.pe.head_dim
        seen.append(original(q, k, ctx, **kw))
        return seen[-1]

    monkeypatch.setattr(attention, "choose", spy)
    with torch.no_grad():
        model(_ids(1, 7))
    assert seen and set(seen) == {"fused"}


def test_padded_batch_equals_unpadded_rows(tiny_model) -> None:
    model = tiny_model("pope")
    ids = _ids(2, 9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False  # right padding in row 1
    with torch.no_grad():
        both = model(ids, attention_mask=mask)
        alone = model(ids[1:, :6])
    torch.testing.assert_close(both[1:, :6], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"base": 1.0}, r"pe='pope': option base=1\.0 is invalid: must be > 1\.$"),
        (
            {"bias_init": "gauss"},
            r"pe='pope': option bias_init='gauss' is invalid: use one of zero, uniform\.$",
        ),
    ],
)
def test_bad_options_are_refused_in_one_line(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        build_encoding("pope", d_model=H * DH, n_heads=H, causal=True, **options)
    assert "\n" not in str(info.value)
