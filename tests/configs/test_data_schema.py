"""Each dataset's options are declared once (a frozen dataclass of types, defaults and rules in
posformer/data/options.py, named in its one table ``DATASETS``) and checked together: every problem of a
data section is one line, all reported at once, before any work, by the datamodule and by
``read_train``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_module

import posformer.configs
from posformer.configs.settings import read_train
from posformer.data import build_datamodule, synthetic
from posformer.data.corpus import CorpusDataModule
from posformer.data.hub import HubDataModule
from posformer.data.options import DATASETS, TASKS, option_problems, range_rule
from posformer.data.synthetic import SyntheticDataModule
from posformer.data.text import TextDataModule
from posformer.data.translation import TranslationDataModule
from posformer.errors import ConfigError

CONFIG_DIR = Path(posformer.configs.__file__).parent / "data"
CLASSES = [SyntheticDataModule, TextDataModule, HubDataModule, CorpusDataModule, TranslationDataModule]


@pytest.fixture(scope="module")
def make():
    with initialize_config_module("posformer.configs", version_base="1.3"):
        yield lambda overrides: compose(
            "train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *overrides]
        )


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.name)
def test_the_declared_defaults_keep_their_own_rules(cls):
    options, problems = option_problems(cls.Options, {})
    assert problems == [] or cls is TranslationDataModule  # translation's path has no default
    if cls is TranslationDataModule:
        assert problems == ["data.source=local needs data.path: the directory holding {split}.{lang}[.gz]."]
    assert DATASETS[cls.name].options is cls.Options and isinstance(options, cls.Options)


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_preset_sets_only_declared_options(preset):
    raw = yaml.safe_load((CONFIG_DIR / f"{preset}.yaml").read_text())
    name = raw.get("name") or "synthetic"  # presets extend synthetic.yaml through their defaults list
    fields = {f.name for f in dataclasses.fields(DATASETS[name].options)}
    assert set(raw) - {"defaults"} <= fields


def test_the_options_name_the_generators_tasks():
    assert tuple(synthetic.TASKS) == TASKS


def test_a_datamodule_reports_every_problem_at_once_before_any_work(tmp_path):
    """Keys and types first (OmegaConf merges the mapping onto the options, key by key), the rules once
    those hold; each option has one rule, so the config and the datamodule say the same line."""
    cfg = {"batch_size": 0, "bos": "maybe", "trian": 1, "symbols": "x"}
    with pytest.raises(ConfigError) as info:
        SyntheticDataModule({**cfg, "cache_dir": str(tmp_path / "cache")}, "decoder", 0)
    assert str(info.value).splitlines() == [
        "3 configuration problems:",
        "  - data.bos='maybe' must be true or false.",
        "  - data.trian is not a data setting (no code reads it); did you mean data.n_train? (or drop "
        "+data.trian=...).",
        "  - data.symbols='x' must be an integer >= 2 (>= 1 for data.task=recall).",
    ]
    cfg = {"batch_size": 0, "train_len": [0, 3], "eval_lengths": [8, -1]}
    with pytest.raises(ConfigError) as info:
        SyntheticDataModule({**cfg, "cache_dir": str(tmp_path / "cache")}, "decoder", 0)
    assert str(info.value).splitlines() == [
        "3 configuration problems:",
        "  - data.train_len[0]=0 must be an integer >= 1.",
        "  - data.eval_lengths=[8, -1] contains non-positive lengths [-1]; lengths must be >= 1.",
        "  - data.batch_size=0 must be a positive integer.",
    ]
    assert not (tmp_path / "cache").exists()  # refused before any data was generated or cached


def test_one_problem_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        build_datamodule({"name": "corpus", "val_fraction": 1.5, "cache_dir": tmp_path}, "decoder", 0)
    assert str(info.value) == "data.val_fraction=1.5 must be a number in (0, 1), e.g. 0.1."
    with pytest.raises(ConfigError, match=r"^model kind 'encoder_decoder' is not supported for data=corpus"):
        build_datamodule({"name": "corpus", "cache_dir": tmp_path}, "encoder_decoder", 0)


def test_range_rule_lines():
    rule = range_rule()
    assert rule.holds([2, 5]) and rule.holds(3) and not rule.holds([5, 2]) and not rule.holds("3")
    assert rule.message("data.train_len", [9, 4]) == (
        "data.train_len=[9, 4]: min 9 is greater than max 4; write [4, 9]."
    )
    assert rule.message("data.eval_len", [1, 2, 3]) == (
        "data.eval_len=[1, 2, 3] must be [min, max] (two integers) or one integer."
    )
    assert range_rule(minimum=2).message("data.x", [1, 4]) == "data.x[0]=1 must be an integer >= 2."


def test_cross_checks_and_rules_only_when_they_apply():
    def problems(options: type, given: dict) -> list[str]:
        return option_problems(options, given)[1]

    # vocab_size is read only by the BPE tokenizer; doc_separator only with pack=true
    corpus, translation = DATASETS["corpus"].options, DATASETS["translation"].options
    assert problems(corpus, {"name": "corpus", "tokenizer": "char", "vocab_size": None}) == []
    assert problems(corpus, {"name": "corpus", "tokenizer": "bpe", "vocab_size": 0}) == [
        "data.vocab_size=0 must be an integer >= 1."
    ]
    assert problems(corpus, {"name": "corpus", "doc_separator": ""}) == []
    assert problems(corpus, {"name": "corpus", "pack": True, "doc_separator": ""}) == [
        "data.doc_separator='' must be a non-empty string, e.g. '\\n\\n' (a blank line)."
    ]
    assert problems(translation, {"name": "translation", "path": "/x", "max_tokens": 8, "max_len": 16}) == [
        "data.max_tokens=8 is smaller than data.max_len=16: the longest training pair would not fit a "
        "batch; raise max_tokens to >= 16."
    ]


def test_validate_config_lists_data_problems_with_the_rest(make):
    cfg = make(["optim.lr=0", "data.n_val=0", "data.symbols=0", "data.batch_size=-1"])
    with pytest.raises(ConfigError) as info:
        read_train(cfg)
    text = str(info.value)
    assert text.startswith("4 configuration problems:")
    assert "data.n_val=0 must be an integer >= 1." in text
    assert "data.symbols=0 must be an integer >= 2 (>= 1 for data.task=recall)." in text
    assert text.count("data.batch_size=") == 1  # one rule per option


def test_validate_config_runs_the_cross_checks_before_any_data(make):
    with pytest.raises(ConfigError, match=r"data\.task=recall needs distinct keys: instance length 128"):
        read_train(make(["data=recall", "data.eval_lengths=[8,128]"]))
    with pytest.raises(ConfigError, match=r"data\.needles=9 draws 18 distinct names, but data\.symbols=16"):
        read_train(make(["data=ruler_vartrack", "data.needles=9"]))


def test_numpy_integers_are_read_as_python_ints(tmp_path):
    dm = build_datamodule(
        {
            "name": "synthetic",
            "n_train": np.int64(32),
            "n_val": 8,
            "n_eval_per_length": 8,
            "batch_size": np.int32(8),
            "eval_lengths": [np.int64(4)],
            "cache_dir": str(tmp_path),
        },
        "decoder",
        0,
    )
    assert type(dm.batch_size) is int and dm.batch_size == 8 and dm.eval_lengths == [4]
    assert len(dm.train_dataset()) == 32
