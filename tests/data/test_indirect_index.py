"""``data=indirect_index``: "which symbol is k to the left of X" (Gopalakrishnan et al. 2025, PoPE).

Every answer is re-derived from its prompt through the token *names* (the task's vocabulary), not the
generator's id arithmetic; the preset composes and trains a batch; bad lengths are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from posformer.configs.settings import read_train
from posformer.data import build_datamodule
from posformer.data.synthetic import generate_examples, task_vocab
from posformer.errors import ConfigError

OPTS = {"symbols": 24, "max_shift": 5}


def _rederive(prompt: list[int], names: list[str]) -> tuple[str, int, str]:
    """(X, k, the symbol k left of X) read from ``prompt`` by name alone."""
    *body, x, shift = (names[t] for t in prompt)
    assert shift.startswith("-") and x in body and body.count(x) == 1
    k = int(shift[1:])
    return x, k, body[body.index(x) - k]


@pytest.mark.parametrize(("lo", "hi"), [(2, 2), (2, 12), (20, 24)])
def test_answers_are_rederived_from_the_prompt(lo: int, hi: int) -> None:
    names = task_vocab("indirect_index", OPTS)
    rows = list(generate_examples("indirect_index", 300, lo, hi, 0, "train", json.dumps(OPTS), "test"))
    shifts = set()
    for row in rows:
        n, prompt = row["n"], row["prompt"]
        assert lo <= n <= hi and len(prompt) == n + 2
        body = [names[t] for t in prompt[:n]]
        assert len(set(body)) == n and all(s.startswith("s") for s in body)  # n distinct symbols
        _, k, expect = _rederive(prompt, names)
        assert 1 <= k <= min(OPTS["max_shift"], n - 1)
        assert [names[t] for t in row["answer"]] == [expect]
        shifts.add(k)
    assert shifts == set(range(1, min(OPTS["max_shift"], hi - 1) + 1))  # every shift that fits is asked


def test_preset_composes_and_builds_batches(tmp_path: Path) -> None:
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose(
            "train", overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", "data=indirect_index"]
        )
    settings = read_train(cfg)
    assert settings.data.task == "indirect_index" and settings.data.max_shift == 8
    options = {
        "task": "indirect_index",
        "symbols": 16,
        "max_shift": 3,
        "train_len": [2, 8],
        "eval_lengths": [16],
    }
    sizes = {"n_train": 32, "n_val": 8, "n_eval_per_length": 8, "batch_size": 8}
    dm = build_datamodule({"name": "synthetic", **options, **sizes, "cache_dir": str(tmp_path)}, "decoder", 0)
    assert dm.vocab_size == 4 + 16 + 3
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape[0] == 8
    names = task_vocab("indirect_index", {"symbols": 16, "max_shift": 3})
    row = dm.eval_dataset(16)[0]
    assert [names[t] for t in row["answer"]] == [_rederive(row["prompt"], names)[2]]


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["data.eval_lengths=[8,65]"],
            r"data\.task=indirect_index needs distinct symbols: instance length 65 exceeds",
        ),
        (
            ["data.train_len=[1,8]"],
            r"data\.task=indirect_index needs a symbol left of X: instance length 1 is below 2",
        ),
    ],
)
def test_bad_lengths_are_refused_in_one_line(overrides: list[str], line: str) -> None:
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["paths.root_dir=/tmp", "paths.output_dir=/tmp/x", "data=indirect_index", *overrides],
        )
    with pytest.raises(ConfigError, match=line) as info:
        read_train(cfg)
    assert "\n" not in str(info.value)
