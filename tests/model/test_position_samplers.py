"""Training-position samplers beside randomized integers (``positions.sampler``): PoSE's chunked skips
(Zhu et al. 2023) and random float positions equal a float64 reference of their formulas, a training
step draws them, and what cannot use them is refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module

from posformer.configs.settings import read_train
from posformer.errors import ConfigError
from posformer.lit import LanguageModelModule
from posformer.model.positions import float_positions, pose_positions


def reference_pose(seed: int, batch: int, length: int, n_max: int, chunks: int) -> torch.Tensor:
    """PoSE, written out per row in float64 scalars from the generator's draws in the sampler's order:
    cut points c_1..c_{N-1} (uniform in [1, T-1]), skips u_0 = 0, u_c = u_{c-1} + floor(r_c (L_t - L_c -
    u_{c-1} + 1)) (uniform in [u_{c-1}, L_t - L_c]); token t of chunk c(t) is at t + u_{c(t)}."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(1, max(length, 2), (batch, chunks - 1), generator=g).tolist()
    draws = torch.rand(batch, chunks - 1, generator=g, dtype=torch.float64).tolist()
    out = []
    for b in range(batch):
        u = [0.0]
        for c in range(chunks - 1):
            u.append(
                u[-1] + min(math.floor(draws[b][c] * (n_max - length - u[-1] + 1)), n_max - length - u[-1])
            )
        out.append([t + u[sum(cut <= t for cut in cuts[b])] for t in range(length)])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(("length", "n_max", "chunks"), [(16, 64, 2), (16, 16, 2), (12, 100, 4), (9, 30, 1)])
def test_pose_equals_the_papers_formula(length: int, n_max: int, chunks: int) -> None:
    g = torch.Generator().manual_seed(3)
    got = pose_positions(32, length, n_max, chunks, generator=g)
    assert got.dtype == torch.int64 and got.shape == (32, length)
    torch.testing.assert_close(got.double(), reference_pose(3, 32, length, n_max, chunks), rtol=0, atol=1e-6)
    steps = got.diff(dim=1)
    assert bool((steps >= 1).all()) and int(got[:, 0].max()) == 0 and int(got.max()) < n_max
    assert int((steps > 1).sum(1).max()) <= chunks - 1  # contiguous within each chunk
    if n_max > length and chunks > 1:  # the skips reach far: distances well past the window
        assert int((got[:, -1] - got[:, 0]).max()) > (n_max + length) // 2


def test_float_positions_equal_sorted_uniform_draws() -> None:
    got = float_positions(4, 10, 50, generator=torch.Generator().manual_seed(1))
    draws = torch.rand(4, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 49
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), draws.sort(1).values, rtol=0, atol=1e-5)  # float32 of < 50
    assert bool((got.diff(dim=1) >= 0).all()) and float(got.max()) <= 49


@pytest.mark.parametrize("sampler", ["pose", "float"])
def test_a_training_step_draws_the_samplers_positions(sampler: str, monkeypatch) -> None:
    torch.manual_seed(0)
    model = dict(kind="decoder", vocab_size=11, d_model=16, n_heads=2, n_layers=1, pe="rope", dropout=0.0)
    module = LanguageModelModule(model=model, positions={"sampler": sampler, "n_max": 64, "pose_chunks": 2})
    seen = []
    forward = module.model.forward
    monkeypatch.setattr(
        module.model,
        "forward",
        lambda ids, positions=None, **kw: (seen.append(positions), forward(ids, positions, **kw))[1],
    )
    ids = torch.randint(0, 11, (3, 12))
    loss = module.training_step({"input_ids": ids, "labels": ids}, 0)
    assert torch.isfinite(loss)
    pos = seen[0]
    assert pos.shape == (3, 12) and pos.is_floating_point() == (sampler == "float") and float(pos.max()) < 64
    module.evaluate_batch({"input_ids": ids, "labels": ids})
    assert seen[1] is None  # validation: ordinary positions


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["positions.sampler=pose", "positions.randomized=true"], "both make the training positions"),
        (["positions.sampler=float", "pe=learned"], "positions.sampler=float: pe='learned'"),
        (["positions.sampler=uniform"], "positions.sampler='uniform'"),
        (["positions.sampler=pose", "positions.pose_chunks=0"], "positions.pose_chunks=0"),
        (["positions.sampler=pose", "positions.n_max=null"], "positions.sampler=pose draws positions"),
    ],
)
def test_what_cannot_use_a_sampler_is_refused(overrides: list[str], words: str) -> None:
    base = ["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", "data=synthetic"]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=[*base, *overrides])
    with pytest.raises(ConfigError) as err:
        read_train(cfg)
    assert words in str(err.value), str(err.value)
