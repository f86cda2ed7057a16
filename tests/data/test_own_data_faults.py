"""Own data that ``datasets`` reads but posformer cannot train on, through the real ``posformer-train``
main in-process: a text column holding numbers or nulls, an empty file, a saved DatasetDict with an empty
validation split, a Latin-1 line in a UTF-8 JSON-lines file, a ``data_files`` glob that matches nothing.
Each is one line naming the value and the fix, exit 1, no traceback, the run dir's earlier files intact
(docs/reliability.md, "Own data, resources and numerics").
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from tests.cli_cases import QUIET, TINY_MODEL, assert_untouched, call, one_clear_line

ROWS = [{"text": f"doc {i}: the quick brown fox jumps over the lazy dog"} for i in range(40)]
HUB = [
    "data=hub",
    "data.tokenizer=char",
    "data.block_size=8",
    "data.eval_lengths=[8]",
    "data.batch_size=4",
    "trainer=cpu",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "schedule.warmup_steps=1",
    "torch_threads=1",
]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def train(args: list[str], run: Path, cache: Path, monkeypatch, capsys) -> tuple[int, str]:
    from posformer.cli.train import main

    argv = ["posformer-train", *TINY_MODEL, *QUIET, *HUB, f"hydra.run.dir={run}", f"paths.cache_dir={cache}"]
    return call(main, [*argv, f"paths.root_dir={run.parent}", *args], monkeypatch, capsys)


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """The working directory, offline, holding the data files the cases name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    mixed = [dict(r) for r in ROWS]
    mixed[5]["text"], mixed[7]["text"] = 12345, None
    Path("numbers.jsonl").write_bytes(jsonl(mixed))
    Path("nulls.jsonl").write_bytes(jsonl([r if i != 3 else {"text": None} for i, r in enumerate(ROWS)]))
    Path("empty.jsonl").write_bytes(b"")
    Path("good.jsonl").write_bytes(jsonl(ROWS))
    lines = jsonl(ROWS).split(b"\n")
    lines[10] = '{"text": "café au lait"}'.encode("latin-1")
    Path("latin1.jsonl").write_bytes(b"\n".join(lines))
    datasets.disable_progress_bars()
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "validation": datasets.Dataset.from_list(ROWS).select([])}
    ).save_to_disk("empty_val")
    return tmp_path


CASES = {
    # main: trained (exit 0) on str(12345) and "" for the null
    "numbers": (["data.dataset=numbers.jsonl"], ["holds 12345 (int) in row 5 of the train split", "jq"]),
    "nulls": (["data.dataset=nulls.jsonl"], ["holds None (NoneType) in row 3", "data.text_column"]),
    # main: StopIteration traceback from datasets' json builder
    "empty_file": (["data.dataset=empty.jsonl"], ["'empty.jsonl' is empty (0 bytes)"]),
    "empty_in_list": (["data.data_files=[good.jsonl,empty.jsonl]"], ["'empty.jsonl' is empty (0 bytes)"]),
    # main: IndexError traceback from datasets' load_from_disk
    "empty_validation": (
        ["data.dataset=empty_val"],
        ["validation split of disk:empty_val has no rows", "val_split=null"],
    ),
    # main: UnicodeDecodeError traceback from pyarrow, naming neither file nor line
    "latin1_line": (
        ["data.dataset=latin1.jsonl"],
        ["'latin1.jsonl' is not valid UTF-8: byte 0xe9 on line 11", "iconv"],
    ),
    # main: StopIteration traceback from datasets' json builder
    "glob_matches_nothing": (["data.data_files=nothere*.jsonl"], ["'nothere*.jsonl' matches no file"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_own_data_is_one_line_and_keeps_earlier_files(case, here, out_dir, monkeypatch, capsys):
    args, needles = CASES[case]
    code, text = train(args, out_dir, here / "cache", monkeypatch, capsys)
    line = one_clear_line(code, text, 1, *needles)
    assert line.startswith("error: "), line
    assert_untouched(out_dir)


def test_latin1_offset_is_the_bad_bytes_offset(here):
    """The byte offset named is where the bad byte is (the line and ``iconv`` fix point at it)."""
    from posformer.data.files import first_bad_utf8

    raw = Path("latin1.jsonl").read_bytes()
    line, offset, byte = first_bad_utf8(Path("latin1.jsonl"))
    assert raw[offset] == byte == 0xE9 and raw[:offset].count(b"\n") + 1 == line == 11
    assert first_bad_utf8(Path("good.jsonl")) is None


def test_an_empty_validation_split_trains_with_val_split_null(here, tmp_path, monkeypatch, capsys):
    """The fix the line names works: the training split's last val_fraction validates."""
    args = ["data.dataset=empty_val", "data.val_split=null"]
    code, text = train(args, tmp_path / "run", here / "c", monkeypatch, capsys)
    assert code == 0, text[-2000:]
