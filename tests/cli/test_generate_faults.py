"""``posformer-generate`` under bad input, damaged run dirs and interrupts, through its real main:
one ``posformer-generate: error:`` line and exit status 2 before any sampling step (checks shared with
the Python API in :mod:`posformer.runs`), every given key used or refused, and a signal keeps the
samples printed so far and names the command that generates the rest."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

import posformer.runs
from posformer.cli.generate import main


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory) -> Path:
    """A 1+1-layer encoder-decoder on the copy task, 2 steps (symbol ids, no tokenizer)."""
    import posformer

    root = tmp_path_factory.mktemp("faults_s2s")
    return posformer.train(
        [
            "model=encdec_tiny",
            "model.n_encoder_layers=1",
            "model.n_decoder_layers=1",
            "model.d_model=16",
            "model.n_heads=2",
            "model.d_ff=32",
            "pe=sinusoidal",
            "data.n_train=32",
            "data.n_val=8",
            "data.n_eval_per_length=4",
            "data.batch_size=16",
            "data.train_len=[2,4]",
            "data.eval_lengths=[4]",
            "trainer.max_steps=2",
            "logger=none",
            "callbacks.pe_heatmap=null",
            "callbacks.lr_monitor=null",
            "trainer=cpu",
        ],
        run_dir=root / "run",
        paths={"cache_dir": str(root / "cache")},
    ).run_dir


#: (case, arguments after run=<tiny decoder run>, words the one line must hold)
BAD_INPUT = [
    ("tiny_temperature", ["prompt=[5,6]", "temperature=1e-45"], "temperature=1e-45 is below 0.0001"),
    ("infinite_temperature", ["prompt=[5,6]", "temperature=1e999"], "temperature=inf must be a finite"),
    ("nan_temperature", ["prompt=[5,6]", "temperature=nan"], "must be a finite number"),
    ("huge_temperature", ["prompt=[5,6]", "temperature=1e30"], "is above 10000"),
    ("huge_seed", ["prompt=[5,6]", "seed=99999999999999999999999"], "below 2**63"),
    ("seed_plus_samples", ["prompt=[5,6]", "seed=9223372036854775807", "samples=2"], "seeds up to"),
    ("prompt_id_outside_vocab", ["prompt=[5,6,100000]"], "ids [100000] outside the model's vocabulary"),
    ("invalid_utf8", ["prompt=ab\udcff"], "prompt is not valid UTF-8: byte 0xff at character 2"),
    ("beam_size_on_decoder", ["prompt=[5,6]", "beam_size=8"], "drop beam_size"),
    ("alpha_on_decoder", ["prompt=[5,6]", "alpha=1.0"], "drop alpha"),
    ("which_with_ckpt", ["prompt=[5,6]", "which=best", "CKPT"], "with ckpt= drop it"),
    ("absurd_length", ["prompt=[5,6]", "max_new_tokens=1000000000"], "above max_length=65536"),
    ("bad_max_length", ["prompt=[5,6]", "max_length=0"], "max_length=0 must be an integer >= 1"),
]


@pytest.mark.parametrize(("args", "words"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_before_any_step(args, words, tiny_run_dir, monkeypatch, capsys):
    def no_step(*a, **k):
        raise AssertionError("a sampling step ran")

    monkeypatch.setattr(posformer.runs, "generate", no_step)
    target = [f"ckpt={tiny_run_dir}/checkpoints/last.ckpt"] if "CKPT" in args else [f"run={tiny_run_dir}"]
    code, out, err = _run([*target, *[a for a in args if a != "CKPT"]], capsys)
    assert code == 2 and out == ""
    assert err.startswith("posformer-generate: error: ") and err.count("\n") == 1, err
    assert words in err


def test_absurd_length_names_the_cost_and_the_fix(tiny_run_dir, capsys):
    code, _, err = _run([f"run={tiny_run_dir}", "prompt=[5,6]", "max_new_tokens=1000000000"], capsys)
    assert code == 2 and "FLOPs" in err and "max_length=1000000002 if you mean it" in err
    code, out, _ = _run([f"run={tiny_run_dir}", "prompt=[5,6]", "max_new_tokens=3", "max_length=5"], capsys)
    assert code == 0 and out.startswith("5 6 |")


def test_sampling_settings_on_a_translation_run_are_refused(seq2seq_run, capsys):
    for extra, key in (("temperature=0.5", "temperature"), ("top_k=3", "top_k"), ("samples=2", "samples")):
        code, out, err = _run([f"run={seq2seq_run}", "source=[5,6,7]", extra], capsys)
        assert code == 2 and out == "" and f"drop {key}" in err and err.count("\n") == 1
    code, _, err = _run([f"run={seq2seq_run}", "source=[5,6,100000]"], capsys)
    assert code == 2 and "outside the model's vocabulary" in err
    code, out, err = _run([f"run={seq2seq_run}", "source=[5,6,7]", "beam_size=2"], capsys)
    assert code == 0 and out.endswith("\n") and err == ""  # a 2-step model may translate to nothing


def test_truncated_results_json_is_one_warning_and_generation_goes_on(tiny_run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    data = (run / "results.json").read_bytes()
    (run / "results.json").write_bytes(data[: len(data) // 2])
    code, out, err = _run([f"run={run}", "prompt=[5,6]", "max_new_tokens=2", "temperature=0"], capsys)
    assert code == 0 and out.startswith("5 6 |")
    assert err.startswith("posformer-generate: warning: ") and err.count("\n") == 1
    assert "results.json is unreadable" in err
    assert (run / "results.json").read_bytes() == data[: len(data) // 2]  # left as it was


def test_a_copied_run_dir_loads_its_own_checkpoint_not_the_originals(tiny_run_dir, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(tiny_run_dir, run)
    recorded = json.loads((run / "results.json").read_text())["checkpoint"]["last"]
    assert Path(recorded).is_relative_to(tiny_run_dir)  # the absolute path of the original
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    code, out, err = _run([f"run={run}", "prompt=[5,6]", "max_new_tokens=2"], capsys)
    assert code == 2 and out == "" and str(ckpt) in err and "not a complete PyTorch zip archive" in err


def test_interrupt_keeps_the_samples_so_far_and_names_the_rest(tiny_run_dir, monkeypatch, capsys):
    real = posformer.runs.generate
    calls = []

    def interrupted_in_sample_two(*args, on_token=None, **kwargs):
        calls.append(1)

        def token(nxt):
            on_token(nxt)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)

        return real(*args, on_token=token, **kwargs)

    monkeypatch.setattr(posformer.runs, "generate", interrupted_in_sample_two)
    argv = [f"run={tiny_run_dir}", "prompt=[5,6]", "max_new_tokens=2", "samples=3", "seed=4"]  # 4: trained
    code, out, err = _run(argv, capsys)
    assert code == 130
    blocks = out.split("---\n")
    assert len(blocks) == 2 and blocks[0].startswith("5 6 |") and blocks[1].endswith("[interrupted]\n")
    assert (
        err.count("\n") == 1 and "interrupted by SIGINT during sample 2 of 3 after 1 of 2 new tokens" in err
    )
    assert err.rstrip().endswith("samples=2 seed=5")
    # the rest, generated with that command, are the samples an uninterrupted run prints
    monkeypatch.setattr(posformer.runs, "generate", real)
    _, whole, _ = _run(argv, capsys)
    _, rest, _ = _run([*argv[:3], "samples=2", "seed=5"], capsys)
    assert whole == blocks[0] + "---\n" + rest
