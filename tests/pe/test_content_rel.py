"""The content-conditioned relative bias (content_rel): Inkling's and x-transformers' modules on copied
weights, its float64 formula, cached decoding against the full forward, and bad options."""

from __future__ import annotations

import math

import pytest
import torch

from posformer.errors import ConfigError
from posformer.pe import build_encoding

H, DH, D = 4, 8, 32


def _pe(**options):
    return build_encoding("content_rel", d_model=D, n_heads=H, causal=True, n_layers=2, **options)


@pytest.mark.parametrize("log_scaling", [False, True])
def test_content_rel_equals_inkling2_relative_position_bias(log_scaling: bool) -> None:
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    config_mod = pytest.importorskip("transformers.models.inkling2.configuration_inkling2")
    torch.manual_seed(0)
    d_rel, extent, floor = 4, 6, 3
    cfg = config_mod.Inkling2TextConfig(
        hidden_size=D,
        d_rel=d_rel,
        rel_l2_clip_threshold=0.5,
        log_scaling_alpha=0.3,
        log_scaling_n_floor=floor,
    )
    ref = modeling.Inkling2RelativePositionBias(cfg, H, extent, log_scaling=log_scaling)
    with torch.no_grad():
        ref.proj.normal_()
        ref.norm.scale.uniform_(0.5, 2.0)
    pe = _pe(d_rel=d_rel, extent=extent, clip=0.5, log_alpha=0.3 if log_scaling else 0.0, log_floor=floor)
    with torch.no_grad():
        pe.linears[1].weight.copy_(ref.linear.weight)
        pe.scales[1].copy_(ref.norm.scale)
        pe.banks[1].copy_(ref.proj)
    x, t = torch.randn(2, 11, D), 11
    pos = torch.arange(t)[None]
    want = ref(x, pos[0, :, None] - pos[0, None, :], pos.expand(2, -1))  # (2, H, T, T)
    got = pe.bias(pos, pos, q_feats=pe.input_features(x, layer=1), layer=1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got[..., 0, 1:].abs().max() == 0 and got[..., 10, : 10 - extent + 1].abs().max() == 0


def test_content_rel_equals_x_transformers_relative_proj_positional_bias() -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(1)
    ref = xt.RelativeProjPositionalBias(D, H, num_distance_basis=5, max_dist=7)
    pe = _pe(d_rel=5, extent=7, clip=0.0, linear_bias=True)
    with torch.no_grad():
        pe.linears[0].weight.copy_(ref.to_distance_weights[0].weight)
        pe.linears[0].bias.copy_(ref.to_distance_weights[0].bias)
        pe.banks[0].copy_(ref.distance_bank)
    x = torch.randn(3, 5, D)
    want = ref(x, seq_len_k=12)  # queries 7 … 11 over keys 0 … 11
    got = pe.bias(torch.arange(7, 12)[None], torch.arange(12)[None], q_feats=pe.input_features(x))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_content_rel_equals_its_formula_in_float64() -> None:
    torch.manual_seed(2)
    pe = _pe(d_rel=3, extent=5, clip=1.5, log_alpha=0.2, log_floor=2.0)
    with torch.no_grad():
        for p in pe.parameters():
            p.normal_()
    x = torch.randn(1, 6, D)
    q_pos, k_pos = torch.tensor([[3, 4, 9]]), torch.tensor([[0, 2, 4, 5, 8, 9]])
    got = pe.bias(q_pos, k_pos, q_feats=pe.input_features(x[:, :3]))[0].double()
    lin, scale, bank = pe.linears[0], pe.scales[0].double(), pe.banks[0].double()
    for h in range(H):
        for a, i in enumerate(q_pos[0].tolist()):
            w = (x[0, a].double() @ lin.weight.double().T).view(H, 3)[h] * scale[h]
            w = w * min(1.0, 1.5 / (float(w.norm()) + 1e-6))
            tau = 1 + 0.2 * math.log(max((i + 1) / 2.0, 1.0))
            for b, j in enumerate(k_pos[0].tolist()):
                want = tau * float(w @ bank[:, i - j]) if 0 <= i - j < 5 else 0.0
                assert abs(float(got[h, a, b]) - want) < 1e-5


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"d_rel": 0}, "d_rel=0"),
        ({"extent": -1}, "extent=-1"),
        ({"clip": -1.0}, "clip=-1.0"),
        ({"log_floor": 0.5}, "log_floor=0.5"),
    ],
)
def test_content_rel_refuses_bad_options_in_one_line(options: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _pe(**options)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_content_rel_is_refused_outside_causal_attention() -> None:
    with pytest.raises(ConfigError, match="causal attention only"):
        build_encoding("content_rel", d_model=D, n_heads=H, causal=False)
