"""The typed config schema (posformer/configs/schema.py): Hydra refuses a wrong type, an unknown key or
a value outside its set at composition, and ``posformer-train`` says so in one line naming the value,
the limit and the fix (through the real main, nothing written); the schema knows every key the shipped
YAML files set outside the open sections; the composed config is typed (model and data too) and reads
into frozen settings of plain values."""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from pathlib import Path

import lightning
import pytest
from hydra import compose, initialize_config_module
from omegaconf import MISSING, OmegaConf

import posformer.configs
from posformer.configs import schema
from posformer.configs.settings import read_train
from posformer.conform import conform, schema_node
from posformer.data.options import DATASETS, SyntheticOptions
from posformer.errors import ConfigError
from posformer.lit import optim
from posformer.model import ModelConfig
from tests.cli_cases import TINY, assert_untouched, call, eval_cli, train_cli

CONFIG_DIR = Path(posformer.configs.__file__).parent

# ------------------------------------------------------------------------------------------ the main
#: overrides -> the one line posformer-train prints (after "error: ")
ONE_LINE = {
    # a wrong type: refused by Hydra while composing, worded with the field's limit and an example
    "wrong_type": (
        ["seed=abc"],
        "seed='abc' must be a non-negative integer below 2**32 = 4294967296 (the range numpy's RNG "
        "accepts); e.g. seed=0.",
    ),
    "wrong_type_float": (["optim.lr=abc"], "optim.lr='abc' must be a positive number (e.g. optim.lr=1e-3)."),
    "wrong_type_bool": (
        ["positions.randomized=maybe"],
        "positions.randomized='maybe' must be true or false.",
    ),
    "wrong_type_list_item": (
        ["optim.betas=[0.9,abc]"],
        "optim.betas[1]='abc' is not a number; optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.98].",
    ),
    "wrong_type_section": (
        ["optim.no_decay=5"],
        "optim.no_decay=5 must be a mapping of biases, norms, embeddings, pe.",
    ),
    # a key no code reads: without + Hydra refuses it; with + read_train does; both suggest the fix
    "unknown_key": (
        ["optim.weight_decy=0.1"],
        "optim.weight_decy is not an optim setting (no code reads it); did you mean optim.weight_decay? "
        "(or drop optim.weight_decy=0.1).",
    ),
    "unknown_key_plus": (
        ["+optim.weight_decy=0.1"],
        "optim.weight_decy is not an optim setting (no code reads it); did you mean optim.weight_decay? "
        "(or drop +optim.weight_decy=...).",
    ),
    "unknown_nested_key_plus": (
        ["+optim.no_decay.bias=true"],
        "optim.no_decay.bias is not an optim.no_decay setting (no code reads it); did you mean "
        "optim.no_decay.biases? (or drop +optim.no_decay.bias=...).",
    ),
    "unknown_trainer_key": (
        ["trainer.max_step=10"],
        "trainer.max_step is not a trainer setting (no code reads it); did you mean trainer.max_steps? "
        "(or drop trainer.max_step=10).",
    ),
    "unknown_data_key": (
        ["data.batchsize=8"],
        "data.batchsize is not a data setting (no code reads it); did you mean data.batch_size? "
        "(or drop data.batchsize=8).",
    ),
    "unknown_top_level_key_plus": (["+sed=1"], "sed is not a setting (no code reads it); did you mean seed?"),
    "new_layer_kind_without_plus": (
        ["model.layer_kinds.w4={pe: rope}"],
        "model.layer_kinds.w4 is not a model.layer_kinds setting (no code reads it); model.layer_kinds has "
        "no keys yet: add one with a leading +, e.g. +model.layer_kinds.w4=...",
    ),
    "known_key_not_set": (
        ["trainer.enable_checkpointing=false"],
        "trainer.enable_checkpointing is a trainer setting this config does not set; add it with "
        "+trainer.enable_checkpointing=false.",
    ),
    "pe_option_typo": (
        ["pe=rope", "model.pe_options.bsae=500"],
        "model.pe_options.bsae=500: 'bsae' is not an option of pe=rope's config; did you mean "
        "model.pe_options.base? (+model.pe_options.bsae=500 adds a new one",
    ),
    "pe_option_not_set": (
        ["pe=alibi", "model.pe_options.zzz=3"],
        "model.pe_options.zzz=3: 'zzz' is not an option of pe=alibi's config; +model.pe_options.zzz=3 adds "
        "a new one",
    ),
    "plus_on_a_set_key": (["+optim.lr=1"], "+optim.lr=1: optim.lr is already set; drop the + (optim.lr=1)."),
    "delete_a_schema_key": (["~optim.lr"], "~optim.lr: optim.lr is part of the typed schema"),
    # a value outside its set
    "bad_enum": (
        ["schedule.name=linear"],
        "schedule.name='linear' is unknown; valid: inverse_sqrt, cosine, constant.",
    ),
    "bad_enum_eval_ckpt": (["eval_ckpt=worst"], "eval_ckpt='worst' is unknown; valid: best, last."),
    "bad_enum_with_null": (
        ["compile.mode=fast"],
        "compile.mode='fast' is unknown; valid: null, default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs.",
    ),
    "bad_range": (["optim.eps=0"], "optim.eps=0.0 must be a number in (0.0, 1.0)."),
}


@pytest.mark.parametrize("case", list(ONE_LINE))
def test_one_line_through_the_main(case, out_dir, cache_dir, monkeypatch, capsys):
    overrides, line = ONE_LINE[case]
    code, text = train_cli(overrides, out_dir, cache_dir, monkeypatch, capsys)
    lines = [x for x in text.splitlines() if x.strip()]
    assert code == 1, text[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-2000:]
    assert line in lines[0], f"{line!r} not in {lines[0]!r}"
    assert_untouched(out_dir)
    assert not (out_dir / "config.yaml").exists()
    assert "HYDRA_FULL_ERROR" not in os.environ  # set only while Hydra runs


def test_a_sweep_names_the_pe_whose_options_refuse(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    sweep = ["pe=rope,alibi", "model.pe_options.base=500", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    code, text = train_cli(sweep, out_dir, cache_dir, monkeypatch, capsys, tiny=["-m", *TINY])
    assert code == 1, text[-2000:]
    assert "'base' is not an option of pe=alibi's config" in text, text[-2000:]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "optim:\n  weight_decy: 0.1\n",
            "optim.weight_decy is not an optim setting (no code reads it); did you mean optim.weight_decay? "
            "(or drop it from experiment/mine.yaml).",
        ),
        ("seed: abc\n", "seed='abc' must be a non-negative integer below 2**32"),
    ],
)
def test_a_bad_config_file_is_named(text, line, tmp_path, cache_dir, monkeypatch, capsys):
    """A key or value from a config file (here one on --config-dir) names the file instead of an override."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\n" + text)
    from posformer.cli.train import main

    argv = ["posformer-train", "--config-dir", str(tmp_path / "conf"), *TINY, "experiment=mine"]
    argv += [f"hydra.run.dir={tmp_path / 'run'}", f"paths.root_dir={tmp_path}"]
    argv += [f"paths.cache_dir={cache_dir}"]
    code, out = call(main, argv, monkeypatch, capsys)
    lines = [x for x in out.splitlines() if x.strip()]
    assert code == 1 and len(lines) == 1 and line in lines[0], out[-2000:]
    assert "experiment/mine.yaml" in lines[0]


def test_unknown_group_option_keeps_hydras_report(out_dir, cache_dir, monkeypatch, capsys):
    code, text = train_cli(["pe=rotary"], out_dir, cache_dir, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in text
    assert "Could not find 'pe/rotary'" in text and "Available options" in text


def test_eval_unknown_key_is_one_line(tmp_path, monkeypatch, capsys):
    code, text = eval_cli(["eval.lenghts=[4]"], tmp_path / "eval", monkeypatch, capsys)
    lines = [x for x in text.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, text[-2000:]
    assert lines[0].startswith("posformer-eval: error: eval.lenghts is not an eval setting")
    assert "did you mean eval.lengths?" in lines[0]


# ------------------------------------------------------------------------------------------ coverage
def _yaml_keys(node: object, prefix: str = "") -> list[str]:
    """Dotted paths of every key in a loaded YAML node (lists are values)."""
    if not OmegaConf.is_dict(node):
        return []
    out = []
    for key in node:  # type: ignore[attr-defined]
        path = f"{prefix}{key}"
        out.append(path)
        out += _yaml_keys(node._get_node(key), path + ".")  # type: ignore[attr-defined]
    return out


#: sections whose keys belong to other code (schema docstring); ``hydra`` is Hydra's; ``variant`` comes
#: with ``+variant=...`` (configs/variant/, posformer/configs/variants.py), null without one
OPEN = ("model", "data", "trainer", "logger", "callbacks", "paths", "hydra", "variant")
#: the files whose keys land at the root of the train config
ROOT_FILES = [
    "train.yaml",
    *(f"{g}/{p.name}" for g in ("experiment", "debug") for p in (CONFIG_DIR / g).glob("*.yaml")),
]


@pytest.mark.parametrize("name", ROOT_FILES)
def test_schema_knows_every_key_of_the_shipped_yaml(name):
    raw, node = OmegaConf.load(CONFIG_DIR / name), schema_node(schema.TrainConfig)
    unknown = []
    for path in _yaml_keys(raw):
        head, _, rest = path.rpartition(".")
        if path == "defaults" or path.split(".")[0] in OPEN:
            continue
        if rest not in list((OmegaConf.select(node, head) if head else node).keys()):  # MISSING values too
            unknown.append(path)
    assert not unknown, f"{name}: keys the schema does not declare: {unknown}"


def test_every_schema_field_has_its_value_in_train_yaml():
    """Fields are MISSING in the schema (one home per default: the YAML); train.yaml sets each one."""
    raw = OmegaConf.load(CONFIG_DIR / "train.yaml")

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            elif f.name not in OPEN:
                assert f.default == MISSING, f"{prefix}{f.name}: its value belongs in train.yaml"
                assert OmegaConf.select(raw, prefix + f.name, default=MISSING) != MISSING, prefix + f.name

    walk(schema.TrainConfig, "")


def test_composed_config_is_typed_and_plain():
    """Typed at composition (the schema's classes), plain once converted: no Enum or dataclass objects
    reach results files or checkpoint hyper-parameters (loaded with weights_only=True)."""
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x"])
    assert OmegaConf.get_type(cfg.optim) is schema.OptimConfig
    assert OmegaConf.get_type(cfg) is schema.TrainConfig
    assert OmegaConf.get_type(cfg.model) is ModelConfig and OmegaConf.get_type(cfg.data) is SyntheticOptions

    def plain(v: object) -> bool:
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return v is None or type(v) in (str, int, float, bool)

    assert plain(OmegaConf.to_container(cfg, resolve=True))
    settings = read_train(cfg)  # frozen instances of the schema's classes, plain values inside
    assert isinstance(settings.optim, schema.OptimConfig) and isinstance(settings.data, SyntheticOptions)
    assert plain(dataclasses.asdict(settings))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.optim.lr = 1.0  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ the rules
def test_value_sets_match_their_consumers():
    assert schema.OPTIMIZERS == optim.OPTIMIZERS and schema.SCHEDULES == optim.SCHEDULES
    trainer_args = set(inspect.signature(lightning.Trainer.__init__).parameters)
    assert set(schema.TRAINER_RULES) <= trainer_args | set(schema.OWN_TRAINER_KEYS)
    assert not trainer_args & set(schema.OWN_TRAINER_KEYS)  # posformer's own keys: never Lightning's


def test_plain_mappings_get_the_same_checks():
    """read_train also takes a plain mapping (no Hydra): OmegaConf types it key by key, and the schema's
    keys and rules apply, every problem at once."""
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x"])
    given = OmegaConf.to_container(cfg, resolve=True)
    given["seed"], given["train"] = "abc", "maybe"
    given["optim"].update(lr=-1, weight_decy=0.1, no_decay={**given["optim"]["no_decay"], "bias": True})
    given["schedule"]["warmup_steps"] = 1.5
    given["trainer"]["max_steps"], given["data"]["batch_size"] = 0, 0
    with pytest.raises(ConfigError) as info:
        read_train(given)
    assert str(info.value).splitlines()[1:] == [
        "  - seed='abc' must be a non-negative integer below 2**32 = 4294967296 (the range numpy's RNG "
        "accepts); e.g. seed=0.",
        "  - train='maybe' must be true or false.",
        "  - optim.no_decay.bias is not an optim.no_decay setting (no code reads it); did you mean "
        "optim.no_decay.biases? (or drop +optim.no_decay.bias=...).",
        "  - optim.weight_decy is not an optim setting (no code reads it); did you mean optim.weight_decay? "
        "(or drop +optim.weight_decy=...).",
        "  - optim.lr=-1.0 must be a positive number (e.g. optim.lr=1e-3).",
        "  - schedule.warmup_steps=1.5 must be an integer >= 0; or give a fraction of the run in (0, 1), "
        "e.g. 0.05.",
        "  - data.batch_size=0 must be a positive integer.",
    ]


def test_every_missing_value_is_reported_at_once_first():
    """One pass over the values not given: a field (or section) a plain mapping leaves out and a ``???``
    anywhere are listed together, before the values are typed (``seed='abc'`` waits for them)."""
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x"])
    given = OmegaConf.to_container(cfg, resolve=True)
    del given["task_name"], given["optim"]
    given["seed"], given["model"]["pe"] = "abc", "???"
    with pytest.raises(ConfigError) as info:
        read_train(given)
    assert str(info.value).splitlines() == [
        "3 configuration problems:",
        "  - task_name has no value; set it, e.g. task_name=...",
        "  - optim has no value; set it, e.g. optim=...",
        "  - model.pe has no value ('???'); set it on the command line, e.g. model.pe=...",
    ]


def test_value_line_names_the_schema_limit():
    """A value OmegaConf refuses is worded by the field's rule, else by its type."""
    for given, line in [
        (
            {"label_smoothing": "x"},
            "loss.label_smoothing='x' must be a number in [0.0, 1.0); 0.1 is the "
            "paper's value, 0 disables it.",
        ),
        ({"randomized": "maybe"}, "positions.randomized='maybe' must be true or false."),
        (
            {"n_max": "x"},
            "positions.n_max='x' must be an integer >= 1; set it well above the longest evaluation sequence.",
        ),
    ]:
        cls = schema.LossConfig if "label_smoothing" in given else schema.PositionsConfig
        section = "loss." if cls is schema.LossConfig else "positions."
        assert conform(cls, given, section)[1] == [line]
    assert conform(schema.OptimConfig, {"betas": [0.9, "x"]}, "optim.")[1] == [
        "optim.betas[1]='x' is not a number; optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.98]."
    ]
    assert set(DATASETS) == {"synthetic", "text", "hub", "corpus", "translation"}  # one table of datasets
