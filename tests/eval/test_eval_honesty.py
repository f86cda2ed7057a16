"""Evaluation honesty through the real ``posformer-eval`` main: a length the data cannot fill
is reported as ``too_long`` (never a shorter window labelled with that length), an absurd length is
refused up front with what it would cost, SIGINT/SIGTERM keep the finished rows and say how to continue
(exit 130/143, no traceback), two evaluations into one output dir lose no row, and an output dir with
another evaluation's finished results is refused (resuming the same one is allowed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from posformer.errors import ConfigError
from posformer.eval import harness
from posformer.eval.store import Results
from tests.cli_cases import assert_clean_failure, call, eval_cli
from tests.eval.test_eval_agreement import train_lm


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    return train_lm(tmp_path_factory.mktemp("honest"))


def _rows(out: Path) -> list[dict]:
    return json.loads((out / "extrapolation.json").read_text())["results"]


def test_length_longer_than_the_data_is_reported_not_labelled_done(lm_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    ckpt = lm_run / "checkpoints" / "last.ckpt"
    code, text = eval_cli(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[8,5000]", "trainer=cpu"], out, monkeypatch, capsys
    )
    assert code == 0, text[-3000:]
    rows = {(r["mode"], r["length"]): r for r in _rows(out)}
    for mode in ("nonoverlap", "sliding"):
        assert rows[(mode, 8)]["status"] == "ok"
        long = rows[(mode, 5000)]
        assert long["status"] == "too_long" and long.get("ppl") is None and long.get("scored_tokens") is None
        assert "needs 5001" in long["reason"]
    assert "too long" in text
    assert "too long" in (out / "extrapolation.md").read_text()


def test_absurd_length_refused_up_front_with_its_cost(lm_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    ckpt = lm_run / "checkpoints" / "last.ckpt"
    code, text = eval_cli(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[8,10000000]"], out, monkeypatch, capsys
    )
    assert_clean_failure(code, text, "10000000", "eval.max_length=1048576", "GiB", "FLOPs", "shorter lengths")
    assert code == 2 and not (out / "extrapolation.json").exists()
    errors = [ln for ln in text.splitlines() if "error:" in ln]
    assert len(errors) == 1, text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_keeps_finished_rows_and_says_how_to_continue(lm_run, tmp_path, monkeypatch, capsys, sig):
    out = tmp_path / "eval"
    args = [
        f"eval.checkpoints=[{lm_run / 'checkpoints' / 'last.ckpt'}]",
        "eval.lengths=[8,16]",
        "trainer=cpu",
    ]
    real, calls = harness.score_lm_windows, []

    def interrupt_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)
        return real(*a, **k)

    monkeypatch.setattr(harness, "score_lm_windows", interrupt_second)
    code, text = eval_cli(args, out, monkeypatch, capsys)
    assert code == 128 + sig, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    line = next(ln for ln in text.splitlines() if "interrupted by" in ln)
    assert f"interrupted by {signal.Signals(sig).name}: kept 1 finished row(s)" in line
    assert "continue with: posformer-eval" in line and f"eval.output_dir={out}" in line
    assert [r["status"] for r in _rows(out)] == ["ok"]
    monkeypatch.setattr(harness, "score_lm_windows", real)
    code, text = eval_cli(args, out, monkeypatch, capsys)  # continue: the rest, the finished row skipped
    assert code == 0, text[-3000:]
    rows = _rows(out)
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert json.loads((out / "extrapolation.json").read_text())["meta"]["skipped_pairs"] == 1


@pytest.mark.slow
def test_other_checkpoints_into_a_finished_output_dir_refused(lm_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    last = lm_run / "checkpoints" / "last.ckpt"
    other = next(p for p in (lm_run / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt")
    base = ["eval.lengths=[8]", "eval.modes=[nonoverlap]", "trainer=cpu"]
    code, text = eval_cli([f"eval.checkpoints=[{last}]", *base], out, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    before = (out / "extrapolation.json").read_bytes()
    code, text = eval_cli([f"eval.checkpoints=[{other}]", *base], out, monkeypatch, capsys)
    assert_clean_failure(
        code, text, f"eval.output_dir={out} holds the finished evaluation", "another eval.output_dir"
    )
    assert (out / "extrapolation.json").read_bytes() == before
    # the same checkpoint again (resume, or more lengths) is allowed
    code, text = eval_cli(
        [f"eval.checkpoints=[{last}]", "eval.lengths=[8,16]", "eval.modes=[nonoverlap]", "trainer=cpu"],
        out,
        monkeypatch,
        capsys,
    )
    assert code == 0, text[-3000:]
    assert sorted(r["length"] for r in _rows(out)) == [8, 16]
    meta = json.loads((out / "extrapolation.json").read_text())["meta"]
    assert meta["sources"] == [str(last.resolve())] and meta["finished"] is True
    # a sweep dir is its own source: re-evaluating it after its runs trained on is the same evaluation
    sweep_out = tmp_path / "sweep_eval"
    sweep = [f"eval.sweep_dir={lm_run}", "eval.which=last", *base]
    for _ in range(2):
        code, text = eval_cli(sweep, sweep_out, monkeypatch, capsys)
        assert code == 0, text[-3000:]


def test_interleaved_saves_of_two_evaluations_lose_no_row(tmp_path):
    """Two evaluations' results objects saving into one dir in turns: every row of both is kept."""
    a, b = Results(), Results()

    def row(who: str, n: int) -> dict:
        return {
            "key": f"{who}|{n}",
            "series": who,
            "label": who,
            "task_type": "lm",
            "mode": "nonoverlap",
            "length": n,
            "status": "ok",
            "ppl": 1.0,
            "loss": 0.0,
        }

    for n in (8, 16, 32):
        a.add(row("a", n))
        a.save(tmp_path)
        b.add(row("b", n))
        b.save(tmp_path)
    keys = sorted(r["key"] for r in Results.load(tmp_path).rows)
    assert keys == sorted(f"{w}|{n}" for w in "ab" for n in (8, 16, 32))


@pytest.mark.slow  # two posformer-eval processes at once
def test_two_concurrent_posformer_eval_into_one_dir_keep_every_row(lm_run, tmp_path):
    out = tmp_path / "eval"
    ckpt = lm_run / "checkpoints" / "last.ckpt"
    common = [
        f"eval.checkpoints=[{ckpt}]",
        f"eval.output_dir={out}",
        f"hydra.run.dir={out}",
        "trainer=cpu",
        "eval.progress=false",
        "eval.tensorboard=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "posformer.cli.evaluate", *common, f"eval.lengths={lengths}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for lengths in ("[8,16,32]", "[64,128,256]")
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    rows = _rows(out)
    assert sorted({r["length"] for r in rows}) == [8, 16, 32, 64, 128, 256]
    assert len(rows) == 12  # 6 lengths x 2 modes: none lost


# ------------------------------------------------------------------------------ the typed eval schema
@pytest.mark.parametrize(
    "args, needles",
    [
        (["eval.progress=maybe"], ["eval.progress='maybe' must be true or false"]),
        (["+eval.lenghts=[8]"], ["eval.lenghts is not an eval setting", "did you mean eval.lengths?"]),
        (["eval.lenghts=[8]"], ["did you mean eval.lengths?"]),
        (["eval.which=worst"], ["eval.which='worst' is unknown; valid: best, last"]),
        (["eval.max_length=0"], ["eval.max_length=0 must be an integer >= 1", "null (no limit)"]),
        (["eval.batch_tokens=abc"], ["eval.batch_tokens='abc' must be an integer >= 1"]),
        (["seed=-1"], ["seed=-1 must be a non-negative integer"]),
    ],
)
def test_typed_eval_schema_refuses_in_one_line(args, needles, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    code, text = eval_cli(["eval.checkpoints=[/nonexistent/x.ckpt]", *args], out, monkeypatch, capsys)
    assert_clean_failure(code, text, *needles)
    assert code == 2 and len([ln for ln in text.splitlines() if "error:" in ln]) == 1, text
    assert not (out / "extrapolation.json").exists()


def test_typed_translate_schema(tmp_path, monkeypatch, capsys):
    from posformer.cli.evaluate import main

    argv = ["posformer-eval", "eval=translate", "eval.beam_size=0", f"hydra.run.dir={tmp_path / 'ev'}"]
    code, text = call(main, argv, monkeypatch, capsys)
    assert_clean_failure(code, text, "eval.beam_size=0 must be an integer >= 1")
    code, text = call(main, [*argv[:2], "eval.beam_size=four", argv[-1]], monkeypatch, capsys)
    assert_clean_failure(code, text, "eval.beam_size='four' must be an integer >= 1")


def test_schema_rules_word_each_eval_value(read_extrapolate):
    """One rule per field, read once with the composed config: one line naming the key and its value."""
    for key, value in [("stride", 0), ("max_batches", 0), ("lengths", [2.5, 4]), ("task_positions", ["x"])]:
        with pytest.raises(ConfigError) as from_config:
            read_extrapolate(**{key: value})
        assert str(from_config.value).startswith(f"eval.{key}=")
        assert "\n" not in str(from_config.value)


def test_signal_while_loading_is_one_line(lm_run, tmp_path, monkeypatch, capsys):
    """A signal before the first row (checkpoints and data loading): one line, exit 143, nothing written."""
    from posformer.eval import run as eval_run

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(eval_run, "build_subjects", interrupted)
    out = tmp_path / "eval"
    ckpt = lm_run / "checkpoints" / "last.ckpt"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]"], out, monkeypatch, capsys)
    assert code == 143 and "Traceback" not in text, text[-3000:]
    assert "interrupted by SIGTERM before any result was written; re-run the same command." in text
    assert not (out / "extrapolation.json").exists()
