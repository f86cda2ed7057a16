"""Per-layer schedules (model.layer_kinds, model.layers): uniform = today's model bitwise, per-layer PEs,
patterns, temperatures, and bad schedules refused in one line when the config is checked."""

from __future__ import annotations

import math

import pytest
import torch

from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model
from posformer.model.schedule import Span, Temperature
from posformer.pe import PositionalEncoding

TINY = dict(vocab_size=32, d_model=32, n_heads=4, dropout=0.0)


def _dec(pe: str = "rope", n_layers: int = 3, **kw) -> ModelConfig:
    return ModelConfig(kind="decoder", pe=pe, n_layers=n_layers, **TINY, **kw)


def _built(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def _same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    sb = {k: v for k, v in sb.items() if k in sa} if len(sb) > len(sa) else sb  # PE buffers of b's kinds
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("pe", ["rope", "t5", "alibi", "sinusoidal"])
def test_a_uniform_schedule_is_todays_model_bitwise(pe: str) -> None:
    base = _built(_dec(pe))
    kinds = {"g": {"pe": pe}} if pe != "sinusoidal" else {"g": {}}  # an embed PE stays the model's
    uniform = _built(_dec(pe, layer_kinds=kinds, layers={"pattern": ["g"]}))
    _same_weights(base, uniform)
    ids = torch.randint(0, 32, (2, 9))
    assert torch.equal(base(ids), uniform(ids))


def test_a_uniform_encoder_decoder_schedule_is_todays_model_bitwise() -> None:
    kw = dict(kind="encoder_decoder", pe="t5", n_encoder_layers=2, n_decoder_layers=2, **TINY)
    base = _built(ModelConfig(**kw))
    layers = {"encoder": ["g", "g"], "decoder_pattern": ["g"], "cross_pattern": ["g"]}
    uniform = _built(ModelConfig(**kw, layer_kinds={"g": {}}, layers=layers))
    _same_weights(base, uniform)
    src, tgt = torch.randint(3, 32, (2, 7)), torch.randint(3, 32, (2, 5))
    assert torch.equal(base(src, tgt), uniform(src, tgt))


def test_a_pattern_repeats_and_each_layer_gets_its_kinds_pe() -> None:
    kinds = {
        "local": {"pe_options": {"base": 100.0}, "span": {"kind": "sliding", "window": 4}},
        "global": {"pe": "nope"},
    }
    cfg = _dec("rope", n_layers=5, layer_kinds=kinds, layers={"pattern": ["local", "local", "global"]})
    assert [k.name for k in cfg.layer_plan("decoder")] == ["local", "local", "global", "local", "local"]
    model = _built(cfg)
    pos = torch.arange(6)[None]
    ctxs = model._contexts("decoder", pos, pos, True, None)
    assert ctxs[0] is ctxs[1] is ctxs[3] and ctxs[2] is not ctxs[0]
    assert ctxs[2].pe is None and ctxs[0].pe.base == 100.0  # NoPE; a kind's options over model.pe's
    assert ctxs[0].span == Span("sliding", 4) and ctxs[2].span.full
    assert model.pe.base != 100.0  # the model's own PE is untouched


def test_kinds_with_the_same_pe_share_one_instance_and_different_bases_get_two() -> None:
    kinds = {
        "local": {"pe": "rope", "pe_options": {"base": 10000.0}, "span": {"kind": "sliding", "window": 8}},
        "global": {"pe": "rope", "pe_options": {"base": 1000000.0}},
        "local2": {"pe": "rope", "pe_options": {"base": 10000.0}, "span": {"kind": "chunked", "window": 8}},
    }
    model = _built(
        _dec("nope", n_layers=3, layer_kinds=kinds, layers={"decoder": ["local", "global", "local2"]})
    )
    assert sorted(model.pes) == ["decoder_global", "decoder_local"]
    assert model.layer_pes.kinds[("decoder", "local2")] is model.pes["decoder_local"]
    ids = torch.randint(0, 32, (1, 10))
    kinds["global"]["pe_options"] = {"base": 10.0}  # same weights, another base in the global layer
    other = _built(
        _dec("nope", n_layers=3, layer_kinds=kinds, layers={"decoder": ["local", "global", "local2"]})
    )
    _same_weights(_built(_dec("nope", n_layers=3)), model)  # rope has no weights: only the PEs differ
    assert not torch.allclose(model(ids), other(ids))


def test_every_pe_of_a_model_is_built_once_and_read_from_its_table() -> None:
    """One construction path and one table: the submodules the checkpoints name (``pe_enc``, ``pe_dec``,
    ``pe_cross``, ``pes.<place>_<kind>``) are the table's instances, every PE module of the model is in
    the table, and each layer's attention context holds its kind's PE."""
    kinds = {"near": {"pe": "kerple"}, "far": {}}
    layers = {"decoder_pattern": ["near", "far"], "cross_pattern": ["far"]}
    encdec = dict(kind="encoder_decoder", pe="t5", n_encoder_layers=2, n_decoder_layers=2, **TINY)
    model = _built(ModelConfig(**encdec, pe_apply={"cross": True}, layer_kinds=kinds, layers=layers))
    table = model.layer_pes
    places = [table.place(p) for p in ("encoder", "decoder", "cross")]
    assert [model.pe_enc, model.pe_dec, model.pe_cross] == places and None not in places
    assert dict(model.pes) == table.own == {"decoder_near": table.kinds[("decoder", "near")]}
    held = {id(pe) for pe in [*table.places.values(), *table.kinds.values()] if pe is not None}
    assert {id(m) for m in model.modules() if isinstance(m, PositionalEncoding)} == held
    assert table.kinds[("decoder", "far")] is model.pe_dec and table.kinds[("cross", "far")] is model.pe_cross
    pos = torch.arange(5)[None]
    ctxs = model._contexts("decoder", pos, pos, True, None)
    assert ctxs[0].pe is table.kinds[("decoder", "near")] and ctxs[1].pe is model.pe_dec
    names = {k.split(".")[0] for k in model.state_dict() if k.startswith("pe")}
    assert names == {"pe_enc", "pe_dec", "pe_cross", "pes"}


@pytest.mark.parametrize(
    ("pe_apply", "where"),
    [
        ({}, {"encoder", "decoder"}),
        ({"cross": True}, {"encoder", "decoder", "cross"}),
        ({"encoder": False}, {"decoder"}),
    ],
)
def test_pe_apply_defaults_are_said_once(pe_apply: dict, where: set) -> None:
    """``model.pe_apply`` keys left out take the defaults (encoder and decoder, not cross), and the model
    builds a PE exactly where ``ModelConfig.pe_applies`` says."""
    cfg = ModelConfig(kind="encoder_decoder", pe="t5", n_encoder_layers=1, n_decoder_layers=1, **TINY)
    cfg.pe_apply = pe_apply
    assert {p for p in ("encoder", "decoder", "cross") if cfg.pe_applies(p)} == where
    built = _built(cfg).layer_pes.places
    assert {place for place, pe in built.items() if pe is not None} == where


def test_llama4_and_logn_temperatures_follow_their_formulas() -> None:
    pos = torch.tensor([[0, 1, 7, 8, 100, 1000]])
    llama = Temperature("llama4", floor_scale=8.0, attn_scale=0.1).query_scale(pos).flatten()
    want = [math.log1p(math.floor((p + 1) / 8.0)) * 0.1 + 1 for p in pos[0].tolist()]
    assert torch.allclose(llama, torch.tensor(want))
    logn = Temperature("logn", scale=0.5, min=1.0).query_scale(pos).flatten()
    want = [max(1.0, 0.5 * math.log(p + 1)) for p in pos[0].tolist()]
    assert torch.allclose(logn, torch.tensor(want))


def test_a_temperature_scales_the_queries_of_its_layers_only() -> None:
    def model(floor_scale: float):
        kinds = {"t": {"temperature": {"kind": "llama4", "floor_scale": floor_scale, "attn_scale": 1.0}}}
        return _built(_dec("nope", n_layers=2, layer_kinds=kinds, layers={"pattern": ["t"]}))

    ids = torch.randint(0, 32, (2, 12))
    plain = _built(_dec("nope", n_layers=2))(ids)
    assert torch.equal(model(1e9)(ids), plain)  # scale 1 everywhere: the same computation
    hot = model(2.0)(ids)
    assert torch.equal(hot[:, 0], plain[:, 0])  # position 0: floor(1/2) = 0, scale 1
    assert not torch.allclose(hot[:, 4:], plain[:, 4:])


BAD = [
    ({"layer_kinds": {"a": {}}, "layers": {"decoder": ["a", "a"]}}, "has 2 entries but the decoder has 3"),
    ({"layer_kinds": {"a": {}}, "layers": {"pattern": ["a", "b"]}}, "unknown layer kind 'b'"),
    ({"layer_kinds": {"a": {}}, "layers": {"pattern": ["a"] * 4}}, "more than the 3 decoder layers"),
    ({"layer_kinds": {"a": {}}, "layers": {"encoder": ["a"] * 3}}, "model.kind=decoder model does not have"),
    ({"layer_kinds": {"a": {}}, "layers": {"patern": ["a"]}}, "model.layers.patern is not a layers setting"),
    (
        {"layer_kinds": {"a": {"span": {"kind": "window"}}}, "layers": {"pattern": ["a"]}},
        "span.kind='window'",
    ),
    ({"layer_kinds": {"a": {"span": {"kind": "sliding"}}}, "layers": {"pattern": ["a"]}}, "window=None must"),
    ({"layer_kinds": {"a": {"span": {"kind": "sliding", "window": 0}}}}, "window=0 must be a positive"),
    ({"layer_kinds": {"a": {"pe": "learned"}}, "layers": {"pattern": ["a"]}}, "added to the embeddings"),
    ({"layer_kinds": {"a": {"pe": "ropee"}}, "layers": {"pattern": ["a"]}}, "unknown positional encoding"),
    ({"layer_kinds": {"a": {"temperature": {"kind": "hot"}}}}, "temperature.kind='hot' is unknown"),
    ({"layer_kinds": {"a": {"sinks": "yes"}}}, "sinks='yes' must be true (a learned logit per head), token"),
    ({"layer_kinds": {"a": {"pe_options": {"bse": 10}}}, "layers": {"pattern": ["a"]}}, "bse"),
]


@pytest.mark.parametrize(("fields", "words"), BAD, ids=[w for _, w in BAD])
def test_bad_schedules_are_refused_in_one_line(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        _dec(**fields)
    line = str(info.value)
    assert words in line and "\n" not in line


def test_a_window_on_cross_attention_is_refused() -> None:
    kinds = {"w": {"span": {"kind": "sliding", "window": 4}}}
    with pytest.raises(ConfigError, match="cross-attention layer"):
        ModelConfig(kind="encoder_decoder", **TINY, layer_kinds=kinds, layers={"cross_pattern": ["w"]})


#: whole training runs: slow (the suite's rule)
PRESETS = [
    pytest.param(p, marks=pytest.mark.slow) for p in ("decoder_irope", "decoder_rnope_swa", "decoder_gemma3")
]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_trains_evaluates_and_reloads_through_the_cli(preset: str, tmp_path) -> None:
    """``posformer-train model=<preset>`` (in process, tiny data, 2 steps): it trains, evaluates at the
    longer lengths, and its checkpoint reloads into the same schedule, where cached decoding = full."""
    from hydra import compose, initialize_config_module

    from posformer.checkpoints import load_checkpoint
    from posformer.cli.train import run
    from tests.cli_cases import QUIET, TINY_DATA

    overrides = [
        f"model={preset}",
        "trainer=cpu",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "schedule.warmup_steps=1",
        "callbacks.model_checkpoint.monitor=null",
        *TINY_DATA,
        *QUIET,
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    run(cfg)
    results = (tmp_path / "run" / "results.md").read_text()
    assert "| 8 |" in results  # evaluated past the training length (data.eval_lengths=[4,8])
    loaded = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    model = loaded.model
    assert (
        model.cfg.layers == cfg.model.layers
        and len(
            {
                id(c)
                for c in model._contexts("decoder", torch.arange(3)[None], torch.arange(3)[None], True, None)
            }
        )
        == 2
    )  # two kinds
    ids = torch.randint(3, 8, (1, 40))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :7], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(7, 40)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_a_kinds_pe_refusing_its_options_names_the_kind() -> None:
    cfg = _dec(
        "nope",
        layer_kinds={"local": {"pe": "rope", "pe_options": {"base": -5}}},
        layers={"pattern": ["local"]},
    )
    with pytest.raises(ConfigError, match=r"^model.layer_kinds.local \(decoder layers\): .*base=-5") as info:
        build_model(cfg)
    assert "\n" not in str(info.value)
