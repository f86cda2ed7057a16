"""Named variants (posformer/configs/variants.py, configs/variant/): every shipped variant composes and sets
its PE, options and model settings; inline and user-directory variants; bad variants are one line; a run
without a variant reads and writes as before; the one label of a run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

import posformer.configs
from posformer.configs.settings import config_yaml, read_train
from posformer.configs.variants import apply_variant, run_label
from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model

CONFIG_DIR = Path(posformer.configs.__file__).parent
SHIPPED = {"rope": "rope", "prope": "rope", "irope": "rope", "alibi": "alibi", "nope": "nope", "t5": "t5"}
SHIPPED["fire"] = "fire"


@pytest.fixture(scope="module", autouse=True)
def hydra_config_module():
    with initialize_config_module("posformer.configs", version_base="1.3"):
        yield


def settings(overrides: list[str]):
    cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *overrides])
    return read_train(cfg)


def test_the_shipped_variants_are_the_documented_ones():
    assert {p.stem for p in (CONFIG_DIR / "variant").glob("*.yaml")} == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_variant_sets_its_pe_and_options_and_builds(name):
    s = settings([f"+variant={name}", "pe=sinusoidal"])  # the variant wins over the pe group
    assert s.variant["name"] == name and s.model["pe"] == SHIPPED[name]
    plain = settings([f"pe={SHIPPED[name]}"])  # the same PE's options as its pe group file
    if name not in ("prope", "irope"):
        assert s.model == plain.model
    model = build_model(ModelConfig(**{**s.model, "vocab_size": 11, "pad_id": 0}))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert run_label(s.model, s.variant) == name


def test_prope_and_irope_are_rope_with_their_settings():
    rope, prope, irope = (settings([f"+variant={n}"]).model for n in ("rope", "prope", "irope"))
    assert prope["pe_options"] == {**rope["pe_options"], "proportion": 0.25}
    assert rope["pe_options"]["proportion"] == 1.0 and not rope["layers"]
    assert irope["layers"]["pattern"] == ["rope_chunked", "nope_global"]
    assert irope["layer_kinds"]["nope_global"]["pe"] == "nope"
    assert run_label(irope) == "rope×1+nope×1"  # no variant name: the schedule


def test_inline_variant_and_its_options():
    s = settings(["+variant={name:my,pe:alibi,pe_options:{biased_heads:2}}"])
    assert (s.variant["name"], s.model["pe"], s.model["pe_options"]) == ("my", "alibi", {"biased_heads": 2})
    # pe_options alone: merged over the model's (rope keeps its other options)
    s = settings(["+variant={name:rope500,pe_options:{base:500}}"])
    assert s.model["pe"] == "rope" and s.model["pe_options"]["base"] == 500
    assert s.model["pe_options"]["layout"] == "half"
    # a file variant's option overridden on the command line
    assert (
        settings(["+variant=prope", "variant.pe_options.proportion=0.5"]).model["pe_options"]["proportion"]
        == 0.5
    )


def test_a_variant_group_of_ones_own(tmp_path):
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "base500.yaml").write_text(
        "# @package variant\ndefaults:\n  - /pe@_here_: rope\n  - _self_\n"
        "name: rope500\npe_options:\n  base: 500\n"
    )
    s = settings([f"hydra.searchpath=[file://{tmp_path}]", "+variant=base500"])
    assert s.variant["name"] == "rope500" and s.model["pe_options"]["base"] == 500


@pytest.mark.parametrize(
    ("variant", "words"),
    [
        ({"pe": "alibi"}, "variant.name=None is not a name"),
        ({"name": "my run"}, "variant.name='my run' is not a name"),
        ({"name": "x", "dmodel": 3}, "variant.dmodel is not a variant key"),
        ({"name": "x", "pe_options": 3}, "variant.pe_options=3 is not a mapping"),
        ("alibi", "variant='alibi' is not a mapping"),
    ],
)
def test_a_bad_variant_is_one_line(variant, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as err:
        apply_variant({"model": {"pe": "rope"}, "variant": variant})
    assert "\n" not in str(err.value) and "e.g." in str(err.value)


def test_no_variant_reads_and_writes_as_before():
    s = settings([])
    assert s.variant is None and "variant" not in config_yaml(s)
    assert apply_variant({"model": {"pe": "rope"}, "variant": None}) == {
        "model": {"pe": "rope"},
        "variant": None,
    }
    assert "variant:\n  name: alibi" in config_yaml(settings(["+variant=alibi"]))


def test_the_tensorboard_run_is_named_by_the_variant():
    cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", "+variant=prope"])
    assert cfg.logger.tensorboard.name == "prope"
    cfg = compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x"])
    assert cfg.logger.tensorboard.name is None  # no variant: <run>/tensorboard as before
