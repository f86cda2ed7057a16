"""Positional encodings: config sync, closed forms, relative structure, reference algorithms, errors."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor

import posformer
from posformer.errors import ConfigError, PositionRangeError
from posformer.model import ModelConfig, build_model
from posformer.pe import ENCODINGS, build_encoding, list_encodings
from posformer.pe.alibi import alibi_slopes
from posformer.pe.forms import reads
from posformer.pe.sinusoidal import sinusoid_table
from posformer.pe.t5 import t5_bucket

PE_CONFIG_DIR = Path(posformer.__file__).resolve().parent / "configs" / "pe"
MODEL_FACTS = {"self", "d_model", "n_heads", "causal", "n_layers"}
BIAS_PES = sorted(name for name, cls in ENCODINGS.items() if "bias" in cls.capabilities.hooks)
#: bias PEs whose bias is a function of the positions only (not of keys or the layer input)
POSITION_BIAS_PES = [n for n in BIAS_PES if not reads(ENCODINGS[n].capabilities.bias) & {"k", "x"}]


def constructor_options(name: str) -> dict[str, object]:
    params = inspect.signature(ENCODINGS[name].__init__).parameters
    return {k: p.default for k, p in params.items() if k not in MODEL_FACTS}


# ------------------------------------------------------------------------------ configs
def test_every_registry_entry_has_a_config_and_vice_versa() -> None:
    # custom.yaml is the starting point for a PE named by its import path (model.pe=module:Class)
    assert sorted(p.stem for p in PE_CONFIG_DIR.glob("*.yaml") if p.stem != "custom") == list_encodings()
    assert set(BIAS_PES) == {
        *("alibi", "content_rel", "cope", "dpb", "fire", "forget_alibi", "kerple", "sandwich", "shaw", "t5")
    }


@pytest.mark.parametrize("name", list_encodings())
def test_config_options_are_the_constructor_options_with_their_defaults(name: str) -> None:
    path = PE_CONFIG_DIR / f"{name}.yaml"
    assert path.read_text().splitlines()[0].strip() == "# @package model"
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert cfg["pe"] == name
    assert set(cfg) <= {"pe", "pe_options", "pe_apply"}
    options = cfg["pe_options"] or {}
    # every yaml key is a real constructor option, every option is listed, with the constructor default
    assert options == constructor_options(name)
    assert set(cfg.get("pe_apply", {})) <= {"encoder", "decoder", "cross"}


def test_pe_group_composes_under_model_with_hydra() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(PE_CONFIG_DIR.parent), version_base=None):
        for name in list_encodings():
            cfg = compose(overrides=[f"+pe={name}"])
            assert cfg.model.pe == name
            model_cfg = OmegaConf.to_container(cfg.model)
            # the composed config builds an encoder-decoder (xpos: its yaml keeps it out of the encoder)
            model = build_model(
                ModelConfig(
                    kind="encoder_decoder",
                    d_model=16,
                    n_heads=2,
                    n_encoder_layers=1,
                    n_decoder_layers=1,
                    vocab_size=11,
                    **model_cfg,
                )
            )
            assert model.cfg.pe == name
            assert model_cfg["pe_options"] == constructor_options(name)


def test_xpos_config_keeps_it_out_of_the_encoder() -> None:
    cfg = OmegaConf.load(PE_CONFIG_DIR / "xpos.yaml")
    assert cfg.pe_apply.encoder is False and cfg.pe_apply.decoder is True


# ------------------------------------------------------------------------------ sinusoidal
def reference_sinusoid(positions: np.ndarray, d: int, layout: str, base: float = 10000.0) -> np.ndarray:
    """float64 closed form: dim 2i sin(p / base^(2i/d)), 2i+1 cos(...); concatenated: sines, then cosines."""
    two_i = np.arange(0, d, 2, dtype=np.float64)
    angle = positions.astype(np.float64)[:, None] / np.power(base, two_i / d)[None, :]
    out = np.empty((len(positions), d))
    if layout == "interleaved":
        out[:, 0::2], out[:, 1::2] = np.sin(angle), np.cos(angle)
    else:
        out[:, : d // 2], out[:, d // 2 :] = np.sin(angle), np.cos(angle)
    return out


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_sinusoidal_equals_closed_form_up_to_position_100000(layout: str) -> None:
    d = 64
    pe = build_encoding("sinusoidal", d_model=d, n_heads=1, layout=layout)
    positions = np.concatenate([np.arange(0, 50), np.arange(99_950, 100_001)])
    got = pe.embed(torch.zeros(1, len(positions), d), torch.from_numpy(positions).unsqueeze(0)).squeeze(0)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(
        got.double().numpy(), reference_sinusoid(positions, d, layout), rtol=0, atol=1e-5
    )
    # the layouts are told apart at position 0: [0, 1, 0, 1, ...] vs [0, ..., 0, 1, ..., 1]
    row0 = got[0]
    if layout == "interleaved":
        assert row0[0::2].abs().max() == 0 and (row0[1::2] == 1).all()
    else:
        assert row0[: d // 2].abs().max() == 0 and (row0[d // 2 :] == 1).all()


def test_sinusoidal_fractional_positions_match_closed_form() -> None:
    pe = build_encoding("sinusoidal", d_model=32, n_heads=1)
    pos = torch.tensor([[0.5, 10.25, 777.75]], dtype=torch.float64)
    got = pe.embed(torch.zeros(1, 3, 32), pos).squeeze(0)
    ref = reference_sinusoid(pos.squeeze(0).numpy(), 32, "interleaved")
    np.testing.assert_allclose(got.double().numpy(), ref, atol=1e-6)


def test_sinusoidal_rows_are_computed_from_the_positions_not_kept() -> None:
    pe = build_encoding("sinusoidal", d_model=16, n_heads=1, init_len=8)  # old checkpoints name init_len
    assert list(pe.parameters()) == [] and "table" not in dict(pe.named_buffers())
    pos = torch.arange(100).unsqueeze(0)  # far past the old init_len
    got = pe.embed(torch.zeros(1, 100, 16), pos).squeeze(0)
    np.testing.assert_allclose(got.numpy(), reference_sinusoid(np.arange(100), 16, "interleaved"), atol=1e-6)


def test_sinusoidal_in_fp16_model_adds_the_fp32_table_cast_to_fp16(tiny_model) -> None:
    model = tiny_model("sinusoidal").half()
    pe = model.pe
    pos = torch.arange(0, 5000, 7).unsqueeze(0)
    added = pe.embed(torch.zeros(1, pos.shape[1], 16, dtype=torch.float16), pos)
    assert added.dtype == torch.float16
    assert torch.isfinite(added).all()
    expected = sinusoid_table(pos, 16).half()
    assert torch.equal(added, expected)  # computed in fp32/fp64, cast at use


def test_learnable_scale_is_a_parameter_table_is_not() -> None:
    pe = build_encoding("sinusoidal", d_model=8, n_heads=1, learnable_scale=True, scale=0.5)
    assert [n for n, _ in pe.named_parameters()] == ["scale"]
    out = pe.embed(torch.zeros(1, 3, 8), torch.arange(3).unsqueeze(0))
    np.testing.assert_allclose(
        out[0].detach().numpy(), 0.5 * reference_sinusoid(np.arange(3), 8, "interleaved"), atol=1e-6
    )


# ------------------------------------------------------------------------------ relative structure
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_sinusoidal_dot_product_depends_only_on_offset(layout: str) -> None:
    d = 64
    pe = build_encoding("sinusoidal", d_model=d, n_heads=1, layout=layout)
    P = pe.embed(torch.zeros(1, 3000, d), torch.arange(3000).unsqueeze(0)).squeeze(0).double()
    for k in (1, 5, 50, 500):
        dots = (P[: 3000 - k] * P[k:]).sum(-1)
        assert float(dots.max() - dots.min()) < 1e-4
        expected = sum(math.cos(k / 10000 ** (2 * i / d)) for i in range(d // 2))
        assert float(dots[0]) == pytest.approx(expected, abs=1e-4)


ROTARY_CASES = [
    ("rope", "half", 1.0),
    ("rope", "interleaved", 1.0),
    ("rope", "half", 0.5),
    ("rope", "interleaved", 0.5),
    ("xpos", "half", 1.0),
    ("xpos", "interleaved", 0.5),
]


@pytest.mark.parametrize(("name", "layout", "fraction"), ROTARY_CASES)
def test_rotary_scores_depend_only_on_offset(name: str, layout: str, fraction: float) -> None:
    H, Dh = 2, 8
    pe = build_encoding(name, d_model=H * Dh, n_heads=H, causal=True, layout=layout, rotary_fraction=fraction)
    q, k = torch.randn(1, H, 1, Dh), torch.randn(1, H, 1, Dh)

    def score(m: int, n: int) -> Tensor:
        qm = pe.rotate(q, torch.tensor([[m]]), is_query=True)
        kn = pe.rotate(k, torch.tensor([[n]]), is_query=False)
        return (qm * kn).sum(-1).flatten()

    for offset in (0, 1, 3, 17):
        ref = score(offset, 0)
        for shift in (5, 123, 900):
            torch.testing.assert_close(score(shift + offset, shift), ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(1, 0), score(5, 0), atol=1e-3)  # and it does depend on the offset
    if fraction < 1:  # the unrotated dims are untouched
        rot = pe.rotary_dim
        out = pe.rotate(q, torch.tensor([[37]]), is_query=True)
        torch.testing.assert_close(out[..., rot:], q[..., rot:])


def test_rope_layouts_rotate_the_documented_pairs() -> None:
    x = torch.zeros(1, 1, 1, 4)
    x[..., 0] = 1.0  # the first dimension of pair 0
    half = build_encoding("rope", d_model=4, n_heads=1, layout="half").rotate(
        x, torch.tensor([[1]]), is_query=True
    )
    inter = build_encoding("rope", d_model=4, n_heads=1, layout="interleaved").rotate(
        x, torch.tensor([[1]]), is_query=True
    )
    # pair 0 has θ_0 = 1: (1, 0) -> (cos 1, sin 1); half pairs dims (0, 2), interleaved (0, 1)
    c, s = math.cos(1.0), math.sin(1.0)
    torch.testing.assert_close(half.flatten(), torch.tensor([c, 0.0, s, 0.0]))
    torch.testing.assert_close(inter.flatten(), torch.tensor([c, s, 0.0, 0.0]))


def test_rope_linear_scaling_is_position_interpolation() -> None:
    scaled = build_encoding("rope", d_model=16, n_heads=1, scaling={"type": "linear", "factor": 4})
    plain = build_encoding("rope", d_model=16, n_heads=1)
    x = torch.randn(1, 1, 1, 16)
    got = scaled.rotate(x, torch.tensor([[10]]), is_query=True)
    torch.testing.assert_close(got, plain.rotate(x, torch.tensor([[2.5]]), is_query=True))


def test_rope_scalings_keep_high_and_stretch_low_frequencies() -> None:
    R, s, L = 32, 8.0, 64
    plain = build_encoding("rope", d_model=R, n_heads=1).base_inv_freq()
    for kind in ("ntk", "dynamic_ntk", "yarn", "llama3"):
        cfg = {"type": kind, "factor": s, "original_max_len": L}
        pe = build_encoding("rope", d_model=R, n_heads=1, scaling=cfg)
        inv, factor, _ = pe.frequencies(4 * L)
        assert inv[0] == pytest.approx(float(plain[0]), rel=0.05), kind  # fastest pair ~unchanged
        assert inv[-1] < plain[-1] / 2, kind  # slowest pair stretched
        if kind == "yarn":
            assert factor == pytest.approx(0.1 * math.log(s) + 1)
            cos, _ = pe.cos_sin(torch.tensor([[0]]))
            torch.testing.assert_close(cos.flatten(), torch.full((R // 2,), factor, dtype=torch.float32))
    ntk = build_encoding("rope", d_model=R, n_heads=1, scaling={"type": "ntk", "factor": s})
    expected = (10000.0 * s ** (R / (R - 2))) ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    torch.testing.assert_close(ntk.frequencies(1)[0], expected)
    dyn = build_encoding(
        "rope", d_model=R, n_heads=1, scaling={"type": "dynamic_ntk", "factor": s, "original_max_len": L}
    )
    torch.testing.assert_close(dyn.frequencies(L)[0], plain)  # unchanged up to the training length


def test_rope_scaling_errors() -> None:
    with pytest.raises(ConfigError, match="'yarm'.*yarn"):
        build_encoding("rope", d_model=8, n_heads=1, scaling={"type": "yarm", "factor": 2})
    with pytest.raises(ConfigError, match="original_max_len"):
        build_encoding("rope", d_model=8, n_heads=1, scaling={"type": "yarn", "factor": 2})
    with pytest.raises(ConfigError, match="factor=0.5"):
        build_encoding("rope", d_model=8, n_heads=1, scaling={"type": "linear", "factor": 0.5})


def _bias(pe, q_pos: Tensor, k_pos: Tensor, q: Tensor | None = None) -> Tensor:
    if "q" in reads(pe.caps.bias):
        return pe.bias(q_pos, k_pos, q=q)
    return pe.bias(q_pos, k_pos)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", POSITION_BIAS_PES)
def test_bias_depends_only_on_relative_distance(name: str, causal: bool) -> None:
    H, T = 2, 24
    pe = build_encoding(name, d_model=16, n_heads=H, causal=causal)
    # shaw reads the query: give every position the same query vector
    q = torch.randn(1, H, 1, 8).expand(1, H, T, 8) if "q" in reads(pe.caps.bias) else None
    pos = torch.arange(T).unsqueeze(0)
    with torch.no_grad():
        b = _bias(pe, pos, pos, q)  # (1, H, T, T); positions < FIRE's threshold (512)
        assert b.shape == (1, H, T, T) and b.dtype == torch.float32
        torch.testing.assert_close(b[..., 1:, 1:], b[..., :-1, :-1])  # Toeplitz: b[i, j] = f(i - j)
        shifted = _bias(pe, pos + 100, pos + 100, q)
        torch.testing.assert_close(shifted, b)
        assert b.std() > 0  # it does encode positions


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", POSITION_BIAS_PES)
def test_bias_with_offset_positions_equals_the_slice(name: str, causal: bool) -> None:
    H, T = 2, 12
    pe = build_encoding(name, d_model=16, n_heads=H, causal=causal)
    q = torch.randn(1, H, T, 8)
    pos = torch.arange(T).unsqueeze(0)
    with torch.no_grad():
        full = _bias(pe, pos, pos, q)
        for t in range(T):  # one cached-decoding step: query t against keys 0..t
            step = _bias(pe, torch.tensor([[t]]), pos[:, : t + 1], q[:, :, t : t + 1])
            torch.testing.assert_close(step, full[..., t : t + 1, : t + 1])


@pytest.mark.parametrize("name", list_encodings())
def test_encoder_permutation_equivariance_only_without_positions(tiny_model, name: str) -> None:
    if ENCODINGS[name].causal_only:
        with pytest.raises(ConfigError, match=name):
            tiny_model(name, "encoder_decoder", pe_apply={"encoder": True, "decoder": True})
        return
    model = tiny_model(name, "encoder_decoder")
    src = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])
    perm = torch.tensor([6, 0, 5, 1, 4, 2, 3])
    with torch.no_grad():
        out = model.encode(src)
        out_perm = model.encode(src[:, perm])
    if name == "nope":
        torch.testing.assert_close(out_perm, out[:, perm], atol=1e-5, rtol=1e-5)
    else:
        assert (out_perm - out[:, perm]).abs().max() > 1e-4


# ------------------------------------------------------------------------------ reference algorithms
def press_get_slopes(n: int) -> list[float]:
    """ALiBi slopes, re-typed from Press et al.'s reference code (ofirpress/attention_with_linear_biases)."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + press_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


@pytest.mark.parametrize("n_heads", range(1, 33))
def test_alibi_slopes_equal_reference(n_heads: int) -> None:
    ref = press_get_slopes(n_heads)
    assert alibi_slopes(n_heads) == pytest.approx(ref, rel=1e-12)
    pe = build_encoding("alibi", d_model=n_heads * 2, n_heads=n_heads, causal=True)
    bias = pe.bias(torch.tensor([[5]]), torch.tensor([[2]]))  # distance 3
    torch.testing.assert_close(bias.flatten(), -3 * torch.tensor(ref, dtype=torch.float32))


def test_alibi_slopes_survive_half_precision_cast() -> None:
    pe = build_encoding("alibi", d_model=12, n_heads=6).to(torch.bfloat16)
    bias = pe.bias(torch.tensor([[1]]), torch.tensor([[0]]))
    torch.testing.assert_close(bias.flatten(), -torch.tensor(press_get_slopes(6), dtype=torch.float32))


def hf_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """HF transformers' T5Attention._relative_position_bucket, re-typed."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 40)])
def test_t5_buckets_equal_reference(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    rel = torch.arange(-1000, 1001)
    ref = hf_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(t5_bucket(rel, bidirectional, num_buckets, max_distance), ref)
    # and the module uses key - query, the direction HF uses (memory_position - context_position)
    pe = build_encoding(
        "t5",
        d_model=8,
        n_heads=2,
        causal=not bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    q_pos, k_pos = torch.tensor([[50]]), torch.arange(0, 101).unsqueeze(0)
    expected = pe.table(hf_relative_position_bucket(k_pos - 50, bidirectional, num_buckets, max_distance))
    torch.testing.assert_close(pe.bias(q_pos, k_pos)[0, :, 0], pe.scale * expected[0].T)


def test_t5_scale_multiplies_the_table_and_auto_is_sqrt_head_dim() -> None:
    kw = dict(d_model=32, n_heads=2, causal=True)  # head_dim 16: auto = 4
    torch.manual_seed(0)
    plain = build_encoding("t5", scale=1.0, init_std=0.02, **kw)
    auto = build_encoding("t5", **kw)
    assert auto.scale == 4.0 and plain.scale == 1.0
    assert 0.01 < float(auto.table.weight.detach().std()) < 0.03  # default init_std 0.02
    big = build_encoding("t5", init_std=1.0, **kw)  # x-transformers' nn.Embedding N(0, 1)
    assert 0.5 < float(big.table.weight.detach().std()) < 1.5
    auto.table.weight.data.copy_(big.table.weight.data)
    plain.table.weight.data.copy_(big.table.weight.data)
    q_pos, k_pos = torch.arange(40).unsqueeze(0), torch.arange(40).unsqueeze(0)
    torch.testing.assert_close(auto.bias(q_pos, k_pos), 4.0 * plain.bias(q_pos, k_pos))
    # the gradient reaches the table through the scale: Adam's step on the bias is scale x larger
    auto.bias(q_pos, k_pos).sum().backward()
    assert auto.table.weight.grad is not None and auto.table.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("key", "value"), [("scale", 0), ("scale", "big"), ("init_std", -1.0)])
def test_t5_bad_scale_or_init_std_names_the_option(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"option {key}="):
        build_encoding("t5", d_model=8, n_heads=2, **{key: value})


# ------------------------------------------------------------------------------ errors
def test_unknown_pe_lists_valid_names(tiny_config) -> None:
    with pytest.raises(ValueError, match="foo") as info:
        build_encoding("foo", d_model=8, n_heads=1)
    assert isinstance(info.value, ConfigError)
    for name in list_encodings():
        assert name in str(info.value)
    with pytest.raises(ConfigError, match="'foo'.*rope"):
        build_model(tiny_config("foo"))


def test_unknown_pe_option_names_it_and_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="bse") as info:
        build_encoding("rope", d_model=8, n_heads=1, bse=5.0)
    assert "base" in str(info.value) and "rotary_fraction" in str(info.value)


def test_odd_d_model_for_sinusoidal(tiny_config) -> None:
    with pytest.raises(ConfigError, match="d_model=15"):
        build_encoding("sinusoidal", d_model=15, n_heads=1)
    with pytest.raises(ConfigError, match="d_model=15"):
        build_model(tiny_config("sinusoidal", d_model=15, n_heads=1))


@pytest.mark.parametrize("name", ["rope", "xpos"])
def test_odd_rotary_dims(name: str) -> None:
    with pytest.raises(ConfigError, match=r"rotary_fraction=0\.5.*= 3") as info:
        build_encoding(name, d_model=12, n_heads=2, causal=True, rotary_fraction=0.5)  # head_dim 6 -> 3 dims
    assert "head_dim 6" in str(info.value)
    with pytest.raises(ConfigError, match="head_dim 5"):
        build_encoding(name, d_model=10, n_heads=2, causal=True)


def test_d_model_not_divisible_by_heads() -> None:
    with pytest.raises(ConfigError, match="d_model=10.*n_heads=3"):
        ModelConfig(d_model=10, n_heads=3)
    with pytest.raises(ConfigError, match="d_model=10.*n_heads=3"):
        build_encoding("alibi", d_model=10, n_heads=3)


def test_learned_past_max_len_names_both_numbers(tiny_model) -> None:
    model = tiny_model("learned", pe_options={"max_len": 8})
    model(torch.ones(1, 8, dtype=torch.long))  # exactly max_len is fine
    with pytest.raises(PositionRangeError, match=r"represents 8 positions.*position 9.*max_len=8"):
        model(torch.ones(1, 10, dtype=torch.long))
    cache = model.new_cache()
    model(torch.ones(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(PositionRangeError, match=r"represents 8 positions.*position 8.*max_len=8"):
        model(torch.ones(1, 1, dtype=torch.long), cache=cache)


def test_xpos_in_bidirectional_encoder(tiny_config) -> None:
    with pytest.raises(ConfigError, match="xpos.*bidirectional") as info:
        build_model(tiny_config("xpos", "encoder_decoder", pe_apply={"encoder": True, "decoder": True}))
    assert "pe_apply.encoder=false" in str(info.value)
    with pytest.raises(ConfigError, match="xpos"):
        build_model(tiny_config("xpos", "encoder_decoder", pe_apply={"encoder": False, "cross": True}))


@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])
def test_pe_applied_nowhere(tiny_config, kind: str) -> None:
    off = {"encoder": False, "decoder": False, "cross": False}
    with pytest.raises(ConfigError, match=r"'rope' is applied nowhere.*pe=nope"):
        build_model(tiny_config("rope", kind, pe_apply=off))
    build_model(tiny_config("nope", kind, pe_apply=off))  # nothing to apply: fine


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_cross_with_embedding_pe(tiny_config, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"pe_apply.cross=true.*'{name}'"):
        build_model(
            tiny_config(name, "encoder_decoder", pe_apply={"encoder": True, "decoder": True, "cross": True})
        )


def test_bad_pe_apply_key(tiny_config) -> None:
    with pytest.raises(ConfigError, match="crosss"):
        tiny_config("rope", pe_apply={"crosss": True})


@pytest.mark.parametrize("causal", [True, False])
def test_fire_no_grad_bias_equals_its_mlp(causal: bool) -> None:
    """Without gradients FIRE evaluates its MLP as the piecewise-linear function it is: same bias."""
    torch.manual_seed(0)
    pe = build_encoding("fire", d_model=32, n_heads=4, causal=causal, hidden=16, init_threshold=8.0)
    with torch.no_grad():  # put hidden units' switching points inside the inputs' range [0, 1]
        pe.mlp[0].bias.copy_(-pe.mlp[0].weight[:, 0] * torch.linspace(0.05, 0.95, 16))
    breaks, alpha, _ = pe.segments(None if causal else 0.0)
    assert ((breaks > 0) & (breaks < 1)).sum() >= 8 and alpha.shape == (4, breaks.numel() + 1)
    pos = torch.arange(0, 50).unsqueeze(0)
    mlp = pe.bias(pos, pos)  # gradients on: the MLP itself
    assert mlp.requires_grad
    with torch.no_grad():
        fast = pe.bias(pos, pos)
    assert fast.shape == mlp.shape == (1, 4, 50, 50)
    torch.testing.assert_close(fast, mlp.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("T", "m"), [(40, 4), (5, 8), (17, 1), (33, 16)])
def test_shaw_fused_attention_equals_explicit(causal: bool, T: int, m: int) -> None:
    """Shaw's no-grad attention (fused far regions + explicit band) equals the explicit softmax path."""
    from posformer.model.attention import AttentionContext, attend
    from posformer.model.backends.shortcut import cpu_causal_lse

    torch.manual_seed(0)
    pe = build_encoding(
        "shaw", d_model=32, n_heads=4, causal=causal, max_relative_position=m, n_layers=2, shortcut_min_len=0
    )
    with torch.no_grad():
        pe.rel_k.normal_(0, 0.5)
        pe.rel_v.normal_(0, 0.5)
    q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
    pos = torch.arange(T).unsqueeze(0)
    explicit = attend(q, k, v, AttentionContext(pe, pos, pos, causal=causal), layer=1)  # grad on: explicit
    with torch.no_grad():
        fused = pe.attention(q, k, v, causal=causal, causal_lse=cpu_causal_lse, layer=1)
        via_attend = attend(q, k, v, AttentionContext(pe, pos, pos, causal=causal), layer=1)
    torch.testing.assert_close(fused, explicit.detach(), atol=2e-5, rtol=1e-5)
    assert torch.equal(via_attend, fused)  # attend takes the PE's shortcut without gradients
    with torch.no_grad():  # not for shifted positions: the explicit path
        shifted = AttentionContext(pe, pos + 3, pos + 3, causal=causal)
        assert not shifted.contiguous
