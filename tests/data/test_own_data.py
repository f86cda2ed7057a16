"""Your own data (docs/training.md, "Your own data"): every documented command composes and loads, on
files this test generates with ``datasets`` (no hub: HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1); the log
says how much was read; bad local data is one line."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import datasets
import pytest

import posformer
from posformer.api import compose
from posformer.data import build_datamodule
from posformer.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
N = 200  # records per file
SMALL = ["data.tokenizer=char", "data.block_size=16", "data.eval_lengths=[16]", "data.batch_size=4"]


def record(i: int, tag: str = "doc") -> str:
    return f"{tag} {i}: the quick brown fox jumps over the lazy dog"


def documented_commands() -> list[list[str]]:
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    body = text.split("## Your own data", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, flags=re.S).group(1)
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.strip()]


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    """The files the documented commands name, in the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": record(i)} for i in range(N)]
    Path("corpus.txt").write_text("".join(r["text"] + "\n" for r in rows))
    Path("corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("corpus.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list([{"id": i, "body": r["text"]} for i, r in enumerate(rows)]).to_csv(
        "corpus.csv"
    )
    datasets.Dataset.from_list(rows).to_parquet("corpus.parquet")
    datasets.Dataset.from_list(rows).save_to_disk("saved_dataset")
    held_out = [{"text": record(i, "held")} for i in range(N // 4)]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "validation": datasets.Dataset.from_list(held_out)}
    )
    dd.save_to_disk("saved_dict")
    Path("folder").mkdir()
    Path("folder/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("folder/validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    Path("part1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("part2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    return tmp_path


def _load(overrides: list[str], cache: Path):
    cfg = compose("train", [*overrides, *SMALL, f"paths.cache_dir={cache}"])
    return build_datamodule(cfg.data, "decoder", 0)


def test_every_documented_command_loads_offline(data_dir, caplog):
    commands = documented_commands()
    assert len(commands) == 13
    for i, overrides in enumerate(commands):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="posformer.data"):
            dm = _load(overrides, data_dir / f"cache{i}")
        train, val = dm.decode(dm.train_stream), dm.decode(dm.val_stream)
        assert train.startswith(record(0) + "\n"), (overrides, train[:80])
        given = " ".join(overrides)
        split_files = any(x in given for x in ("saved_dict", "folder", "validation:"))
        listed = "part2" in given and not split_files  # both files are the training split
        if split_files:  # a validation split of its own: the held-out records
            assert val.startswith(record(0, "held")) and "held" not in train, overrides
        elif listed:  # every tenth document of part1 + part2 (data.val_fraction=0.1)
            assert record(N - 2) in train and record(N // 4 - 1, "held") in val, overrides
            assert record(N - 1) in val and record(N - 1) not in train, overrides
        elif "data=text" in overrides:  # the last val_fraction of the text
            assert "held" not in val and record(N - 1) in val, overrides
        else:  # every tenth document
            assert "held" not in val and record(N - 1) in val and record(9) in val and record(8) in train
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data ")]
        chars = dm.meta["splits"]["train"]["chars"]
        assert f"train {chars:,} characters" in line or "documents" in line, line
        assert f"{len(dm.train_stream):,} tokens" in line and f"{len(dm.val_stream):,} tokens" in line
        if "data=text" not in overrides:
            rows = N + N // 4 if listed else N  # rows of the training split
            docs = rows if split_files else rows - rows // 10  # less every tenth, the validation documents
            assert f"train {docs:,} documents" in line, line


def test_a_saved_dataset_dict_trains(data_dir):
    model = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32"]
    quiet = ["logger=none", "callbacks.pe_heatmap=null", "callbacks.lr_monitor=null"]
    training = ["trainer=cpu", "trainer.max_steps=4", *quiet]
    overrides = ["data=hub", "data.dataset=saved_dict", *SMALL, *model, *training]
    result = posformer.train([*overrides, f"paths.cache_dir={data_dir / 'cache'}"], run_dir=data_dir / "run")
    assert result.global_step == 4 and result.metrics[16]["n_tokens"] > 0
    assert result.results["data"]["source"] == f"disk:{Path('saved_dict')}"


@pytest.mark.parametrize(
    ("overrides", "error", "expected"),
    [
        (["data.dataset=corpus.xml"], ConfigError, "cannot tell the format of \\['corpus.xml'\\]"),
        (["data.data_files=notes.md"], ConfigError, "cannot tell the format of \\['notes.md'\\]"),
        (["data.data_files=missing.jsonl"], DataError, "'missing.jsonl' does not exist"),
        (
            ["data.dataset=xml", "data.data_files=corpus.jsonl"],
            ConfigError,
            "valid: json, csv, parquet, text",
        ),
        (["data.dataset=saved_dict", "data.train_split=training"], ConfigError, "its splits: \\['train', "),
        (["data.dataset=corpus.csv"], ConfigError, "text_column='text' is not a column"),
        ([], ConfigError, "data=hub needs a dataset"),
    ],
)
def test_bad_local_data_is_one_line(data_dir, overrides, error, expected):
    Path("corpus.xml").write_text("<a/>")
    Path("notes.md").write_text("# notes\n")
    with pytest.raises((ConfigError, DataError)) as err:
        _load(["data=hub", *overrides], data_dir / "cache")
    assert "\n" not in str(err.value)
    assert isinstance(err.value, error) and re.search(expected, str(err.value)), str(err.value)


def test_text_refuses_structured_files_with_the_command_that_reads_them(data_dir):
    with pytest.raises(DataError, match="use data=hub data.dataset=corpus.jsonl data.text_column=<column>"):
        _load(["data=text", "data.path=corpus.jsonl"], data_dir / "cache")
