"""Each dataset's options are declared once (``OPTIONS``: default + rule, posformer/data/options.py) and
checked together: every problem of a data section is one line, all reported at once, before any work,
by the datamodule and by ``validate_config``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_module

import posformer.configs
from posformer.config import DATA_DEFAULTS, validate_config
from posformer.data import build_datamodule
from posformer.data.corpus import CorpusDataModule
from posformer.data.hub import HubDataModule
from posformer.data.options import BUILT_IN, RangeRule, data_problems, option_problems
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
    options, problems = option_problems(cls, {}, None)
    assert problems == [] or cls is TranslationDataModule  # translation's path has no default
    if cls is TranslationDataModule:
        assert problems == ["data.source=local needs data.path: the directory holding {split}.{lang}[.gz]."]
    assert set(options) == set(cls.OPTIONS)


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_preset_sets_only_declared_options(preset):
    raw = yaml.safe_load((CONFIG_DIR / f"{preset}.yaml").read_text())
    name = raw.get("name") or "synthetic"  # presets extend synthetic.yaml through their defaults list
    module, _, attr = BUILT_IN[name].partition(":")
    cls = getattr(__import__(module, fromlist=[attr]), attr)
    assert set(raw) - {"name", "defaults"} <= set(cls.OPTIONS)
    assert name in DATA_DEFAULTS  # validate_config's key check knows the same datasets


def test_a_datamodule_reports_every_problem_at_once_before_any_work(tmp_path):
    cfg = {"batch_size": 0, "train_len": [0, 3], "eval_lengths": [8, -1], "bos": "yes", "trian": 1}
    with pytest.raises(ConfigError) as info:
        SyntheticDataModule({**cfg, "cache_dir": str(tmp_path / "cache")}, "decoder", 0)
    lines = str(info.value).splitlines()
    assert lines[0] == "5 configuration problems:"
    assert lines[1].startswith("  - data=synthetic: unknown key(s) ['trian']")
    assert set(lines[2:]) == {
        "  - data.train_len[0]=0 must be an integer >= 1.",
        "  - data.eval_lengths[]=-1 must be an integer >= 1.",
        "  - data.batch_size=0 must be an integer >= 1.",
        "  - data.bos='yes' must be true or false.",
    }
    assert not (tmp_path / "cache").exists()  # refused before any data was generated or cached


def test_one_problem_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        build_datamodule({"name": "corpus", "val_fraction": 1.5, "cache_dir": tmp_path}, "decoder", 0)
    assert str(info.value) == "data.val_fraction=1.5 must be a number in (0, 1), e.g. 0.1."
    with pytest.raises(ConfigError, match=r"^model kind 'encoder_decoder' is not supported for data=corpus"):
        build_datamodule({"name": "corpus", "cache_dir": tmp_path}, "encoder_decoder", 0)


def test_range_rule_lines():
    rule = RangeRule()
    assert rule.holds([2, 5]) and rule.holds(3) and not rule.holds([5, 2]) and not rule.holds("3")
    assert rule.message("data.train_len", [9, 4]) == (
        "data.train_len=[9, 4]: min 9 is greater than max 4; write [4, 9]."
    )
    assert rule.message("data.eval_len", [1, 2, 3]) == (
        "data.eval_len=[1, 2, 3] must be [min, max] (two integers) or one integer."
    )
    assert RangeRule(minimum=2).message("data.x", [1, 4]) == "data.x[0]=1 must be an integer >= 2."


def test_cross_checks_and_rules_only_when_they_apply():
    # vocab_size is read only by the BPE tokenizer; doc_separator only with pack=true
    assert data_problems({"name": "corpus", "tokenizer": "char", "vocab_size": None}) == []
    assert data_problems({"name": "corpus", "tokenizer": "bpe", "vocab_size": 0}) == [
        "data.vocab_size=0 must be an integer >= 1."
    ]
    assert data_problems({"name": "corpus", "doc_separator": ""}) == []
    assert data_problems({"name": "corpus", "pack": True, "doc_separator": ""}) == [
        "data.doc_separator='' must be a non-empty string, e.g. '\\n\\n' (a blank line)."
    ]
    assert data_problems({"name": "translation", "path": "/x", "max_tokens": 8, "max_len": 16}) == [
        "data.max_tokens=8 is smaller than data.max_len=16: the longest training pair would not fit a "
        "batch; raise max_tokens to >= 16."
    ]
    assert data_problems({"name": "plugin_data", "batch_size": -3}) == []  # no declaration: its own checks


def test_validate_config_lists_data_problems_with_the_rest(make):
    cfg = make(["optim.lr=0", "data.n_val=0", "data.symbols=0", "data.batch_size=-1"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    text = str(info.value)
    assert text.startswith("4 configuration problems:")
    assert "data.n_val=0 must be an integer >= 1." in text
    assert "data.symbols=0 must be an integer >= 2 (>= 1 for data.task=recall)." in text
    assert text.count("data.batch_size=") == 1  # the schema's line; the table does not repeat it


def test_validate_config_runs_the_cross_checks_before_any_data(make):
    with pytest.raises(ConfigError, match=r"data\.task=recall needs distinct keys: instance length 128"):
        validate_config(make(["data=recall", "data.eval_lengths=[8,128]"]))
    with pytest.raises(ConfigError, match=r"data\.needles=9 draws 18 distinct names, but data\.symbols=16"):
        validate_config(make(["data=ruler_vartrack", "data.needles=9"]))


def test_numpy_integers_are_read_as_python_ints(tmp_path):
    dm = build_datamodule(
        {"name": "synthetic", "n_train": np.int64(32), "n_val": 8, "n_eval_per_length": 8,
         "batch_size": np.int32(8), "eval_lengths": [np.int64(4)], "cache_dir": str(tmp_path)},
        "decoder", 0,
    )  # fmt: skip
    assert type(dm.batch_size) is int and dm.batch_size == 8 and dm.eval_lengths == [4]
    assert len(dm.train_dataset()) == 32
