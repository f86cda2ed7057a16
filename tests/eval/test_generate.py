"""posformer-generate through its real main: sampling from a char LM run, greedy and seeded; beam-search
translation with an encoder-decoder run; bad input as one line and exit status 2, before any loading."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import posformer
from posformer.cli.generate import main
from posformer.eval.decoding import beam_search

QUIET = ["logger=none", "callbacks.pe_heatmap=null", "callbacks.lr_monitor=null", "trainer=cpu"]
TINY = ["model.d_model=16", "model.n_heads=2", "model.d_ff=32", *QUIET]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A char LM (d_model 16, 30 steps) on a generated corpus."""
    root = tmp_path_factory.mktemp("gen_lm")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran"]
    (root / "corpus.txt").write_text(
        "\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(300))
    )
    result = posformer.train(
        [
            "data=text",
            f"data.path={root}/corpus.txt",
            "data.block_size=16",
            "data.eval_lengths=[16]",
            "data.eval_tokens=256",
            "model.n_layers=1",
            "trainer.max_steps=30",
            *TINY,
        ],
        run_dir=root / "run",
        paths={"cache_dir": str(root / "cache")},
    )
    return result.run_dir


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory) -> Path:
    """An encoder-decoder on the synthetic copy task (no tokenizer: sources are symbol ids)."""
    root = tmp_path_factory.mktemp("gen_s2s")
    result = posformer.train(
        [
            "model=encdec_tiny",
            "model.n_encoder_layers=1",
            "model.n_decoder_layers=1",
            "pe=sinusoidal",
            "data.n_train=64",
            "data.n_val=16",
            "data.n_eval_per_length=8",
            "data.batch_size=16",
            "data.train_len=[2,4]",
            "data.eval_lengths=[4]",
            "trainer.max_steps=6",
            *TINY,
        ],
        run_dir=root / "run",
        paths={"cache_dir": str(root / "cache")},
    )
    return result.run_dir


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_samples_are_seeded_and_greedy_is_deterministic(lm_run, capsys):
    args = [f"run={lm_run}", "prompt=the cat", "max_new_tokens=20", "temperature=0.9", "top_k=5"]
    code, first, err = _run([*args, "seed=3", "samples=2"], capsys)
    assert code == 0, err
    samples = first.rstrip("\n").split("\n---\n")
    assert len(samples) == 2 and all(s.startswith("the cat") and len(s) == 27 for s in samples)
    assert samples[0] != samples[1]  # seeds 3 and 4
    assert _run([*args, "seed=3"], capsys)[1].rstrip("\n") == samples[0]
    ckpt = next((lm_run / "checkpoints").glob("last*.ckpt"))
    greedy = [f"ckpt={ckpt}", "prompt=the cat", "max_new_tokens=12", "temperature=0"]
    a, b = _run([*greedy, "seed=0"], capsys)[1], _run([*greedy, "seed=9"], capsys)[1]
    assert a == b and a.startswith("the cat")
    # the same continuation as the library call
    run = posformer.load_run(lm_run)
    assert a.rstrip("\n") == "the cat" + run.generate("the cat", 12, temperature=0)


def test_translation_is_beam_search(seq2seq_run, capsys):
    code, out, err = _run([f"run={seq2seq_run}", "source=[5,6,7]", "beam_size=3"], capsys)
    assert code == 0, err
    run = posformer.load_run(seq2seq_run)
    src = torch.tensor([[5, 6, 7, 2]])
    [tokens] = beam_search(run.model, src, torch.ones_like(src, dtype=torch.bool), beam_size=3, alpha=0.6)
    assert out.strip() == run.decode(tokens)
    code, _, err = _run([f"run={seq2seq_run}", "prompt=[5,6]"], capsys)
    assert code == 2 and "source=<text> to translate" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run=x", "prompt=a", "temprature=0.5"],
            "temprature is not a posformer-generate key; did you mean temperature?",
        ),
        (["prompt=a"], "give one of run=<run dir> or ckpt=<file.ckpt>"),
        (["run=x"], "give one of prompt=<text>"),
        (["run=x", "prompt=a", "temperature=-1"], "temperature=-1 must be a finite number >= 0"),
        (["run=x", "prompt=a", "top_k=0"], "top_k=0 must be an integer >= 1"),
        (["run=x", "prompt=a", "max_new_tokens=2.5"], "max_new_tokens=2.5 must be an integer >= 1"),
        (["run=x", "prompt=[1,-2]"], "a list holds token ids >= 0"),
        (["run=x", "prompt=a", "which=first"], "which='first' is unknown; valid: last, best"),
        (["run", "prompt=a"], "'run' is not key=value"),
    ],
)
def test_bad_input_is_one_line(argv, expected, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("posformer-generate: error: ") and expected in err


def test_missing_run_and_device(tmp_path, lm_run, capsys):
    code, _, err = _run([f"run={tmp_path / 'nope'}", "prompt=a"], capsys)
    assert code == 2 and "no such run dir or checkpoint" in err
    if not torch.cuda.is_available():
        code, _, err = _run([f"run={lm_run}", "prompt=a", "device=cuda"], capsys)
        assert code == 2 and err.count("\n") == 1


def test_help_lists_every_key(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(
        f"  {k} " in out for k in ("run", "ckpt", "prompt", "source", "temperature", "top_k", "beam_size")
    )


def test_unknown_characters_and_a_length_past_training_are_noted_once(lm_run, capsys):
    """Characters outside the char vocabulary and prompt + max_new_tokens past the training length
    (block_size 16): one warning line each on stderr, once for all samples; the samples still print."""
    base = [f"run={lm_run}", "temperature=0", "samples=2"]
    code, out, err = _run([*base, "prompt=the cat!Q", "max_new_tokens=3"], capsys)  # 9 + 3 <= 16
    assert code == 0 and out.startswith("the cat!Q"), err
    assert err == (
        "posformer-generate: warning: prompt characters '!', 'Q' are not in the run's vocabulary (its "
        "training text); each maps to <unk>.\n"
    )
    code, out, err = _run([*base, "prompt=the cat", "max_new_tokens=10"], capsys)  # 7 + 10 > 16
    assert code == 0 and out.startswith("the cat"), err
    assert err == (
        "posformer-generate: warning: a prompt of 7 tokens and max_new_tokens=10 make 17 tokens, past the "
        "run's training length 16: the tokens beyond it are extrapolation (pe=rope).\n"
    )
    assert _run([*base, "prompt=the cat", "max_new_tokens=9"], capsys)[2] == ""  # 16: no note
