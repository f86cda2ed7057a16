"""Hydra config tree: every pe x model x data combination composes and builds its model; the
schema (at composition) and the validator reject bad values with one clear message each; shipped
presets compose. The schema itself: tests/configs/test_schema.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import posformer.configs
from posformer.configs.composition import composition_error
from posformer.configs.settings import read_train
from posformer.errors import ConfigError
from posformer.lit.optim import InverseSqrt, WarmupCosine, parameter_groups
from posformer.model import ModelConfig, build_model
from posformer.pe import ENCODINGS, list_encodings

CONFIG_DIR = Path(posformer.configs.__file__).parent


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_config_module():
    with initialize_config_module("posformer.configs", version_base="1.3"):
        yield


def make(overrides: list[str]):
    return compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *overrides])


def make_and_validate(overrides: list[str]) -> None:
    """What ``posformer-train`` checks before any work: composition (the typed schema: a wrong type or
    an unknown key, one ConfigError line as the main reports it), then :func:`read_train`."""
    try:
        cfg = make(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's composition error, worded as the main words it
        error = composition_error(exc, overrides)
        if error is None:
            raise
        raise error from None
    read_train(cfg)


def test_every_pe_has_a_config():
    # plus `custom`: the starting point for a PE named by its import path (docs/adding_a_pe.md)
    assert options("pe") == sorted([*list_encodings(), "custom"])
    assert {"decoder_tiny", "decoder_small", "encdec_tiny", "encdec_small"} <= set(options("model"))
    assert {"cpu", "gpu", "ddp"} <= set(options("trainer"))
    assert {"tensorboard", "csv", "many"} <= set(options("logger"))


def _embeds(pe: str) -> bool:
    """Whether ``pe`` acts on the embeddings (such a PE applies under any layer kinds)."""
    return "embed" in ENCODINGS[pe].capabilities.hooks


@pytest.mark.parametrize(
    "model",  # the edit loop: the tiny encoder-decoder preset; every other preset in make test
    [pytest.param(m, marks=() if m == "encdec_tiny" else pytest.mark.slow) for m in options("model")],
)
def test_every_combination_composes_and_builds(model):
    """pe x model: compose, validate, build (vocab from a stand-in); model x data: compose, validate.

    The pe group writes only under ``model`` and the data group only under ``data``, so composing
    every pe with every data option on top of this would test the same merges again.
    """
    for pe in list_encodings():
        cfg = make([f"model={model}", f"pe={pe}"])
        assert cfg.model.pe == pe
        if pe == "xpos" and cfg.model.kind == "encoder_decoder":
            assert cfg.model.pe_apply.encoder is False  # causal-only PE stays out of the encoder
        kinds = cfg.model.get("layer_kinds") or {}
        trained = {k.get("pe") for k in kinds.values()}
        if kinds and None not in trained and pe not in trained | {"nope"} and not _embeds(pe):
            # a preset whose every layer kind names its own PE trains no layer of this one: refused
            with pytest.raises(ConfigError, match=rf"^model.pe='{pe}' trains no layer"):
                read_train(cfg)
            continue
        fields = {**read_train(cfg).model, "vocab_size": 37, "pad_id": 0}
        net = build_model(ModelConfig(**fields))
        assert net.num_parameters() > 0
    for data in options("data"):
        cfg = make([f"model={model}", f"data={data}"])
        assert cfg.data.name
        read_train(cfg)


@pytest.mark.parametrize(
    ("kind", "recipe"),
    [
        ("decoder", {"init": "torch", "scale_embedding": False, "tie_embeddings": False}),
        ("encoder_decoder", {"init": "xavier", "scale_embedding": True, "tie_embeddings": True}),
    ],
)
def test_unset_init_scale_and_tying_follow_the_model_kind(kind, recipe):
    """Left unset (None), each kind gets its recipe (decoder: x-transformers'; enc-dec: Vaswani's);
    a value given is kept; the Hydra model configs resolve to the same."""
    assert {k: getattr(ModelConfig(kind=kind), k) for k in recipe} == recipe
    flipped = {k: not v for k, v in recipe.items() if k != "init"}
    flipped["init"] = "xavier" if recipe["init"] == "torch" else "torch"
    assert {k: getattr(ModelConfig(kind=kind, **flipped), k) for k in recipe} == flipped
    model = "decoder_tiny" if kind == "decoder" else "encdec_tiny"
    fields = {**read_train(make([f"model={model}"])).model, "vocab_size": 37, "pad_id": 0}
    cfg = ModelConfig(**fields)
    assert {k: getattr(cfg, k) for k in recipe} == recipe
    net = build_model(cfg)
    emb, out = (net.tok_emb, net.lm_head) if kind == "decoder" else (net.tgt_emb, net.out_proj)
    assert (out.weight is emb.weight) == recipe["tie_embeddings"]
    emb = emb.weight  # (V, D); row 0 of the enc-dec table is the zeroed padding row
    want_std = (2 / cfg.d_model) ** 0.5 if recipe["init"] == "torch" else cfg.d_model**-0.5
    assert abs(float(emb[1:].std()) / want_std - 1) < 0.1  # kaiming sqrt(2/d) | N(0, d^-1/2)


@pytest.mark.parametrize("name", options("experiment"))
def test_experiments_compose(name):
    cfg = make([f"experiment={name}"])
    read_train(cfg) if cfg.data.name == "synthetic" else None
    assert cfg.trainer.max_steps > 0


def test_debug_and_logger_groups():
    cfg = make(["debug=fdr", "logger=many", "trainer=ddp"])
    assert cfg.trainer.fast_dev_run is True and cfg.logger is None  # fdr drops loggers
    cfg = make(["logger=many", "trainer=ddp"])
    assert set(cfg.logger) == {"tensorboard", "csv"} and cfg.trainer.devices == 2


def test_command_line_group_beats_experiment():
    cfg = make(["experiment=default", "pe=alibi"])
    assert cfg.model.pe == "alibi" and cfg.model.pe_options == {"biased_heads": None}  # alibi.yaml's own


BAD = [
    (["trainer.max_steps=-5"], "trainer.max_steps=-5 must be a positive integer"),
    (["trainer.precision=fp16"], "trainer.precision='fp16' is unknown"),
    (["model.d_model=30"], "model.d_model=30 is not divisible by model.n_heads=4"),
    (["optim.lr=-1"], "optim.lr=-1.0 must be a positive number"),  # a float field: -1 is read as -1.0
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5] must be two numbers in [0, 1)"),
    (["schedule.name=linear"], "schedule.name='linear' is unknown; valid: inverse_sqrt, cosine, constant"),
    (["schedule.warmup_steps=1.5"], "schedule.warmup_steps=1.5 must be an integer >= 0; or give a fraction"),
    (["loss.label_smoothing=1.5"], "loss.label_smoothing=1.5 must be a number in [0.0, 1.0)"),
    (["data.batch_size=0"], "data.batch_size=0 must be a positive integer"),
    (["data.eval_lengths=[32,16,64]"], "data.eval_lengths=[32, 16, 64] must be strictly increasing"),
    (["data.eval_lengths=[-8,16]"], "contains non-positive lengths [-8]"),
    (["data.train_len=[-1,16]"], "data.train_len[0]=-1 must be an integer >= 1."),  # its range_rule
    (["seed=-1"], "seed=-1 must be a non-negative integer"),
    (["flush_denormal=maybe"], "flush_denormal='maybe' must be true or false"),
    (
        ["pe=learned", "positions.randomized=true", "positions.n_max=2048"],
        "max_len=1024 positions, but randomized positions are drawn from [0, positions.n_max=2048)",
    ),
    (["pe=t5", "model.pe_options.num_buckets=0"], "num_buckets"),
    (["trainer.accelerator=gpu"], "no CUDA device is available"),
    (["train=false"], "ckpt_path is null"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_values_are_rejected_clearly(overrides, message):
    import torch

    if "trainer.accelerator=gpu" in overrides and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError) as err:
        make_and_validate(overrides)
    assert message in str(err.value)


def test_several_problems_are_listed_together():
    with pytest.raises(
        ConfigError, match=r"2 configuration problems:\n  - .*optim.lr.*\n  - .*data.batch_size"
    ):
        read_train(make(["optim.lr=0", "data.batch_size=-1"]))


def test_unknown_model_key_is_named():
    with pytest.raises(
        ConfigError, match=r"model\.d_modle is not a model setting .*did you mean model\.d_model"
    ):
        read_train(make(["+model.d_modle=3"]))


def test_inverse_sqrt_is_the_paper_formula():
    f = InverseSqrt(d_model=512, warmup_steps=4000)
    for step in (1, 100, 4000, 10000):
        assert f(step - 1) == pytest.approx(512**-0.5 * min(step**-0.5, step * 4000**-1.5))
    assert max(range(1, 8000), key=lambda s: f(s - 1)) == 4000  # peak at the end of warm-up
    c = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert c(4) == pytest.approx(0.5) and c(10) == pytest.approx(1.0) and c(110) == pytest.approx(0.1)


def test_weight_decay_groups(tiny_model):
    net = tiny_model("learned", vocab_size=11, tie_embeddings=True)
    flags = {"biases": True, "norms": True, "embeddings": False, "pe": True}
    decay, keep = parameter_groups(net, 0.1, flags)
    names = {id(p): n for n, p in net.named_parameters()}
    kept = {names[id(p)] for p in keep["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "pe.table.weight" in kept and "tok_emb.weight" in decayed
    assert (decay["name"], keep["name"]) == ("decay", "no_decay")  # the monitor's lr-AdamW/decay curve
    assert all(n.endswith("bias") or "norm" in n or n.startswith("pe.") for n in kept)
    assert sum(p.numel() for g in (decay, keep) for p in g["params"]) == net.num_parameters()
    with pytest.raises(ConfigError, match="unknown keys \\['bias'\\]"):
        parameter_groups(net, 0.1, {"bias": True})


def test_resolved_paths_use_env_cache(monkeypatch):
    monkeypatch.setenv("POSFORMER_CACHE", "/tmp/pf-cache-test")
    cfg = make([])
    assert OmegaConf.select(cfg, "paths.cache_dir") == "/tmp/pf-cache-test"
    assert cfg.data.cache_dir == "/tmp/pf-cache-test"
