"""Data input through the real main (``posformer.cli.train.main`` in-process, ``sys.argv`` patched).

Bad data must exit non-zero with one line naming the value, the limit and the fix (no traceback),
and leave the files an earlier run wrote into the run dir byte-identical. Data that posformer can
read (gzip text) must train. A trained run keeps its tokenizer in ``<run_dir>/tokenizer/``.
"""

from __future__ import annotations

import bz2
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from posformer.data import build_datamodule, load_tokenizer_dir
from tests import cli_cases

TEXT_TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.d_ff=32",
    "data.block_size=8",
    "data.eval_lengths=[8]",
    "data.batch_size=8",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "schedule.warmup_steps=1",
    "torch_threads=1",
    "logger=none",
    "callbacks.lr_monitor=null",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
]
TEXT = "".join(f"line {i % 17}: to be or not to be, that is the question.\n" for i in range(60))


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def no_data_env(monkeypatch):
    for var in ("POSFORMER_DATA", "POSFORMER_TEXT", "POSFORMER_ROOT"):
        monkeypatch.delenv(var, raising=False)


def train_cli(
    args: list[str], run: Path, cache: Path, monkeypatch, capsys, tiny: list[str] = TEXT_TINY
) -> tuple[int, str]:
    """``posformer-train`` in-process on the text-LM tiny overrides (``cli_cases.train_cli``)."""
    return cli_cases.train_cli(args, run, cache, monkeypatch, capsys, tiny=tiny)


def assert_clean_failure(code: int, text: str, run: Path, *needles: str) -> str:
    """Non-zero exit, no traceback, one ``error:`` line holding every needle; earlier files intact."""
    assert code != 0, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text[-2000:]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in:\n{lines[0]}"
    cli_cases.assert_untouched(run)
    assert not (run / "tokenizer").exists()
    return lines[0]


# --------------------------------------------------------------------------------------------- gzip
def test_gzip_text_trains_and_the_run_keeps_its_tokenizer(tmp_path, cache_dir, monkeypatch, capsys):
    plain = tmp_path / "corpus.txt"
    plain.write_text(TEXT, encoding="utf-8")
    packed = tmp_path / "corpus.txt.gz"
    packed.write_bytes(gzip.compress(TEXT.encode()))
    disguised = tmp_path / "disguised.txt"  # gzip bytes behind a .txt name: detected by magic bytes
    disguised.write_bytes(packed.read_bytes())
    cfg = {"name": "text", "block_size": 8, "cache_dir": str(tmp_path / "dm_cache")}
    ref = build_datamodule({**cfg, "path": str(plain)}, "decoder", 0)
    for path in (packed, disguised):
        dm = build_datamodule({**cfg, "path": str(path)}, "decoder", 0)
        assert np.array_equal(dm.train_stream, ref.train_stream)
        assert np.array_equal(dm.val_stream, ref.val_stream)
        assert dm.vocab_size == ref.vocab_size and dm.compressed and not ref.compressed

    run = tmp_path / "run"
    run_cache = tmp_path / "run_cache"
    code, text = train_cli(["data=text", f"data.path={disguised}"], run, run_cache, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    assert json.loads((run / "results.json").read_text())["results"]
    meta = json.loads((run / "tokenizer" / "meta.json").read_text())
    assert (
        meta["kind"] == "char" and meta["vocab_size"] == ref.vocab_size and meta["source"] == str(disguised)
    )
    shutil.rmtree(run_cache)  # the run dir alone is enough to tokenise like the run did
    tok = load_tokenizer_dir(run / "tokenizer")
    sample = "to be or not to be, the question."
    assert np.array_equal(tok.encode(sample), ref.tokenizer.encode(sample))
    assert tok.decode(tok.encode(sample)) == sample


def test_damaged_gzip_and_other_archives_are_one_clear_line(
    out_dir, cache_dir, tmp_path, monkeypatch, capsys
):
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(gzip.compress(TEXT.encode())[:40])  # truncated
    code, text = train_cli(["data=text", f"data.path={broken}"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, out_dir, "broken.txt.gz", "gzip-compressed", "gzip -t")
    packed = tmp_path / "corpus.txt.bz2"
    packed.write_bytes(bz2.compress(TEXT.encode()))
    code, text = train_cli(["data=text", f"data.path={packed}"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(
        code, text, out_dir, "corpus.txt.bz2", "not UTF-8 text", "bzip2-compressed", "bunzip2 -k"
    )


# ------------------------------------------------------------------------------------- empty splits
def test_text_too_short_for_one_validation_window(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 8, encoding="utf-8")  # 80 characters: the last 10% = 8 < 9 tokens
    code, text = train_cli(["data=text", f"data.path={short}"], out_dir, cache_dir, monkeypatch, capsys)
    line = assert_clean_failure(
        code,
        text,
        out_dir,
        "short.txt",
        "(80 bytes)",
        "validation split",
        "has 8 tokens",
        "data.block_size + 1 = 9",
        "at least ~90 characters",
        "data.val_fraction to 0.12",
        "data.block_size to 7",
    )
    assert "POSFORMER" not in line  # data.path was given on the command line: no variable to name
    # the suggested fixes work: 90 characters, or val_fraction=0.12
    short.write_text("abcdefghij" * 9, encoding="utf-8")
    assert (
        len(build_datamodule({"name": "text", "path": str(short), "block_size": 8}, "decoder", 0).val_stream)
        == 9
    )
    short.write_text("abcdefghij" * 8, encoding="utf-8")
    dm = build_datamodule(
        {"name": "text", "path": str(short), "block_size": 8, "val_fraction": 0.12}, "decoder", 0
    )
    assert len(dm.val_stream) >= 9


def _corpus(root: Path, empty_split: str) -> Path:
    root.mkdir()
    for split in ("train", "val", "test"):
        n = 0 if split == empty_split else 6
        (root / f"{split}.de").write_text("".join(f"ein satz {i}\n" for i in range(n)))
        (root / f"{split}.en").write_text("".join(f"a sentence {i}\n" for i in range(n)))
    return root


@pytest.mark.parametrize("split", ["val", "test"])
def test_empty_parallel_corpus_split(split, out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    corpus = _corpus(tmp_path / "corpus", split)
    args = [
        "data=translation",
        f"data.path={corpus}",
        "model=encdec_tiny",
        "model.n_encoder_layers=1",
        "model.n_decoder_layers=1",
        "pe=sinusoidal",
        "data.splits={train: train, val: val, test: test}",
        "data.vocab_size=300",
        "data.max_tokens=256",
    ]
    tiny = [a for a in TEXT_TINY if not a.startswith(("data.", "model.n_layers"))]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys, tiny=tiny)
    assert_clean_failure(
        code,
        text,
        out_dir,
        f"{split}.de' 0 lines / 0 bytes",
        f"{split}.en' 0 lines / 0 bytes",
        "at least 1 line",
    )


def test_translation_training_pairs_all_too_long_or_empty(tmp_path):
    from posformer.errors import DataError

    corpus = _corpus(tmp_path / "corpus", "none")
    (corpus / "train.de").write_text("ein sehr langer satz mit vielen woertern\n\n")
    (corpus / "train.en").write_text("a very long sentence with many words\nhello\n")
    cfg = {
        "name": "translation",
        "path": str(corpus),
        "splits": {"train": "train", "val": "val", "test": "test"},
    }
    with pytest.raises(
        DataError, match=r"train split.*max_len=4.*2 pairs: 1 with an empty side, 1 longer.*>= \d+"
    ):
        build_datamodule({**cfg, "vocab_size": 300, "max_len": 4, "max_tokens": 8}, "encoder_decoder", 0)
    dm = build_datamodule({**cfg, "vocab_size": 300, "max_len": 64, "max_tokens": 64}, "encoder_decoder", 0)
    assert len(dm.train_dataset()) == 1 and dm.n_dropped == 1
    saved = dm.save_tokenizer(tmp_path / "run")  # what the training flow calls
    tok = load_tokenizer_dir(saved)
    assert saved == tmp_path / "run" / "tokenizer" and tok.vocab_size == dm.vocab_size
    assert tok.encode("ein satz").tolist() == dm.encode("ein satz")


# ------------------------------------------------------------------------- the variable that works
def test_lm_shakespeare_without_data_names_posformer_data(
    out_dir, cache_dir, no_data_env, monkeypatch, capsys
):
    code, text = train_cli(["experiment=lm_shakespeare"], out_dir, cache_dir, monkeypatch, capsys)
    line = assert_clean_failure(
        code, text, out_dir, "tinyshakespeare/input.txt", "file not found", "POSFORMER_DATA", "data.path="
    )
    assert "POSFORMER_TEXT" not in line  # that experiment does not read it
    empty = out_dir.parent / "empty_data"
    empty.mkdir()
    monkeypatch.setenv("POSFORMER_DATA", str(empty))
    code, text = train_cli(["experiment=lm_shakespeare"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(
        code, text, out_dir, f"POSFORMER_DATA={empty}", "folder that holds tinyshakespeare/input.txt"
    )


def test_data_text_without_path_names_posformer_text(out_dir, cache_dir, no_data_env, monkeypatch, capsys):
    code, text = train_cli(["data=text"], out_dir, cache_dir, monkeypatch, capsys)
    line = assert_clean_failure(
        code, text, out_dir, "data=text needs a text file", "data.path=", "POSFORMER_TEXT"
    )
    assert "POSFORMER_DATA" not in line


# ------------------------------------------------------------------------- a misspelled local file
def test_a_misspelled_local_dataset_is_a_missing_file_not_a_hub_error(tmp_path):
    from posformer.data.hub import local_source
    from posformer.errors import DataError

    (tmp_path / "input.txt").write_text("some text\n")
    with pytest.raises(DataError, match=r"no such file .*; did you mean .*input\.txt\?"):
        local_source(str(tmp_path / "inptu.txt"), None)
    with pytest.raises(DataError, match=r"'\./nowhere/x\.jsonl': no such file"):
        local_source("./nowhere/x.jsonl", None)
    assert local_source("wikitext", None) is None and local_source("org/name", None) is None  # hub names


def test_a_misspelled_text_path_names_the_closest_file(tmp_path):
    from posformer.data.text import TextDataModule
    from posformer.errors import DataError

    (tmp_path / "input.txt").write_text("some text\n")
    with pytest.raises(DataError, match=r"file not found .*; did you mean .*/input\.txt\?"):
        TextDataModule({"path": str(tmp_path / "inptu.txt"), "cache_dir": str(tmp_path)}, "decoder", 0)
