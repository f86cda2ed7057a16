"""Attention knobs (model/knobs.py): QK-norm, the head-wise output gate and soft-capping against
x-transformers' Attention on copied weights; SSMax against its formula with every mask counted; token
sinks and the floor-log temperature against Inkling's modules; cached decoding; defaults bitwise today's;
bad values refused in one line; temperatures-only fine-tuning."""

from __future__ import annotations

import math

import pytest
import torch

from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model
from posformer.model.attention import MultiHeadAttention, attend
from posformer.model.context import AttentionContext
from posformer.model.knobs import Knobs, freeze_all_but_temperatures, model_knobs
from posformer.model.schedule import Span, Temperature
from posformer.pe import build_encoding

D, H, DH = 32, 4, 8


def _ctx(t: int, **kw) -> AttentionContext:
    pos = torch.arange(t)[None]
    return AttentionContext(None, pos, pos, causal=True, from_zero=True, **kw)


@pytest.mark.parametrize(
    "knob",
    [
        {"qk_norm": True},
        {"gate_values": True, "gate_values_headwise": True},
        {"softclamp_logits": True, "logit_softclamp_value": 2.0},
        {
            "qk_norm": True,
            "gate_values": True,
            "gate_values_headwise": True,
            "softclamp_logits": True,
            "logit_softclamp_value": 3.0,
        },
    ],
    ids=["qk_norm", "output_gate", "softcap", "all"],
)
def test_knobs_equal_x_transformers_attention(knob: dict) -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(0)
    ref = xt.Attention(dim=D, heads=H, dim_head=DH, causal=True, flash=False, **knob).eval()
    with torch.no_grad():
        ref.to_q.weight.mul_(4.0)  # sharper scores, so that the cap acts
    knobs = Knobs(
        qk_norm=10.0 if knob.get("qk_norm") else None,
        output_gate=knob.get("gate_values"),
        softcap=knob.get("logit_softclamp_value"),
    )
    ours = MultiHeadAttention(D, H, bias=False, knobs=knobs).eval()
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([ref.to_q.weight, ref.to_k.weight, ref.to_v.weight]))
        ours.out_proj.weight.copy_(ref.to_out.weight)
        if knobs.output_gate:
            ours.output_gate.weight.copy_(ref.to_v_gate.weight)
    x = torch.randn(2, 9, D)
    got = ours(x, _ctx(9, softcap=knobs.softcap or 0.0))
    torch.testing.assert_close(got, ref(x), atol=1e-6, rtol=1e-5)
    plain = MultiHeadAttention(D, H, bias=False).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "gate" not in k})
    assert (plain(x, _ctx(9)) - got).abs().max() > 1e-3  # the knob changes the output


@pytest.mark.parametrize("mask", ["causal", "sliding", "documents", "padding"])
def test_ssmax_scales_queries_by_log_of_the_keys_each_query_sees(mask: str) -> None:
    torch.manual_seed(1)
    t = 8
    kw: dict = {}
    if mask == "sliding":
        kw["span"] = Span("sliding", 3)
    if mask == "documents":
        kw["segment_ids"] = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    if mask == "padding":
        kw["key_padding_mask"] = torch.tensor([[True] * 6 + [False] * 2])
    ctx = _ctx(t, **kw)
    keep = ctx.keep(0, t, t, torch.device("cpu"))[0, 0]  # (T, T)
    want = keep.sum(-1).clamp_min(1).float()
    torch.testing.assert_close(ctx.visible_counts(torch.device("cpu"))[0, 0, :, 0], want)
    attn = MultiHeadAttention(D, H, bias=False, knobs=Knobs(ssmax=0.7)).eval()
    with torch.no_grad():
        attn.ssmax_scale.copy_(torch.tensor([0.3, 0.7, 1.0, 2.0]))
    x = torch.randn(1, t, D)
    q, k, v = (attn._heads(u) for u in attn.qkv_proj(x).chunk(3, dim=-1))
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(DH)
    scores = scores * (attn.ssmax_scale.double().view(1, H, 1, 1) * want.double().log().view(1, 1, t, 1))
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    ref = attn.out_proj((probs @ v.double()).float().transpose(1, 2).flatten(2))
    rows = keep.any(-1)
    torch.testing.assert_close(attn(x, ctx)[:, rows], ref[:, rows], atol=1e-5, rtol=1e-5)


def test_token_sinks_and_floorlog_temperature_equal_inkling() -> None:
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    config_mod = pytest.importorskip("transformers.models.inkling2.configuration_inkling2")
    torch.manual_seed(2)
    t = 10
    cfg = config_mod.Inkling2TextConfig(hidden_size=D, log_scaling_alpha=0.4, log_scaling_n_floor=3)
    pos = torch.arange(t)[None]
    q = torch.randn(2, t, H, DH)
    want_q = modeling.Inkling2LogScale(cfg)(q, pos.expand(2, -1)).transpose(1, 2)
    temp = Temperature("floorlog", alpha=0.4, n_floor=3.0)
    got_q = q.transpose(1, 2) * temp.query_scale(pos)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    # attention with the content-conditioned bias and per-token sinks: Inkling's eager attention
    pe = build_encoding("content_rel", d_model=D, n_heads=H, causal=True, extent=4)
    x = torch.randn(2, t, D)
    k, v = torch.randn(2, H, t, DH), torch.randn(2, H, t, DH)
    sinks = torch.randn(2, H, t)
    feats = pe.input_features(x)
    ctx = AttentionContext(pe, pos, pos, causal=True, from_zero=True, sinks=True)
    ctx.set_features(0, feats, feats)
    ctx.set_sinks(0, sinks)
    bias = pe.bias(pos, pos, q_feats=feats)
    causal = torch.full((t, t), float("-inf")).triu(1)

    class Module:
        num_key_value_groups, training = 1, False

    want, _ = modeling.eager_attention_forward(
        Module(), got_q, k, v, causal, DH**-0.5, position_bias=bias, sinks=sinks.unsqueeze(-1)
    )
    for backend in ("auto", "sdpa"):
        ctx.policy = type(ctx.policy)(choice=backend)
        torch.testing.assert_close(attend(got_q, k, v, ctx).transpose(1, 2), want, atol=1e-6, rtol=1e-5)


def _model(knobs: dict | None = None, kinds: dict | None = None, pe: str = "rope", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=32,
        d_model=D,
        n_heads=H,
        n_layers=2,
        dropout=0.0,
        pe=pe,
        attention_knobs=knobs or {},
        layer_kinds=kinds or {},
        layers={"pattern": list(kinds)} if kinds else {},
        **kw,
    )
    return build_model(cfg)


def test_knobs_off_is_todays_model_bitwise() -> None:
    today, off = _model(), _model({"qk_norm": False, "output_gate": False, "ssmax": False})
    assert today.state_dict().keys() == off.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(today.state_dict().values(), off.state_dict().values()))
    ids = torch.randint(3, 32, (2, 9))
    assert torch.equal(today(ids), off(ids))


@pytest.mark.parametrize("pe", ["rope", "alibi", "content_rel"])
def test_cached_decoding_with_every_knob_equals_the_full_forward(pe: str) -> None:
    kinds = {
        "local": {"span": {"kind": "sliding", "window": 4}, "sinks": "token", "softcap": 4.0, "ssmax": 0.5},
        "glob": {"temperature": {"kind": "floorlog", "alpha": 0.5, "n_floor": 3}, "sinks": "token"},
    }
    model = _model({"qk_norm": True, "output_gate": True}, kinds, pe=pe).eval()
    ids = torch.randint(3, 32, (2, 11))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :4], cache=cache)]
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    names = {n.split(".", 3)[-1] for n, _ in model.named_parameters() if "self_attn" in n}
    assert {"sink_proj.weight", "output_gate.weight", "ssmax_scale"} <= names


def test_a_kind_turns_a_model_wide_knob_off() -> None:
    model = _model({"output_gate": True}, {"a": {"output_gate": False}, "b": {}})
    assert model.blocks[0].self_attn.output_gate is None and model.blocks[1].self_attn.output_gate is not None


def test_temperatures_only_trains_the_ssmax_scales_alone() -> None:
    model = _model({"ssmax": 0.4})
    names = freeze_all_but_temperatures(model)
    assert names == ["blocks.0.self_attn.ssmax_scale", "blocks.1.self_attn.ssmax_scale"]
    model(torch.randint(3, 32, (2, 9))).logsumexp(-1).sum().backward()
    assert all((p.grad is not None) == (n in names) for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match="temperatures_only"):
        freeze_all_but_temperatures(_model())


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"softcap": -1}, "softcap=-1 must be"),
        ({"softcap": True}, "softcap=True needs the cap"),
        ({"qk_norm": "yes"}, "qk_norm='yes' must be"),
        ({"output_gate": 1}, "output_gate=1 must be true or false"),
        ({"ssmax": float("nan")}, "ssmax=nan must be"),
        ({"gate": True}, "unknown key(s) ['gate']"),
    ],
)
def test_bad_knobs_are_refused_in_one_line(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        model_knobs(raw)
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        _model(raw)


def test_temperatures_only_is_a_training_option_refused_without_temperatures() -> None:
    from hydra import initialize_config_module

    from posformer.lit.optim import build_optimizer
    from tests.configs.test_configs import make_and_validate

    with initialize_config_module("posformer.configs", version_base="1.3"):
        make_and_validate(["optim.temperatures_only=true", "+model.attention_knobs={ssmax: 0.3}"])
        with pytest.raises(ConfigError) as err:
            make_and_validate(["optim.temperatures_only=true"])
    assert "optim.temperatures_only=true" in str(err.value) and "\n" not in str(err.value)
    model = _model({"ssmax": 0.3})
    opt = build_optimizer(model, {"lr": 1e-3, "temperatures_only": True, "weight_decay": 0.1}, {})
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == 2 and all(p.shape == (H,) for p in params)
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups if g["params"])


def test_hf_export_names_the_knobs_it_cannot_express() -> None:
    from posformer.interop import hf_problems

    cfg = ModelConfig(kind="decoder", vocab_size=32, d_model=D, n_heads=H, pe="rope")
    assert not any("knobs" in p for p in hf_problems(cfg))
    on = ModelConfig(
        kind="decoder", vocab_size=32, d_model=D, n_heads=H, pe="rope", attention_knobs={"softcap": 30}
    )
    assert any("attention knobs" in p for p in hf_problems(on))


def test_token_sink_gradients_agree_between_the_masked_and_the_explicit_backend() -> None:
    grads = []
    for softcap in (None, 1e6):  # a cap far above every score: the same attention on the explicit softmax
        kinds = {"t": {"sinks": "token", **({"softcap": softcap} if softcap else {})}}
        model = _model(kinds=kinds, pe="alibi")
        model(torch.randint(3, 32, (2, 9))).logsumexp(-1).sum().backward()
        grads.append(torch.cat([b.self_attn.sink_proj.weight.grad.flatten() for b in model.blocks]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
