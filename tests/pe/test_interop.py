"""Interop and head subsets: HF ``rope_scaling`` dicts verbatim (against HF's own
``ROPE_INIT_FUNCTIONS`` when transformers is installed), LongRoPE, the half <-> interleaved layout
converter (equal logits), ALiBi on some heads and rotary on a fraction of the heads.
"""

from __future__ import annotations

import math

import pytest
import torch

from posformer.errors import ConfigError
from posformer.pe import build_encoding
from posformer.pe.rope.hf import normalize_scaling
from posformer.pe.rope.layout import convert_projection, convert_qkv_state_dict, layout_permutation

D, HEADS = 128, 2  # head_dim 64: 32 rotary pairs
SHORT = [1.0 + 0.01 * i for i in range(32)]
LONG = [1.0 + 0.5 * i for i in range(32)]

#: HF's documented rope_scaling examples (model cards / configuration docs), with the posformer
#: dict each must equal, and the model's max_position_embeddings (HF derives defaults from it)
HF_EXAMPLES = [
    (  # Llama 3.1 config.json
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_len": 8192,
        },
        131072,
    ),
    (  # Qwen2.5 model card: "add to config.json" for YaRN
        {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        {"type": "yarn", "factor": 4.0, "original_max_len": 32768},
        131072,
    ),
    ({"type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}, 4096),  # LlamaConfig docs
    (
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048},
        {"type": "dynamic_ntk", "factor": 2.0, "original_max_len": 2048},
        2048,
    ),
    (  # Phi-3 style LongRoPE (lists shortened to this head size)
        {
            "type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
        },
        {
            "type": "longrope",
            "short_factor": tuple(SHORT),
            "long_factor": tuple(LONG),
            "factor": 32.0,
            "original_max_len": 4096,
        },
        131072,
    ),
]


@pytest.mark.parametrize(("hf", "native", "max_pos"), HF_EXAMPLES)
def test_hf_rope_scaling_dicts_map_to_posformer_dicts(hf: dict, native: dict, max_pos: int) -> None:
    assert normalize_scaling(hf) == native
    assert normalize_scaling(native) == native  # posformer's own dicts pass unchanged
    a = build_encoding("rope", d_model=D, n_heads=HEADS, scaling=hf)
    b = build_encoding("rope", d_model=D, n_heads=HEADS, scaling=native)
    for seq in (100, 2 * max_pos):
        fa, fb = a.frequencies(seq), b.frequencies(seq)
        torch.testing.assert_close(fa[0], fb[0])
        assert fa[1] == fb[1]
    assert normalize_scaling({"rope_type": "default", "rope_theta": 10000.0}) is None


@pytest.mark.parametrize(("hf", "native", "max_pos"), HF_EXAMPLES)
def test_hf_rope_scaling_equals_transformers_rope_init_functions(
    hf: dict, native: dict, max_pos: int
) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in hf.items() if k != "type"}
    params["rope_type"] = hf.get("rope_type", hf.get("type"))
    params["rope_theta"] = 10000.0
    if params["rope_type"] == "dynamic":  # HF's dynamic NTK takes L from max_position_embeddings
        params.pop("original_max_position_embeddings")
    config = LlamaConfig(
        hidden_size=D, num_attention_heads=HEADS, max_position_embeddings=max_pos, rope_parameters=params
    )
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    pe = build_encoding("rope", d_model=D, n_heads=HEADS, scaling=hf)
    for seq in (1000, 3 * max_pos):  # below and above the original length (longrope: short / long)
        ref_inv, ref_factor = init(config, "cpu", seq_len=seq)
        inv, factor, _ = pe.frequencies(seq)
        torch.testing.assert_close(inv.float(), ref_inv, rtol=1e-6, atol=0)
        assert factor == pytest.approx(ref_factor, rel=1e-9)


def test_yarn_mscale_keys_become_the_attention_factor() -> None:
    got = normalize_scaling(
        {
            "type": "yarn",
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        }
    )
    want = (0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1)
    assert got["attention_factor"] == pytest.approx(want) and "mscale" not in got


def test_longrope_equals_its_formula_and_switches_factors_past_the_original_length() -> None:
    L, s = 64, 8.0
    pe = build_encoding(
        "rope",
        d_model=D,
        n_heads=HEADS,
        scaling={
            "type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "factor": s,
            "original_max_len": L,
        },
    )
    theta = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    for seq, lam in ((L, SHORT), (L + 1, LONG)):
        inv, factor, _ = pe.frequencies(seq)
        torch.testing.assert_close(inv, theta / torch.tensor(lam, dtype=torch.float64))
        assert factor == pytest.approx(math.sqrt(1 + math.log(s) / math.log(L)))
    assert pe.caps.rotary_depends_on_length  # cached decoding recomputes when the factors switch


def test_longrope_cached_decoding_across_the_original_length_equals_full_forward(tiny_model) -> None:
    """Each step equals the full forward of the prefix so far (short factors up to L, long after)."""
    scaling = {
        "type": "longrope",
        "short_factor": [1.0] * 4,
        "long_factor": [1.0, 2.0, 4.0, 8.0],
        "factor": 4.0,
    }
    model = tiny_model("rope", pe_options={"scaling": {**scaling, "original_max_len": 5}})
    x = torch.randint(3, 13, (2, 9))
    with torch.no_grad():
        cache = model.new_cache()
        prefill = model(x[:, :3], cache=cache)
        torch.testing.assert_close(prefill, model(x[:, :3]), atol=1e-5, rtol=1e-5)
        for t in range(3, 9):
            step = model(x[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step, model(x[:, : t + 1])[:, -1:], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(x)[:, :5], model(x[:, :5]), atol=1e-4)  # the factors did switch


@pytest.mark.parametrize(
    ("scaling", "needle"),
    [
        ({"type": "yarn", "factor": 2, "original_max_len": 8, "beta_fats": 3}, "beta_fats"),
        ({"rope_type": "linear", "factor": 2, "rope_theta": 500000.0}, r"rope_theta=500000.0.*base=10000"),
        (
            {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 8, "truncate": False},
            "truncate",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 3,
                "long_factor": [1.0] * 3,
                "factor": 2,
                "original_max_position_embeddings": 8,
            },
            r"3 entries.*8 pairs",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 8,
            },
            "needs scaling.factor",
        ),
        ({"rope_type": "linear", "type": "yarn", "factor": 2}, "disagree"),
        ({"rope_type": "dynamc", "factor": 2}, "'dynamc'"),
    ],
)
def test_bad_scaling_dicts_are_rejected_naming_the_key(scaling: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_encoding("rope", d_model=32, n_heads=2, scaling=scaling)  # head_dim 16: 8 pairs


# ------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_layout_permutations_are_inverse_and_match_hf_llama_permute(fraction: float) -> None:
    dh = 8
    rot = int(dh * fraction)
    to_half = layout_permutation(dh, rot, "interleaved", "half")
    back = layout_permutation(dh, rot, "half", "interleaved")
    assert torch.equal(to_half[back], torch.arange(dh))
    if fraction == 1.0:  # HF's convert_llama_weights_to_hf permute, for one head
        w = torch.arange(dh * 3.0).view(dh, 3)
        hf = w.view(1, dh // 2, 2, 3).transpose(1, 2).reshape(dh, 3)
        torch.testing.assert_close(
            convert_projection(w, n_heads=1, head_dim=dh, src="interleaved", dst="half"), hf
        )


@pytest.mark.parametrize(("src", "dst"), [("half", "interleaved"), ("interleaved", "half")])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_converted_checkpoint_gives_equal_logits_in_the_other_layout(tiny_model, src, dst, fraction) -> None:
    opts = {"rotary_fraction": fraction}
    a = tiny_model("rope", n_layers=2, pe_options={**opts, "layout": src})
    b = tiny_model("rope", n_layers=2, pe_options={**opts, "layout": dst}, seed=1)
    x = torch.randint(3, 13, (2, 10))
    rot = a.pe.rotary_dim
    state = convert_qkv_state_dict(a.state_dict(), n_heads=2, head_dim=8, rotary_dim=rot, src=src, dst=dst)
    with torch.no_grad():
        unconverted = b.load_state_dict(a.state_dict()) and b(x)
        b.load_state_dict(state)
        torch.testing.assert_close(b(x), a(x), atol=1e-5, rtol=1e-5)
        assert (unconverted - a(x)).abs().max() > 1e-4  # without the conversion the logits differ


# ------------------------------------------------------------------------------ head subsets
def test_alibi_on_some_heads_equals_x_transformers_and_leaves_the_others_plain() -> None:
    pe = build_encoding("alibi", d_model=48, n_heads=6, causal=True, biased_heads=4)
    pos = torch.arange(10)[None]
    bias = pe.bias(pos, pos)[0]  # (6, 10, 10)
    assert torch.all(bias[4:] == 0) and bias[:4].abs().sum() > 0
    full4 = build_encoding("alibi", d_model=32, n_heads=4, causal=True).bias(pos, pos)[0]
    torch.testing.assert_close(bias[:4], full4)  # the first heads: the slopes of a 4-head model
    xt = pytest.importorskip("x_transformers.x_transformers")
    ref = xt.AlibiPositionalBias(heads=4, total_heads=6)
    torch.testing.assert_close(pe.bias(pos, pos)[0].tril(), ref(10, 10).tril())
    with pytest.raises(ConfigError, match="biased_heads=7"):
        build_encoding("alibi", d_model=48, n_heads=6, biased_heads=7)


def test_rope_on_a_fraction_of_the_heads(tiny_model) -> None:
    pe = build_encoding("rope", d_model=32, n_heads=4, head_fraction=0.5)
    assert pe.rotary_heads == 2
    x = torch.randn(1, 4, 6, 8)
    out = pe.rotate(x, torch.arange(6)[None], is_query=True)
    torch.testing.assert_close(out[:, 2:], x[:, 2:])  # the other heads are untouched
    full = build_encoding("rope", d_model=32, n_heads=4).rotate(x, torch.arange(6)[None], is_query=True)
    torch.testing.assert_close(out[:, :2], full[:, :2])
    model = tiny_model("rope", pe_options={"head_fraction": 0.5})
    ids = torch.randint(3, 13, (2, 8))
    with torch.no_grad():
        cache = model.new_cache()
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(8)]
        torch.testing.assert_close(torch.cat(steps, 1), model(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="head_fraction=0"):
        build_encoding("rope", d_model=32, n_heads=4, head_fraction=0)
