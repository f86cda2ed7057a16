"""``model.layer_kinds.<kind>.switch``: the switched model is the model of the target PE, the switch is
due at its step (or fraction), and what cannot switch is refused in one line."""

from __future__ import annotations

import pytest
import torch

from posformer.errors import ConfigError
from posformer.model import ModelConfig, build_model


def _cfg(kind: dict, **extra) -> ModelConfig:
    return ModelConfig(
        kind="decoder",
        vocab_size=13,
        d_model=16,
        n_heads=2,
        n_layers=2,
        pe="rope",
        dropout=0.0,
        layer_kinds={"a": kind, "b": {"pe": "rope"}},
        layers={"pattern": ["a", "b"]},
        **extra,
    )


@pytest.mark.parametrize(("target", "options"), [("nope", {}), ("rope", {"proportion": 0.5}), ("alibi", {})])
def test_switched_model_equals_the_model_of_the_target_pe(target: str, options: dict) -> None:
    torch.manual_seed(0)
    model = build_model(
        _cfg({"pe": "rope", "switch": {"at_fraction": 0.5, "pe": target, "pe_options": options}})
    )
    reference = build_model(_cfg({"pe": target, "pe_options": options}))
    reference.load_state_dict(model.state_dict(), strict=False)
    ids = torch.randint(0, 13, (2, 10))
    before = model(ids)
    assert model.apply_switches(4, max_steps=10) == []  # due at step 5 of 10
    assert torch.equal(model(ids), before)
    assert model.apply_switches(5, max_steps=10) == ["decoder_a"]
    torch.testing.assert_close(model(ids), reference(ids), rtol=0, atol=0)
    assert not torch.equal(model(ids), before)
    assert model.apply_switches(9, max_steps=10) == []  # once
    # an earlier step (a best checkpoint saved before the switch): the kind's own PE again
    assert model.apply_switches(2, max_steps=10) == ["decoder_a"]
    assert torch.equal(model(ids), before)


@pytest.mark.parametrize(
    ("switch", "words"),
    [
        ({"at_step": 3, "pe": "fire"}, ["trainable parameters", "rope -> nope"]),
        ({"at_step": 3, "pe": "sinusoidal"}, ["embeddings", "per layer kind"]),
        ({"at_step": 3, "at_fraction": 0.5, "pe": "nope"}, ["one of at_step or at_fraction"]),
        ({"at_fraction": 1.5, "pe": "nope"}, ["at_fraction=1.5", "from 0 to 1"]),
        ({"at_step": -1, "pe": "nope"}, ["at_step=-1"]),
        ({"at_step": 3, "pe": "rope", "pe_options": {"nonsense": 1}}, ["no option(s) nonsense"]),
        ({"at_step": 3}, ["switch.pe=None"]),
    ],
)
def test_what_cannot_switch_is_one_line(switch: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        cfg = _cfg({"pe": "rope", "switch": switch})
        cfg.validate()
        from posformer.model.layer_pes import check_layer_pes

        check_layer_pes(cfg)
    line = str(err.value)
    assert "\n" not in line and "model.layer_kinds.a.switch" in line, line
    assert all(w in line for w in words), line


def test_a_fraction_needs_the_training_length() -> None:
    model = build_model(_cfg({"pe": "rope", "switch": {"at_fraction": 0.5, "pe": "nope"}}))
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        model.apply_switches(3)
