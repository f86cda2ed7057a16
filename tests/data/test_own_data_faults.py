"""Own data that ``datasets`` reads but posformer cannot train on, through the real ``posformer-train``
main in-process: a text column holding numbers or nulls, an empty file, a saved DatasetDict with an empty
validation split, a Latin-1 line in a UTF-8 JSON-lines file, a ``data_files`` glob that matches nothing.
Each is one line naming the value and the fix, exit 1, no traceback, the run dir's earlier files intact
(docs/reliability.md, "Own data, resources and numerics").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import pytest

from posformer.errors import ConfigError
from posformer.io import hold_lock, keep_alive, release_lock
from tests.cli_cases import QUIET, TINY_MODEL, assert_untouched, call, one_clear_line

ROOT = Path(__file__).resolve().parents[2]
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
    "numbers": (
        ["data.dataset=numbers.jsonl"],
        ["holds 12345 (int) in row 5 (counting from 0) of the train split", "jq"],
    ),
    "nulls": (
        ["data.dataset=nulls.jsonl"],
        ["holds None (NoneType) in row 3 (counting from 0)", "data.text_column"],
    ),
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


# ------------------------------------------------------------------------------------------ the store's lock
def _holder(lock: Path) -> subprocess.Popen:
    """Another process holding ``lock`` as a build does (its record written), silent from then on."""
    code = (
        "import sys, time\nfrom posformer.io import hold_lock\n"
        "hold_lock(sys.argv[1], wait=0, what='lock', busy=str, fix='-')\n"
        "print('held', flush=True)\ntime.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_store_lock_held_by_a_stopped_build_names_it_and_times_out(here, tmp_path, monkeypatch, capsys):
    """A build stopped with SIGSTOP holds ``<key>.lock``: the next run waits while the holder is silent
    for ``LOCK_WAIT`` (here 2 s), then one line names its pid, host and start (main: waited forever)."""
    from posformer.data import building

    cache = tmp_path / "cache"
    code, text = train(["data.dataset=good.jsonl"], tmp_path / "first", cache, monkeypatch, capsys)
    assert code == 0, text[-2000:]
    [lock] = (cache / "text").glob("*.lock")
    shutil.rmtree(lock.with_suffix(""))  # the store must be built again, under its lock
    monkeypatch.setattr(building, "LOCK_WAIT", 2.0)
    proc = _holder(lock)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        code, text = train(["data.dataset=good.jsonl"], tmp_path / "second", cache, monkeypatch, capsys)
        line = one_clear_line(code, text, 1, f"pid {proc.pid} on ", "since ", "kill -CONT")
        assert "no sign of life for over 2 s" in line, line
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    code, text = train(["data.dataset=good.jsonl"], tmp_path / "third", cache, monkeypatch, capsys)
    assert code == 0, text[-2000:]  # the holder gone, the build goes on


def test_a_symlink_at_the_store_lock_is_refused_and_its_target_kept(here, tmp_path, monkeypatch, capsys):
    """main: ``open(lock, "a")`` followed the link (a file outside the cache was opened for appending)."""
    from posformer.data.building import store_lock

    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"keep me\n")
    folder = tmp_path / "cache" / "text" / "key"
    folder.parent.mkdir(parents=True)
    folder.with_name("key.lock").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"lock file .*key.lock' is a symlink") as err, store_lock(folder):
        pass
    assert "\n" not in str(err.value) and outside.read_bytes() == b"keep me\n"


def test_a_live_holder_is_waited_for_and_a_silent_one_refused(tmp_path):
    """``hold_lock(alive=True)`` waits past ``wait`` while the holder touches the lock (``keep_alive``),
    and refuses a holder silent for ``wait`` seconds."""
    lock = tmp_path / "store.lock"
    fd = hold_lock(lock, wait=0, what="lock", busy=str, fix="-")

    def hold_then_release() -> None:
        with keep_alive(fd, 0.05):
            time.sleep(1.0)
        release_lock(fd)

    thread = threading.Thread(target=hold_then_release)
    start = time.monotonic()
    thread.start()
    other = hold_lock(lock, wait=0.3, alive=True, what="lock", busy=lambda h: f"busy: {h}", fix="-")
    assert time.monotonic() - start >= 0.9  # it waited for the live holder, past wait=0.3
    thread.join()
    with pytest.raises(ConfigError, match=f"busy: pid {os.getpid()} on "):  # silent: refused
        hold_lock(lock, wait=0.3, alive=True, what="lock", busy=lambda h: f"busy: {h}", fix="-")
    release_lock(other)
