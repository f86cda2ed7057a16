"""RULER-style tasks (posformer.data.ruler): multi-key needle, multi-value, variable tracking.

Every answer is re-derived from its prompt by an independent reader; the tasks go through the synthetic
datamodule and are scored by the extrapolation harness at 1x-8x the training length; one tiny model is
trained from scratch through the CLI and evaluated by posformer-eval (slow).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from posformer.data import ruler
from posformer.data.options import SyntheticOptions
from posformer.data.synthetic import TASKS, SyntheticDataModule, task_vocab
from posformer.errors import ConfigError
from posformer.eval.harness import evaluate_subjects
from posformer.eval.settings import EvalSettings, Subject
from tests.cli_cases import QUIET

OPTIONS = {**dataclasses.asdict(SyntheticOptions()), "key_len": 3, "needles": 3, "symbols": 16}


def read(task: str, names: list[str]) -> list[str]:
    """The answer of a prompt given as token names, by reading it like a person would."""
    cut = names.index("<query>")
    body, query = names[:cut], names[cut + 1 :]
    items, i = [], 0
    while i < len(body):  # needles `<key> K d..d` or assignments `x = ...`
        if body[i] == "<key>":
            items.append(("key", body[i + 1], body[i + 2 : i + 5]))
            i += 5
        elif i + 1 < len(body) and body[i + 1] == "=":
            rhs = body[i + 2 : i + 5] if body[i + 2].isdigit() else [body[i + 2]]
            items.append(("set", body[i], rhs))
            i += 2 + len(rhs)
        else:
            assert body[i].startswith("f"), body[i]  # filler
            i += 1
    if task == "multikey":
        return next(v for kind, k, v in items if k == query[0])
    if task == "multivalue":
        return [d for kind, k, v in items if k == query[0] for d in v]
    value: dict[str, list[str]] = {}
    for _, var, rhs in items:
        value[var] = rhs if rhs[0].isdigit() else value[rhs[0]]
    return [var for _, var, _ in items if value[var] == query]  # in order of assignment


@pytest.mark.parametrize("task", sorted(ruler.TASKS))
def test_answers_follow_from_the_prompt(task):
    vocab = task_vocab(task, OPTIONS)
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 40):
        for _ in range(25):
            prompt, answer = TASKS[task](rng, n, OPTIONS)
            names = [vocab[i] for i in prompt]
            assert sum(x.startswith("f") for x in names) == n  # the haystack is n filler tokens
            assert read(task, names) == [vocab[i] for i in answer]
    lengths = {"multikey": 3, "multivalue": 9, "vartrack": 3}
    assert len(answer) == lengths[task]


def test_too_many_needles_for_the_names_is_one_line(tmp_path):
    cfg = {"task": "vartrack", "needles": 9, "symbols": 16, "cache_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"data\.needles=9 draws 18 distinct names, but data\.symbols=16"):
        SyntheticDataModule(cfg, "decoder", 0)


@pytest.mark.parametrize("task", sorted(ruler.TASKS))
def test_scored_by_the_harness_at_1x_to_8x(task, tmp_path, tiny_model):
    cfg = {
        "task": task,
        "needles": 2,
        "key_len": 2,
        "train_len": [2, 4],
        "eval_lengths": [4, 8, 16, 32],
        "n_train": 8,
        "n_val": 4,
        "n_eval_per_length": 6,
        "batch_size": 4,
        "cache_dir": str(tmp_path),
    }
    dm = SyntheticDataModule(cfg, "decoder", 0)
    model = tiny_model("alibi", vocab_size=dm.vocab_size)
    subject = Subject(label=task, model=model, task_type="task", data=dm, train_len=tuple(dm.train_len))
    settings = EvalSettings(lengths=[4, 8, 16, 32], progress=False)
    rows = evaluate_subjects([subject], settings, tmp_path / "out", tensorboard=False, plots=False).rows
    got = [(r["length"], r["status"], r["n_sequences"]) for r in rows]
    assert got == [(L, "ok", 6) for L in (4, 8, 16, 32)]
    assert [r["in_distribution"] for r in rows] == [True, False, False, False]
    batch = next(iter(dm.eval_dataloaders([32])[32]))
    assert batch["input_ids"].shape[1] >= 32 + 2 * (2 + 2)  # 32 fillers + 2 needles of 4 tokens


@pytest.mark.slow
def test_trained_from_scratch_and_evaluated_by_posformer_eval(tmp_path):
    from hydra import compose, initialize_config_module

    from posformer.cli.train import run
    from posformer.eval.run import run_extrapolation
    from posformer.eval.settings import read_eval

    overrides = [
        "data=ruler_multikey",
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_layers=1",
        "model.d_ff=32",
        "data.n_train=64",
        "data.n_val=8",
        "data.n_eval_per_length=8",
        "data.batch_size=16",
        "data.train_len=[2,8]",
        "data.eval_lengths=[8]",
        "data.key_len=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "schedule.warmup_steps=1",
        "callbacks.model_checkpoint.monitor=null",
        *QUIET,
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with initialize_config_module("posformer.configs", version_base="1.3"):
            run(compose("train", overrides=overrides))
            cfg = compose(
                "eval",
                overrides=[
                    f"paths.root_dir={tmp_path}",
                    f"paths.output_dir={tmp_path}/eval",
                    "eval.progress=false",
                    f"eval.sweep_dir={tmp_path}/run",
                    "eval.length_multiples=[1,2,4,8]",
                    f"eval.output_dir={tmp_path}/eval",
                    "eval.tensorboard=false",
                    "eval.max_batches=1",
                ],
            )
            res = run_extrapolation(read_eval(cfg, "extrapolate"))
    finally:
        torch.set_num_threads(threads)
    rows = sorted(res.rows, key=lambda r: r["length"])
    assert [(r["length"], r["status"]) for r in rows] == [(8, "ok"), (16, "ok"), (32, "ok"), (64, "ok")]
    assert all(0 <= r["exact_match"] <= 1 and r["scored_tokens"] == 3 * r["n_sequences"] > 0 for r in rows)
