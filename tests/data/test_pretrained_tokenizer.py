"""Pretrained tokenizers (posformer/data/pretrained.py): a tokenizer.json or an HF tokenizer folder the
test trains and saves itself (no hub), end-of-text between documents, uint32 stores above 65,535 ids,
the run's saved copy reused by evaluation and generation, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import posformer
from posformer.data import build_datamodule, load_tokenizer_dir
from posformer.errors import CheckpointError, ConfigError, DataError
from tests.cli_cases import QUIET, TINY_MODEL

WORDS = ("river", "stone", "garden", "window", "horse", "lamp", "city", "sailor", "forest", "letter")


def lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(4, 12))) + "." for _ in range(n)]


def bpe_json(path: Path, vocab_size: int = 400, seed: int = 0) -> Path:
    """A GPT-2-style byte-level BPE with <|endoftext|>, trained here and saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines(500, seed), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def word_json(path: Path, n_words: int = 70_000) -> Path:
    """A word-level tokenizer of more than 65,535 ids, trained here on generated words."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"], vocab_size=n_words + 10)
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(n_words))], trainer=trainer)
    tok.save(str(path))
    return path


def hub_cfg(tmp_path: Path, tokenizer: str, **cfg) -> dict:
    saved = tmp_path / "saved"
    if not saved.exists():
        datasets.Dataset.from_list([{"text": t} for t in lines(300)]).save_to_disk(str(saved))
    base = {
        "name": "hub",
        "dataset": str(saved),
        "tokenizer": tokenizer,
        "block_size": 16,
        "cache_dir": str(tmp_path / "cache"),
    }
    return {**base, **cfg}


# ---------------------------------------------------------------------------------------- the data
def test_documents_end_with_the_tokenizers_end_of_text(tmp_path):
    file = bpe_json(tmp_path / "tok" / "tokenizer.json")
    dm = build_datamodule(hub_cfg(tmp_path, str(file)), "decoder", 0)
    tok = Tokenizer.from_file(str(file))
    eos = tok.token_to_id("<|endoftext|>")
    assert (
        dm.tokenizer.kind == "pretrained"
        and dm.vocab_size == tok.get_vocab_size()
        and dm.tokenizer.eos_id == eos
    )
    assert dm.meta["dtype"] == "<u2"
    first = [t for i, t in enumerate(lines(300)) if (i + 1) % 10]  # every tenth document validates
    ids = np.asarray(dm.train_stream[:200]).tolist()
    expected = []
    for text in first:
        expected += tok.encode(text + "\n", add_special_tokens=False).ids + [eos]
    assert ids == expected[:200]
    ends = dm.train_stream.documents()
    assert all(int(dm.train_stream[int(e) - 1]) == eos for e in ends[:20])
    assert dm.decode(ids[: int(ends[0])]) == first[0] + "\n"  # the end-of-text is skipped


def test_an_hf_tokenizer_folder_names_its_end_of_text_in_its_config(tmp_path):
    folder = tmp_path / "gpt2-like"
    bpe_json(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    dm = build_datamodule(hub_cfg(tmp_path, str(folder)), "decoder", 0)
    assert dm.tokenizer.eos_token == "<|endoftext|>" and dm.tokenizer.info()["tokenizer_source"] == str(
        folder
    )


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("notes.txt", DataError, "'notes.txt' is not a tokenizer"),
        ("missing/tokenizer.json", DataError, "no such file or folder"),
        ("bytes", ConfigError, "did you mean byte?"),
        ("someone/tokenizer", DataError, "no hub tokenizer of that name could be read"),
    ],
)
def test_a_value_that_is_not_a_tokenizer_is_one_line_before_any_data_is_read(
    value, error, words, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    Path("notes.txt").write_text("these are notes, not a tokenizer\n")
    with pytest.raises(error) as err:
        build_datamodule(hub_cfg(tmp_path, value), "decoder", 0)
    line = str(err.value)
    assert "\n" not in line and words in line and "tokenizer.json" in line, line
    assert not (tmp_path / "cache" / "text").exists()


# ------------------------------------------------------------------------------------ whole runs
def train_args(tmp_path: Path, tokenizer: Path, *extra: str) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(
            "\n".join(" ".join(f"w{(7 * i + k) % 70_000}" for k in range(12)) for i in range(3000))
        )
    return [
        *TINY_MODEL,
        *QUIET,
        "data=text",
        f"data.path={corpus}",
        f"data.tokenizer={tokenizer}",
        "data.block_size=16",
        "data.eval_lengths=[16,32]",
        "data.batch_size=4",
        "data.eval_tokens=256",
        "trainer=cpu",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "data.val_tokens=256",
        "callbacks.model_checkpoint.monitor=null",
        f"paths.cache_dir={tmp_path / 'cache'}",
        *extra,
    ]


@pytest.mark.slow  # a training run, its evaluation and generation
def test_a_tokenizer_of_more_than_65535_ids_trains_evaluates_and_generates(tmp_path):
    file = word_json(tmp_path / "words.json")
    result = posformer.train(train_args(tmp_path, file), run_dir=tmp_path / "run")
    assert result.global_step == 3 and result.metrics[32]["n_tokens"] > 0
    meta = json.loads(next((tmp_path / "cache" / "text").glob("*/meta.json")).read_text())
    assert meta["dtype"] == "<u4" and meta["vocab_size"] == 70_002
    file.unlink()  # evaluation and generation read the run's own copy
    saved = load_tokenizer_dir(tmp_path / "run" / "tokenizer")
    assert saved.kind == "pretrained" and saved.vocab_size == 70_002
    ev = posformer.evaluate(
        tmp_path / "run",
        which="last",
        lengths=[16, 32],
        output_dir=tmp_path / "ev",
        batch_tokens=256,
        modes=["nonoverlap"],
    )
    assert [r["status"] for r in ev.rows] == ["ok", "ok"]
    run = posformer.load_run(tmp_path / "run")
    text = run.generate("w1 w8 w15", max_new_tokens=4, temperature=0)
    assert len(text.split()) == 4 and all(w.startswith("w") for w in text.split())


@pytest.mark.slow  # two training runs and an evaluation
def test_another_tokenizer_is_refused_at_resume_and_at_evaluation(tmp_path):
    first = bpe_json(tmp_path / "a" / "tokenizer.json", seed=0)
    other = bpe_json(tmp_path / "b" / "tokenizer.json", vocab_size=399, seed=3)
    posformer.train(train_args(tmp_path, first), run_dir=tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(CheckpointError) as err:
        posformer.train(
            train_args(tmp_path, other, f"ckpt_path={last}", "trainer.max_steps=6"), run_dir=tmp_path / "run"
        )
    line = str(err.value)
    assert "another tokenizer" in line and f"data.tokenizer={tmp_path / 'run' / 'tokenizer'}" in line, line
    with pytest.raises(CheckpointError, match="another tokenizer"):
        posformer.evaluate(
            last, lengths=[16], output_dir=tmp_path / "ev", overrides=[f"+eval.data.tokenizer={other}"]
        )
