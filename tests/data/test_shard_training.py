"""Training from a token store of many shards: the same windows on 0, 1 and 2 loader workers, two DDP
ranks reading disjoint windows, and an exact mid-epoch resume (a bitwise loss curve)."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from lightning.pytorch.callbacks import Callback

import posformer.data.sources as sources
import posformer.data.store as store_mod
import posformer.lit.data as lit_data
from posformer.data import build_datamodule
from posformer.errors import Interrupted
from posformer.lit.data import ResumableLoader
from tests.cli_cases import QUIET, TINY_MODEL

WORDS = ("the", "a", "river", "stone", "garden", "window", "horse", "lamp", "city", "sailor", "forest")


def write_text(path: Path, n_lines: int = 3000) -> Path:
    rng = np.random.default_rng(1)
    path.write_text(
        "".join(" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) + ".\n" for _ in range(n_lines))
    )
    return path


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 4,096 tokens, from pieces of ~1,000 characters: a 130 kB text makes 30 of them."""
    monkeypatch.setattr(store_mod, "SHARD_TOKENS", 4096)
    monkeypatch.setattr(sources, "PIECE_CHARS", 1000)
    monkeypatch.setattr(sources, "BATCH_CHARS", 4000)


def datamodule(tmp_path: Path, **cfg):
    base = {
        "name": "text",
        "path": str(write_text(tmp_path / "t.txt")),
        "tokenizer": "byte",
        "block_size": 32,
        "batch_size": 8,
        "cache_dir": str(tmp_path / "cache"),
    }
    dm = build_datamodule({**base, **cfg}, "decoder", 0)
    assert len(dm.train_stream.records) > 20  # many shards: windows cross their boundaries
    return dm


def rows_of(loader, n: int) -> list[bytes]:
    out = []
    for i, batch in enumerate(loader):
        if i == n:
            break
        out += [row.numpy().tobytes() for row in batch["input_ids"]]
    return out


@pytest.mark.slow  # loader worker processes
def test_the_same_seed_reads_the_same_windows_on_0_1_and_2_workers(tmp_path, small_shards):
    first = rows_of(datamodule(tmp_path).train_dataloader(), 40)
    for workers in (1, 2):
        dm = datamodule(tmp_path, num_workers=workers)
        assert rows_of(dm.train_dataloader(), 40) == first, workers
    other_seed = build_datamodule(
        {
            "name": "text",
            "path": str(tmp_path / "t.txt"),
            "tokenizer": "byte",
            "block_size": 32,
            "batch_size": 8,
            "cache_dir": str(tmp_path / "cache"),
        },
        "decoder",
        1,
    )
    assert rows_of(other_seed.train_dataloader(), 40) != first


def test_two_ddp_ranks_read_disjoint_windows_of_one_epoch(tmp_path, small_shards, monkeypatch):
    dm = datamodule(tmp_path)
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(lit_data, "_rank_world", lambda r=rank: (r, 2))
        seen.append(rows_of(ResumableLoader(dm.train_dataloader()), 10**9))
    a, b = map(set, seen)
    assert len(a) == len(seen[0]) and len(b) == len(seen[1]) and not a & b
    windows = len(dm.train_dataset())
    assert len(a) + len(b) == (windows // 8 // 2) * 2 * 8  # every rank the same number of whole batches


class SignalAtStep(Callback):
    """Test-only: SIGTERM to this process at the end of step ``step`` (a preemption): posformer saves a
    resumable checkpoint at the end of that step and stops."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _train(root: Path, cache: Path, extra: list[str]) -> list[tuple[int, str]]:
    from hydra import compose, initialize_config_module

    from posformer.cli.train import run

    overrides = [
        *TINY_MODEL,
        *[q for q in QUIET if not q.startswith("logger")],
        "logger=csv",
        "data=text",
        f"data.path={root.parent / 't.txt'}",
        "data.tokenizer=byte",
        "data.block_size=32",
        "data.batch_size=8",
        "data.eval_lengths=[32]",
        "evaluate=false",
        "torch_threads=1",
        "trainer.max_steps=12",
        "trainer.val_check_interval=100",
        "trainer.log_every_n_steps=1",
        "schedule.name=constant",
        "schedule.warmup_steps=2",
        "callbacks.model_checkpoint.monitor=null",
        "model.dropout=0.1",
        f"paths.root_dir={root}",
        f"paths.output_dir={root}/run",
        f"paths.cache_dir={cache}",
        *extra,
    ]
    # SignalAtStep's SIGTERM stops the run with Interrupted once its resumable checkpoint is saved
    with initialize_config_module("posformer.configs", version_base="1.3"), contextlib.suppress(Interrupted):
        run(compose("train", overrides=overrides))
    with open(root / "run" / "csv" / "metrics.csv") as f:
        return [(int(r["step"]), r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]


@pytest.mark.slow  # three short training runs
def test_a_mid_epoch_resume_from_shards_gives_the_bitwise_same_loss_curve(tmp_path, small_shards):
    write_text(tmp_path / "t.txt")
    cache = tmp_path / "cache"
    full = _train(tmp_path / "full", cache, [])
    stop = ["+callbacks.stop._target_=tests.data.test_shard_training.SignalAtStep", "+callbacks.stop.step=5"]
    half = _train(tmp_path / "half", cache, stop)
    last = tmp_path / "half" / "run" / "checkpoints" / "last.ckpt"
    resumed = _train(tmp_path / "resumed", cache, [f"ckpt_path={last}"])
    assert len(full) == 12 and half == full[: len(half)]  # (the CSV of the stopped run may lack its last row)
    assert resumed == full[5:]  # from the step after the checkpoint, every loss as logged: bitwise
