"""The Python API under bad input and signals: a :class:`posformer.PosformerError` subclass with the
command line's one line (never a builtin ``TypeError``/``ValueError``/``FileExistsError``), raised before
any work; a refused ``train()``/``evaluate()`` leaves no new run or output dir; SIGTERM inside
``train()`` raises :class:`posformer.RunInterrupted` naming the checkpoint and the call that resumes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import posformer
from tests.cli_cases import TINY_RUN


@pytest.fixture(scope="module")
def lm(tiny_run_dir):
    return posformer.load_run(tiny_run_dir)


def _one_line(err: pytest.ExceptionInfo, words: str) -> None:
    assert isinstance(err.value, posformer.PosformerError), type(err.value)
    assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


#: (case, call(run dir, tmp_path, loaded run), words the one line must hold)
BAD_CALLS = [
    (
        "train_overrides_not_a_list",
        lambda r, t, lm: posformer.train(123, run_dir=t / "x"),
        "list of key=value",
    ),
    ("train_run_dir_not_a_path", lambda r, t, lm: posformer.train(run_dir=123), "run_dir=123 is a int"),
    ("train_run_dir_is_a_file", lambda r, t, lm: posformer.train(run_dir=t / "afile"), "is a file"),
    ("evaluate_target_not_a_path", lambda r, t, lm: posformer.evaluate(123), "evaluate(123): target"),
    ("evaluate_lengths_not_a_list", lambda r, t, lm: posformer.evaluate(r, lengths=5), "lengths=5 must"),
    (
        "evaluate_output_dir_is_a_file",
        lambda r, t, lm: posformer.evaluate(r, lengths=[4], output_dir=t / "afile"),
        "is a file, not a directory",
    ),
    (
        "evaluate_overrides_one_string",
        lambda r, t, lm: posformer.evaluate(r, overrides="trainer=cpu"),
        "one string",
    ),
    ("load_run_not_a_path", lambda r, t, lm: posformer.load_run(123), "target is a int"),
    (
        "generate_max_new_tokens_word",
        lambda r, t, lm: lm.generate([5], max_new_tokens="ten"),
        "max_new_tokens='ten'",
    ),
    ("generate_prompt_none", lambda r, t, lm: lm.generate(None), "prompt=None is a NoneType"),
    ("generate_top_k_string", lambda r, t, lm: lm.generate([5], top_k="3"), "top_k='3' must be an integer"),
    ("generate_temperature_word", lambda r, t, lm: lm.generate([5], temperature="hot"), "temperature='hot'"),
    ("generate_fractional_id", lambda r, t, lm: lm.generate([5.5, 6]), "holds [5.5]"),
    ("generate_huge_seed", lambda r, t, lm: lm.generate([5], seed=2**70), "below 2**63"),
    ("generate_absurd_length", lambda r, t, lm: lm.generate([5], max_new_tokens=10**9), "max_length=65536"),
]


@pytest.mark.parametrize("call", [c[1] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_is_a_posformer_error_with_one_line(call, tiny_run_dir, lm, tmp_path):
    words = dict((c[1], c[2]) for c in BAD_CALLS)[call]
    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(Exception) as err:
        call(tiny_run_dir, tmp_path, lm)
    _one_line(err, words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing new written
    assert (tmp_path / "afile").read_text() == "keep me"


def test_a_refused_train_leaves_no_run_dir(tmp_path):
    with pytest.raises(posformer.DataError) as err:
        posformer.train(
            ["data=text", f"data.path={tmp_path}/missing.txt"],
            run_dir=tmp_path / "run",
            paths={"cache_dir": str(tmp_path / "cache")},
        )
    _one_line(err, "file not found")
    assert not (tmp_path / "run").exists()


def test_a_refused_evaluate_leaves_no_output_dir(tiny_run_dir, tmp_path):
    with pytest.raises(posformer.ConfigError) as err:
        posformer.evaluate(tiny_run_dir, lengths=[4, 99_999_999], output_dir=tmp_path / "ev")
    _one_line(err, "above eval.max_length")
    assert not (tmp_path / "ev").exists()


def test_an_existing_output_dir_is_kept_when_evaluate_is_refused(tiny_run_dir, tmp_path):
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "notes.txt").write_text("mine")
    with pytest.raises(posformer.ConfigError):
        posformer.evaluate(tiny_run_dir, lengths=[4, 99_999_999], output_dir=tmp_path / "ev")
    assert (tmp_path / "ev" / "notes.txt").read_text() == "mine"


def test_a_truncated_results_json_is_a_warning_not_a_traceback(tiny_run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    data = (run / "results.json").read_bytes()
    (run / "results.json").write_bytes(data[:100])
    with pytest.warns(posformer.PosformerWarning, match="results.json is unreadable"):
        loaded = posformer.load_run(run)
    assert loaded.metrics == {} and loaded.checkpoint == run / "checkpoints" / "last.ckpt"


def test_sigterm_in_train_names_the_checkpoint_and_the_resuming_call(tmp_path, monkeypatch):
    monkeypatch.setenv("POSFORMER_CACHE", str(tmp_path / "cache"))
    sig = ["+callbacks.sig._target_=tests.lit.test_lifecycle.SendSignal", "+callbacks.sig.at=2"]
    overrides = [*TINY_RUN, "trainer=cpu", f"paths.cache_dir={tmp_path / 'cache'}", *sig]
    with pytest.raises(posformer.RunInterrupted) as err:
        posformer.train(overrides, run_dir=tmp_path / "run")
    text = str(err.value)
    assert err.value.signum == 15 and "\n" not in text
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert "interrupted by SIGTERM at step 3 of 4" in text and str(ckpt) in text
    assert "from Python: posformer.train(" in text and f"ckpt_path={str(ckpt)!r}" in text
    # the named call resumes and finishes the run
    done = posformer.train(
        [o for o in overrides if o not in sig], run_dir=tmp_path / "run", ckpt_path=str(ckpt)
    )
    assert done.global_step == 4 and Path(done.run_dir) == tmp_path / "run"
