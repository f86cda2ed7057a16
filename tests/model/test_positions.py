"""Randomized positions (Ruoss et al. 2023): the sampler, every PE on gapped positions, train vs eval."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

from posformer.errors import ConfigError
from posformer.model.positions import (
    append_positions,
    as_positions,
    continued_positions,
    default_positions,
    is_arange,
    randomized_positions,
)
from posformer.pe import ENCODINGS, list_encodings


def test_sorted_unique_within_n_max():
    g = torch.Generator().manual_seed(0)
    pos = randomized_positions(64, 12, 40, generator=g)
    assert pos.shape == (64, 12) and pos.dtype == torch.int64
    assert (pos[:, 1:] > pos[:, :-1]).all()  # strictly increasing: sorted and unique
    assert pos.min() >= 0 and pos.max() < 40
    assert len({tuple(r) for r in pos.tolist()}) > 60  # rows are independent samples


def test_uniform_subset_covers_every_position():
    g = torch.Generator().manual_seed(1)
    pos = randomized_positions(4000, 4, 64, generator=g)
    counts = torch.bincount(pos.flatten(), minlength=64).float()
    assert (counts > 0).all()
    # each position is in a uniform 4-subset of 64 with probability 1/16: 250 expected per position
    assert counts.min() > 150 and counts.max() < 350
    # the largest position of a row is spread towards n_max, not stuck near T
    assert pos[:, -1].float().mean() > 45


def test_reproducible_and_full_length():
    a = randomized_positions(3, 5, 20, generator=torch.Generator().manual_seed(7))
    b = randomized_positions(3, 5, 20, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert torch.equal(randomized_positions(2, 9, 9), torch.arange(9).expand(2, 9))
    assert torch.equal(default_positions(torch.zeros(4, 3), offset=2), torch.tensor([[2, 3, 4]]))


def test_position_helpers():
    """as_positions, continuation, appending, the arange test."""
    from posformer.model.cache import KVCache

    assert as_positions(torch.arange(3)).shape == (1, 3)
    with pytest.raises(ValueError, match="shape"):
        as_positions(torch.zeros(1, 1, 3))
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert torch.equal(continued_positions(ids, None), torch.tensor([[0, 1, 2]]))
    cache = KVCache.empty(1)
    k_pos, padding = cache.extend(ids, torch.tensor([[5, 6, 7], [1, 2, 3]]), None)
    assert padding is None and cache.length == 3
    assert torch.equal(continued_positions(ids[:, :1], cache), torch.tensor([[8], [4]]))
    k_pos, padding = cache.extend(ids[:, :1], torch.tensor([[8]]), torch.tensor([[True], [False]]))
    assert torch.equal(k_pos, torch.tensor([[5, 6, 7, 8], [1, 2, 3, 8]]))
    assert torch.equal(padding, torch.tensor([[True] * 4, [True] * 3 + [False]]))
    assert torch.equal(
        append_positions(torch.tensor([[0, 1]]), torch.tensor([[2], [5]])),
        torch.tensor([[0, 1, 2], [0, 1, 5]]),
    )
    assert is_arange(torch.arange(4, 9).unsqueeze(0)) and is_arange(torch.tensor([[3]]))
    assert not is_arange(torch.tensor([[0, 2, 3]])) and not is_arange(torch.arange(3.0).unsqueeze(0))
    assert not is_arange(torch.arange(3).expand(2, 3))


def test_length_above_n_max_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"sequence length 20 exceeds positions.n_max=16"):
        randomized_positions(1, 20, 16)


def pe_options(pe: str, n_max: int) -> dict:
    return {"max_len": n_max} if pe == "learned" else {}


@pytest.mark.parametrize("pe", list_encodings())
def test_every_pe_trains_on_randomized_positions(tiny_model, pe):
    n_max = 64
    model = tiny_model(pe, pe_options=pe_options(pe, n_max)).train()
    ids = torch.randint(4, 13, (3, 10))
    pos = randomized_positions(3, 10, n_max, generator=torch.Generator().manual_seed(0))
    out = model(ids, positions=pos)
    assert out.shape == (3, 10, 13) and torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        ordinary = model.eval()(ids)
        gapped = model(ids, positions=pos)
    if pe != "nope" and not ENCODINGS[pe].content_positions:
        assert not torch.allclose(ordinary, gapped, atol=1e-5)  # the positions (not indices) are used
    else:
        torch.testing.assert_close(ordinary, gapped)


@pytest.mark.parametrize("pe", ["rope", "xpos", "alibi", "t5", "kerple", "shaw"])
def test_relative_pes_see_only_the_gaps(tiny_model, pe):
    """Relative PEs: shifting sparse positions by a constant changes nothing (distances are kept)."""
    model = tiny_model(pe)
    ids = torch.randint(4, 13, (2, 8))
    pos = randomized_positions(2, 8, 50, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, positions=pos), model(ids, positions=pos + 37), atol=1e-4, rtol=1e-4
        )


def test_learned_table_bounds_randomized_positions(tiny_model):
    model = tiny_model("learned", pe_options={"max_len": 32})
    with pytest.raises(Exception, match="max_len=32"):
        model(torch.randint(4, 13, (1, 8)), positions=torch.tensor([[0, 3, 5, 9, 12, 20, 31, 40]]))


def train_cfg(overrides: list[str]):
    with initialize_config_module("posformer.configs", version_base="1.3"):
        return compose("train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", *overrides])


def test_config_rejects_learned_table_smaller_than_n_max():
    from posformer.configs.settings import read_train

    bad = train_cfg(
        ["pe=learned", "model.pe_options.max_len=32", "positions.randomized=true", "positions.n_max=64"]
    )
    with pytest.raises(ConfigError, match=r"max_len=32.*n_max=64.*max_len=64"):
        read_train(bad)
    read_train(
        train_cfg(
            ["pe=learned", "model.pe_options.max_len=64", "positions.randomized=true", "positions.n_max=64"]
        )
    )


def test_module_randomizes_in_training_only(tiny_model):
    from posformer.lit import LanguageModelModule

    fields = tiny_model("alibi").cfg.to_dict()
    module = LanguageModelModule(model=fields, positions={"randomized": True, "n_max": 100})
    seen: list = []
    module.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("positions")), with_kwargs=True
    )
    batch = {
        "input_ids": torch.randint(4, 13, (4, 12)),
        "labels": torch.randint(4, 13, (4, 12)),
        "attention_mask": torch.ones(4, 12, dtype=torch.bool),
    }
    torch.manual_seed(0)
    module.training_step(batch, 0)
    pos = seen[-1]
    assert pos is not None and pos.shape == (4, 12)
    assert (pos[:, 1:] > pos[:, :-1]).all() and pos.max() < 100
    assert not torch.equal(pos, torch.arange(12).expand(4, 12))
    module.evaluate_batch(batch)
    assert seen[-1] is None  # evaluation: ordinary positions 0..T-1
    plain = LanguageModelModule(model=fields)
    plain.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("positions")), with_kwargs=True)
    plain.training_step(batch, 0)
    assert seen[-1] is None
