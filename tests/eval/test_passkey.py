"""Passkey retrieval for language models (posformer.eval.passkey, ``posformer-needle --mode passkey``):
prompts built from the run's own tokenizer, greedy digits scored, refusals in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from posformer.data.tokenizers import ByteTokenizer, CharTokenizer
from posformer.errors import ConfigError
from posformer.eval.passkey import (
    FIELDS,
    FILLER,
    NEEDLE,
    QUESTION,
    Haystack,
    check_tokenizer,
    passkey_grid,
    retrieved,
    write_passkey,
)

TEXT = FILLER + NEEDLE.format(key="0123456789") + " " + QUESTION


def _char() -> CharTokenizer:
    return CharTokenizer.train(TEXT)


class CopyOracle(torch.nn.Module):
    """A stand-in LM that continues its last ``n`` tokens with what followed their latest earlier
    occurrence (an induction head); it sees only the last ``window`` tokens when given one."""

    def __init__(self, vocab: int, n: int = 8, window: int | None = None):
        super().__init__()
        self.vocab, self.n, self.window = vocab, n, window
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, positions=None, attention_mask=None):  # (B, T) -> (B, T, V)
        b, t = input_ids.shape
        logits = torch.zeros(b, t, self.vocab) + self.anchor
        for i in range(b):
            ids = input_ids[i].tolist()
            seen = ids[-self.window :] if self.window else ids
            tail = seen[-self.n :]
            for s in range(len(seen) - self.n - 1, -1, -1):
                if seen[s : s + self.n] == tail:
                    logits[i, -1, seen[s + self.n]] = 1.0
                    break
        return logits


@pytest.mark.parametrize("tok", [_char(), ByteTokenizer()], ids=["char", "byte"])
def test_prompts_hold_the_needle_at_its_depth_and_end_with_the_question(tok):
    hay = Haystack(tok, 400)
    for depth in (0.0, 0.3, 1.0):
        ids = hay.prompt(300, depth, "48213")
        text = tok.decode(ids)
        assert abs(len(ids) - 300) <= 12 and text.endswith(" " + QUESTION) and "  " not in text
        needle = NEEDLE.format(key="48213")
        at = text.index(needle)
        assert text.count("48213") == 2
        filler = len(text) - len(needle) - len(QUESTION) - 2
        assert abs(at / filler - depth) < 0.05  # at the depth, at a word start
        assert at == 0 or text[at - 1] == " "


def test_retrieval_is_the_first_number_written():
    tok = _char()
    enc = lambda s: tok.encode(s).tolist()  # noqa: E731
    assert retrieved(tok, enc(" 48213."), "48213") and not retrieved(tok, enc(" 4821."), "48213")
    assert not retrieved(tok, enc(" the key"), "48213") and not retrieved(tok, enc(" 482139"), "48213")


def test_an_induction_oracle_retrieves_everywhere_and_a_windowed_one_only_near_the_question(tmp_path):
    tok = _char()
    full = passkey_grid(
        CopyOracle(tok.vocab_size), tok, [120, 240], bins=4, n_per_cell=3, seed=0, train_len=120
    )
    assert [c["accuracy"] for c in full] == [1.0] * 8 and [c["in_distribution"] for c in full[::4]] == [
        True,
        False,
    ]
    near = passkey_grid(CopyOracle(tok.vocab_size, window=125), tok, [240], bins=4, n_per_cell=6)
    assert [c["accuracy"] for c in near] == [0.0, 0.0, 0.0, 1.0]  # only the last quarter is within reach
    fixed = passkey_grid(CopyOracle(tok.vocab_size, window=125), tok, [240], [0.0, 1.0], n_per_cell=2)
    assert [(c["depth"], c["accuracy"]) for c in fixed] == [(0.0, 0.0), (1.0, 1.0)]
    paths = write_passkey(full, tmp_path, {"label": "oracle", "key_len": 5})
    assert json.loads(paths["json"].read_text())["cells"] == full
    assert paths["csv"].read_text().splitlines()[0] == ",".join(FIELDS)
    assert "| length | depth 0.125 |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_a_random_tiny_lm_runs_and_scores_in_range(tiny_model):
    tok = _char()
    model = tiny_model("rope", vocab_size=tok.vocab_size)
    cells = passkey_grid(model, tok, [64], bins=2, n_per_cell=2, key_len=3)
    assert len(cells) == 2 and all(0.0 <= c["accuracy"] <= 1.0 and c["n_sequences"] == 2 for c in cells)


def test_a_tokenizer_without_digits_is_refused_in_one_line():
    tok = CharTokenizer.train(FILLER + QUESTION)  # letters, no digits
    with pytest.raises(ConfigError, match=r"cannot encode the digits .*byte/bpe") as err:
        check_tokenizer(tok, tok.vocab_size, 5)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"cannot encode the filler"):
        check_tokenizer(CharTokenizer.train("0123456789"), 100, 5)
    with pytest.raises(ConfigError, match=r"vocab_size=10"):
        check_tokenizer(_char(), 10, 5)


def test_a_task_checkpoint_is_refused_by_the_passkey_mode(tiny_checkpoint, tmp_path, capsys):
    from posformer.cli.needle import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main([str(tiny_checkpoint), "--mode", "passkey", "--lengths", "64", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert (
        info.value.code == 1
        and "\n" not in err
        and "--mode passkey needs a decoder-only language model" in err
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_trained_char_lm_gets_its_passkey_grid_end_to_end(tmp_path, monkeypatch, capsys):
    """A tiny char LM trained on filler with passkeys (posformer.train), scored by the command."""
    import posformer
    from posformer.cli.needle import main as cli_main

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(300):
        key = str(rng.integers(10000, 99999))
        lines.append(FILLER * 2 + NEEDLE.format(key=key) + " " + FILLER + QUESTION + " " + key + ".")
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    tiny = [
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_layers=2",
        "model.d_ff=64",
        "logger=none",
        "callbacks.pe_heatmap=null",
        "callbacks.lr_monitor=null",
    ]
    result = posformer.train(
        [
            "data=text",
            "data.path=corpus.txt",
            "data.tokenizer=char",
            "data.block_size=128",
            "data.eval_lengths=[128]",
            "data.eval_tokens=512",
            *tiny,
        ],
        pe="rope",
        trainer={"accelerator": "cpu", "precision": "32-true", "max_steps": 30},
    )
    ckpt = result.run_dir / "checkpoints" / "last.ckpt"
    cli_main(
        [
            str(ckpt),
            "--mode",
            "passkey",
            "--lengths",
            "128",
            "256",
            "--bins",
            "2",
            "--n",
            "2",
            "--out",
            str(tmp_path / "pk"),
        ]
    )
    saved = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    assert [(c["length"], c["in_distribution"]) for c in saved["cells"]] == [(128, True)] * 2 + [
        (256, False)
    ] * 2
    assert saved["meta"]["tokenizer"] == "char" and (tmp_path / "pk" / "passkey.png").is_file()
