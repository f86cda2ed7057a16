"""The token store (posformer/data/store.py, building.py, sources.py): shards, their index, resumable and
atomic builds, repairs, budgets, splits by documents, and reading windows across shard boundaries."""

from __future__ import annotations

import errno
import json
import logging
import pickle
from pathlib import Path

import datasets
import numpy as np
import pytest

import posformer.data.sources as sources
import posformer.data.store as store_mod
from posformer.data import build_datamodule
from posformer.data.base import ResumableSampler, feistel_order
from posformer.data.lm import WindowDataset
from posformer.data.sources import is_validation
from posformer.errors import ConfigError, DataError

WORDS = (
    "the",
    "a",
    "river",
    "stone",
    "garden",
    "window",
    "horse",
    "lamp",
    "city",
    "sailor",
    "forest",
    "letter",
)


def write_text(path: Path, n_lines: int = 3000, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) + ".\n" for _ in range(n_lines)]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def text_dm(path: Path, cache: Path, **cfg):
    base = {"name": "text", "path": str(path), "tokenizer": "byte", "block_size": 32, "cache_dir": str(cache)}
    return build_datamodule({**base, **cfg}, "decoder", 0)


def store_files(store: Path) -> dict[str, bytes]:
    files = [p for p in sorted(store.rglob("*")) if p.is_file() and p.name != "meta.json"]
    return {str(p.relative_to(store)): p.read_bytes() for p in files}


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 4,096 tokens, from pieces of text of ~1,000 characters (a store of many shards from a
    small file)."""
    monkeypatch.setattr(store_mod, "SHARD_TOKENS", 4096)
    monkeypatch.setattr(sources, "PIECE_CHARS", 1000)
    monkeypatch.setattr(sources, "BATCH_CHARS", 4000)


# --------------------------------------------------------------------------------------- layout
def test_shards_read_back_as_one_stream(tmp_path, small_shards):
    text = write_text(tmp_path / "t.txt")
    dm = text_dm(text, tmp_path / "cache")
    meta = json.loads((dm.cache_path / "meta.json").read_text())
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) >= 5 and meta["dtype"] == "<u2"
    raw = text.read_bytes()
    cut = int(len(raw) * 0.9)  # ASCII: characters are bytes
    train = np.frombuffer(raw[:cut], dtype=np.uint8).astype(np.int64) + 4
    assert np.array_equal(np.asarray(dm.train_stream), train)  # the shards are the file's bytes, in order
    boundary = int(dm.train_stream.starts[1])  # a window across the first shard boundary
    assert np.array_equal(
        dm.train_stream[boundary - 10 : boundary + 10], train[boundary - 10 : boundary + 10]
    )
    windows = WindowDataset(dm.train_stream, 32)
    assert all(np.array_equal(windows[i], train[32 * i : 32 * i + 33]) for i in range(len(windows)))
    assert len(pickle.dumps(dm.train_stream)) < 4096  # pickled as paths (workers, DDP): no tokens copied
    again = pickle.loads(pickle.dumps(dm.train_stream))
    assert np.array_equal(again[100:5000], train[100:5000])


def test_the_store_is_byte_identical_on_two_processes(tmp_path, small_shards):
    text = write_text(tmp_path / "t.txt", n_lines=1500)
    one = text_dm(text, tmp_path / "c1", tokenizer="bpe", vocab_size=300)
    two = text_dm(text, tmp_path / "c2", tokenizer="bpe", vocab_size=300, num_proc=2)
    assert store_files(one.cache_path) == store_files(two.cache_path)


# ------------------------------------------------------------------------------ resume and repair
def test_a_killed_build_continues_after_its_last_complete_shard(tmp_path, small_shards, monkeypatch, caplog):
    text = write_text(tmp_path / "t.txt")
    whole = text_dm(text, tmp_path / "whole")
    calls = {"n": 0}
    close = store_mod.ShardWriter.close_shard

    def killed_at_the_third(self):  # the process dies while writing its third shard
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        close(self)

    monkeypatch.setattr(store_mod.ShardWriter, "close_shard", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        text_dm(text, tmp_path / "cache")
    monkeypatch.setattr(store_mod.ShardWriter, "close_shard", close)
    (partial,) = (tmp_path / "cache" / "text").glob("*.partial")
    assert sorted(p.name for p in (partial / "train").glob("*.json")) == ["000000.json", "000001.json"]
    kept = sum(json.loads(p.read_text())["tokens"] for p in (partial / "train").glob("*.json"))
    with caplog.at_level(logging.INFO, logger="posformer.data"):
        dm = text_dm(text, tmp_path / "cache")
    assert any(
        f"continuing an unfinished build after {kept:,} tokens" in r.getMessage() for r in caplog.records
    )
    assert store_files(dm.cache_path) == store_files(whole.cache_path)


def test_a_damaged_shard_is_rebuilt_from_there_keeping_the_shards_before(tmp_path, small_shards, caplog):
    text = write_text(tmp_path / "t.txt")
    dm = text_dm(text, tmp_path / "cache")
    before = store_files(dm.cache_path)
    first = dm.cache_path / "train" / "000000.bin"
    inode = first.stat().st_ino
    damaged = dm.cache_path / "train" / "000002.bin"
    damaged.write_bytes(damaged.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="posformer.data"):
        again = text_dm(text, tmp_path / "cache")
    [line] = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert "train/000002.bin" in line and "from train shard 2 on" in line and "kept" in line, line
    assert store_files(again.cache_path) == before
    assert first.stat().st_ino == inode  # not rewritten


def test_a_full_disk_is_one_line_and_the_next_run_finishes_the_build(tmp_path, small_shards, monkeypatch):
    text = write_text(tmp_path / "t.txt")
    whole = text_dm(text, tmp_path / "whole")
    writes = {"n": 0}

    class FillingDisk:  # a shard file whose tenth write finds the disk full
        def __init__(self, *args):
            self.file = open(*args)  # noqa: SIM115

        def write(self, data):
            writes["n"] += 1
            if writes["n"] == 10:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(store_mod, "open", FillingDisk, raising=False)
    with pytest.raises(DataError) as err:
        text_dm(text, tmp_path / "cache")
    line = str(err.value)
    assert "\n" not in line and "is full" in line and "complete train shard(s)" in line, line
    assert "data.cache_dir=" in line and "run the same command again" in line, line
    (partial,) = (tmp_path / "cache" / "text").glob("*.partial")
    assert not list(partial.rglob("*.tmp*"))  # the unfinished shard is gone (its bytes freed)
    kept = sorted(p.name for p in (partial / "train").glob("*.json"))
    monkeypatch.delattr(store_mod, "open")
    dm = text_dm(text, tmp_path / "cache")
    assert kept and store_files(dm.cache_path) == store_files(whole.cache_path)


# --------------------------------------------------------------------------------- rows and budgets
def rows(n: int, column: str = "text"):
    return [
        {column: f"document {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(8))}
        for i in range(n)
    ]


def test_validation_is_every_tenth_document_and_max_tokens_takes_a_prefix(tmp_path):
    datasets.Dataset.from_list(rows(400)).save_to_disk(str(tmp_path / "saved"))
    cfg = {
        "name": "hub",
        "dataset": str(tmp_path / "saved"),
        "tokenizer": "byte",
        "block_size": 16,
        "cache_dir": str(tmp_path / "cache"),
    }
    dm = build_datamodule(cfg, "decoder", 0)
    val = dm.decode(np.asarray(dm.val_stream))
    assert [f"document {i}:" in val for i in range(12)] == [is_validation(i, 0.1) for i in range(12)]
    assert dm.meta["splits"]["val"]["documents"] == 40 and dm.meta["splits"]["train"]["documents"] == 360
    ends = dm.train_stream.documents()
    assert len(ends) == 360 and dm.decode(dm.train_stream[: ends[0]]).startswith("document 0:")
    capped = build_datamodule({**cfg, "max_tokens": 1000}, "decoder", 0)
    assert len(capped.train_stream) == 1000 and len(capped.val_stream) == 112  # ceil(1000 * 0.1 / 0.9)
    assert np.array_equal(np.asarray(capped.train_stream), np.asarray(dm.train_stream[:1000]))


def test_a_streamed_hub_dataset_is_read_only_up_to_its_budget(tmp_path, monkeypatch):
    read = {"rows": 0}

    def generate():
        for row in rows(100_000):
            read["rows"] += 1
            yield row

    def load_dataset(name, config=None, split=None, streaming=False, **kwargs):
        assert streaming and name == "someone/huge-corpus"
        return datasets.IterableDataset.from_generator(generate)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = {
        "name": "hub",
        "dataset": "someone/huge-corpus",
        "streaming": True,
        "val_split": None,
        "tokenizer": "byte",
        "block_size": 16,
        "max_tokens": 20_000,
        "cache_dir": str(tmp_path),
    }
    dm = build_datamodule(cfg, "decoder", 0)
    assert len(dm.train_stream) == 20_000 and read["rows"] < 2_000  # a prefix of 100,000 rows
    assert dm.source_name() == "hub:someone/huge-corpus"


def test_an_iterable_dataset_without_the_text_column_is_one_line_before_any_write(tmp_path, monkeypatch):
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda *a, **k: datasets.IterableDataset.from_generator(lambda: iter(rows(50, column="body"))),
    )
    cfg = {
        "name": "hub",
        "dataset": "someone/corpus",
        "streaming": True,
        "val_split": None,
        "tokenizer": "byte",
        "cache_dir": str(tmp_path / "cache"),
    }
    with pytest.raises(ConfigError) as err:
        build_datamodule(cfg, "decoder", 0)
    assert "data.text_column='text' is not a column of hub:someone/corpus; columns: ['body']" in str(
        err.value
    )
    assert not (tmp_path / "cache" / "text").exists() or not any((tmp_path / "cache" / "text").rglob("*.bin"))


# ------------------------------------------------------------------------------------------- order
def test_window_orders_of_huge_stores_are_permutations_computed_in_blocks():
    state = np.array([7, 11], dtype=np.uint32)
    for n in (1, 5, 1000, 65_537):
        order = feistel_order(n, state, 0, n)
        assert np.array_equal(np.sort(order), np.arange(n))
        assert np.array_equal(feistel_order(n, state, n // 3, n // 2), order[n // 3 : n // 2])
    sampler = ResumableSampler(1 << 25, seed=3)  # above RANDPERM_LIMIT: never materialised whole
    first = [i for _, i in zip(range(70_000), iter(sampler), strict=False)]
    assert len(set(first)) == 70_000 and max(first) < 1 << 25
    sampler.skip = 65_536
    assert next(iter(sampler)) == first[65_536]


def test_a_build_logs_its_progress_and_one_size_line(tmp_path, small_shards, monkeypatch, caplog):
    import posformer.data.building as building

    monkeypatch.setattr(building, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="posformer.data"):
        dm = text_dm(write_text(tmp_path / "t.txt"), tmp_path / "cache")
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data store ")]
    assert progress and all("tokens/s" in line and "% read, ETA " in line for line in progress), progress
    sizes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data /")]
    assert sizes == [dm.size_line()] and f"{len(dm.train_stream):,} tokens" in sizes[0]


# ------------------------------------------------------------------------------------- translation
def pair_rows(n: int) -> list[dict]:
    return [
        {
            "translation": {
                "de": f"ein satz {i} über {WORDS[i % 12]}",
                "en": f"a sentence {i} about {WORDS[i % 12]}",
            }
        }
        for i in range(n)
    ]


def test_translation_pairs_stream_from_the_hub_into_memory_mapped_stores(tmp_path, monkeypatch):
    """A hub translation dataset (here generated) is read in batches and encoded into token stores: the
    corpus holds memory-mapped streams and per-pair offsets, not the sentences."""
    splits = {"train": pair_rows(3000), "validation": pair_rows(50), "test": pair_rows(40)}
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda name, config, split, revision=None: datasets.Dataset.from_list(splits[split]),
    )
    cfg = {
        "name": "translation",
        "source": "hub",
        "hub_name": "someone/wmt",
        "hub_config": "de-en",
        "vocab_size": 300,
        "splits": {"train": "train", "val": "validation", "test": "test"},
        "max_tokens": 256,
        "max_len": 64,
        "min_frequency": 1,
        "cache_dir": str(tmp_path / "cache"),
    }
    dm = build_datamodule(cfg, "encoder_decoder", 0)
    train = dm.corpora["train"]
    assert all(isinstance(flat, store_mod.TokenStream) for flat in (train.src_flat, train.tgt_flat))
    assert len(train) == 3000 and len(train.src_off) == 3001
    row = train[7]
    assert dm.decode(row["src"]) == f"ein satz 7 über {WORDS[7]}"
    assert dm.decode(row["tgt"]) == f"a sentence 7 about {WORDS[7]}"
    again = build_datamodule(cfg, "encoder_decoder", 0)  # from the cache: the same batches
    assert [list(b) for b in again.train_dataloader().batch_sampler] == [
        list(b) for b in dm.train_dataloader().batch_sampler
    ]


def test_a_glob_of_files_with_sample_by_document_makes_each_file_one_document(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    for i in range(20):
        (books / f"book{i:02d}.txt").write_text("".join(f"book {i} line {k}.\n" for k in range(30)))
    cfg = {
        "name": "hub",
        "data_files": str(books / "*.txt"),
        "sample_by": "document",
        "tokenizer": "byte",
        "block_size": 16,
        "cache_dir": str(tmp_path / "cache"),
    }
    dm = build_datamodule(cfg, "decoder", 0)
    assert dm.meta["splits"]["train"]["documents"] == 18 and dm.meta["splits"]["val"]["documents"] == 2
    first = dm.decode(dm.train_stream[: int(dm.train_stream.documents()[0])])
    assert first.startswith("book ") and first.count("line") == 30  # one whole file
