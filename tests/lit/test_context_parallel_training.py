"""``trainer.context_parallel``: training with each sequence split across processes, through Lightning.

The slow case runs the real ``posformer-train`` in two CPU processes (gloo) that split every sequence
(``trainer=ddp trainer.devices=2 trainer.context_parallel=2``) for 20 steps, resumes its checkpoint for 4
more, and compares every logged training loss and the validation losses with one process trained on the
same config without a split. The fast cases: the refusals (one line, before any work), the loaders'
sharding by data rank and the key's way through the config (never passed to ``lightning.Trainer``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import posformer.lit.data as lit_data
from posformer.errors import ConfigError
from posformer.lit.context_parallel import check_context_parallel
from posformer.lit.data import ResumableLoader, ShardedLoader
from posformer.lit.trainer import check_batches_per_process, trainer_kwargs

#: the losses of the split run equal the unsplit run's within this (float32, 20 steps of AdamW)
TOL = 1e-4
WORDS = ("the", "a", "river", "stone", "garden", "window", "horse", "lamp", "city", "sailor", "forest")
#: a 2-layer model with a trainable per-head bias (its heads split across the processes), no dropout
COMMON = [
    "pe=t5",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_layers=2",
    "model.d_ff=64",
    "model.dropout=0.0",
    "data=text",
    "data.tokenizer=byte",
    "data.block_size=32",
    "data.batch_size=8",
    "data.eval_lengths=[32]",
    "data.val_tokens=2048",
    "evaluate=false",
    "trainer.val_check_interval=10",
    "trainer.log_every_n_steps=1",
    "schedule.name=constant",
    "schedule.warmup_steps=2",
    "callbacks.model_checkpoint.monitor=null",
    "callbacks.lr_monitor=null",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
    "logger=none",
]
SPLIT = ["trainer=ddp", "trainer.devices=2", "trainer.context_parallel=2"]


class LossLog(Callback):
    """Test-only: global rank 0 appends ``[step, name, value]`` for ``train/loss`` after every training
    step and ``val/loss`` after every validation (and the processes per sequence at the start) to a
    JSON-lines file ``path`` (a CSV logger's file is
    rewritten by the launching process of a ``ddp_spawn`` run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer, key: str) -> None:
        if trainer.is_global_zero and key in trainer.callback_metrics:
            row = [int(trainer.global_step), key, float(trainer.callback_metrics[key])]
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:  # the processes per sequence, as built
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps([0, "context", getattr(pl_module.context_group, "size", 1)]) + "\n")

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        self._write(trainer, "train/loss")

    def on_validation_end(self, trainer, *args, **kwargs) -> None:
        self._write(trainer, "val/loss")


def write_text(path: Path, n_lines: int = 800) -> Path:
    rng = np.random.default_rng(1)
    lines = (" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) + ".\n" for _ in range(n_lines))
    path.write_text("".join(lines))
    return path


def train(run_dir: Path, text: Path, cache: Path, extra: list[str]) -> dict[str, dict[int, float]]:
    """``posformer-train`` as a subprocess into ``run_dir``; the logged ``train/loss`` and ``val/loss``
    by step."""
    args = [
        *COMMON,
        f"data.path={text}",
        f"paths.cache_dir={cache}",
        f"paths.log_dir={run_dir.parent}",
        f"hydra.run.dir={run_dir}",
        f"+callbacks.loss_log._target_={__name__}.LossLog",
        f"+callbacks.loss_log.path={run_dir}.jsonl",
        *extra,
    ]
    root = str(Path(__file__).parents[2])  # this checkout's posformer and tests, in every process
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "posformer.cli.train", *args],
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=420,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, dict[int, float]] = {"train/loss": {}, "val/loss": {}, "context": {}}
    for line in Path(f"{run_dir}.jsonl").read_text().splitlines():
        step, key, value = json.loads(line)
        out[key][step] = value
    return out


def _max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.slow  # three training runs, two of them in two processes
def test_split_training_equals_one_process_and_resumes(tmp_path: Path) -> None:
    text, cache = write_text(tmp_path / "t.txt"), tmp_path / "cache"
    one = train(tmp_path / "one", text, cache, ["trainer.max_steps=24"])
    split = train(tmp_path / "split", text, cache, [*SPLIT, "trainer.max_steps=20"])
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    resumed = train(tmp_path / "resumed", text, cache, [*SPLIT, "trainer.max_steps=24", f"ckpt_path={last}"])

    assert one["context"] == {0: 1} and split["context"] == resumed["context"] == {0: 2}  # it did split
    first = {k: v for k, v in one["train/loss"].items() if k <= 20}  # steps 1..20
    later = {k: v for k, v in one["train/loss"].items() if k > 20}
    assert len(first) == 20 and len(later) == 4
    diffs = {
        "train 1-20": _max_diff(split["train/loss"], first),
        "train 21-24 (resumed)": _max_diff(resumed["train/loss"], later),
        "val": _max_diff({**split["val/loss"], **resumed["val/loss"]}, one["val/loss"]),
    }
    print("max |split - one process|:", diffs)
    assert all(d < TOL for d in diffs.values()), diffs
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 20


# ------------------------------------------------------------------------------------------ fast
MODEL = {"kind": "decoder", "n_heads": 4, "attn_dropout": 0.0}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(world=3), "must divide the 3 processes"),
        (dict(model={**MODEL, "kind": "encoder_decoder"}), "not supported yet"),
        (dict(model={**MODEL, "attn_dropout": 0.1}), "model.attn_dropout=0"),
        (dict(task_type="task"), "rows vary in width"),
        (dict(model={**MODEL, "attention_knobs": {"ssmax": True}}), "does not split attention with ssmax"),
        (dict(model={**MODEL, "layer_kinds": {"a": {"sinks": "token"}, "b": None}}), "sinks: token"),
        (dict(model={**MODEL, "n_heads": 6}), "model.n_heads=6 is not divisible by 4"),
        (dict(length=30), r"length 30 \(data.block_size\) is not divisible by 4"),
        (dict(), None),
        (dict(world=None), None),
    ],
)
def test_refusals_are_one_line(kwargs: dict, needle: str | None) -> None:
    given = {"world": 8, "model": MODEL, "task_type": "lm", "length": 32, **kwargs}
    if needle is None:
        check_context_parallel(4, **given)
        return
    with pytest.raises(ConfigError, match=needle) as err:
        check_context_parallel(4, **given)
    assert "\n" not in str(err.value)
    check_context_parallel(1, **given)  # one process per sequence: nothing to refuse


def test_loaders_shard_by_data_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 processes, 2 per sequence: ranks 0 and 1 get the same batches, ranks 2 and 3 the others."""
    batches = list(range(10))
    seen = {}
    for rank in range(4):
        monkeypatch.setattr(lit_data, "_rank_world", lambda r=rank: (r, 4))
        seen[rank] = (list(ResumableLoader(batches, context=2)), list(ShardedLoader(batches, context=2)))
        assert len(ResumableLoader(batches, context=2)) == 5
    assert seen[0] == seen[1] == ([0, 2, 4, 6, 8], [0, 2, 4, 6, 8])
    assert seen[2] == seen[3] == ([1, 3, 5, 7, 9], [1, 3, 5, 7, 9])


def test_the_key_is_posformers_own() -> None:
    """Not a Lightning argument: left out of the Trainer's; the validation batches per data rank."""
    trainer = {"accelerator": "cpu", "precision": "32-true", "devices": 4, "context_parallel": 2}
    assert "context_parallel" not in trainer_kwargs(trainer)
    check_batches_per_process(trainer, 2)  # 2 data ranks, 2 batches: enough
    with pytest.raises(Exception, match="2 data-parallel processes"):
        check_batches_per_process(trainer, 1)


def test_config_takes_and_checks_the_key(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_module

    from posformer.configs.settings import read_train

    base = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}/run"]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        assert read_train(compose("train", overrides=base)).trainer["context_parallel"] == 1
        s = read_train(compose("train", overrides=[*base, "trainer=ddp", "trainer.context_parallel=2"]))
        assert s.trainer["context_parallel"] == 2
        with pytest.raises(ConfigError, match="trainer.context_parallel=0"):
            read_train(compose("train", overrides=[*base, "trainer.context_parallel=0"]))
