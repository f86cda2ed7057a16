"""Bad checkpoints, bad evaluation settings and half-precision numerics, through the real mains
(``posformer.cli.train.main`` / ``posformer.cli.evaluate.main``): each case exits non-zero with one
clear line and leaves the files written before unchanged (helpers in ``cli_cases.py``; the other
bad-input cases are in ``test_bad_input.py``). See docs/reliability.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_cases import (
    assert_clean_failure,
    assert_untouched,
    eval_cli,
    train_cli,
)


# ------------------------------------------------------------------------------------------ checkpoints
def _corrupt_copies(trained: Path, tmp_path: Path) -> dict[str, Path]:
    data = (trained / "checkpoints" / "last.ckpt").read_bytes()
    out = {}
    out["truncated"] = tmp_path / "truncated.ckpt"
    out["truncated"].write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    mid = len(flipped) * 3 // 4
    flipped[mid : mid + 64] = bytes(b ^ 0xFF for b in flipped[mid : mid + 64])
    out["corrupted"] = tmp_path / "corrupted.ckpt"
    out["corrupted"].write_bytes(bytes(flipped))
    return out


def test_resume_checkpoint_missing(out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    code, text = train_cli([f"ckpt_path={tmp_path}/gone.ckpt"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "gone.ckpt", "does not exist")
    assert_untouched(out_dir)


@pytest.mark.parametrize("kind", ["truncated", "corrupted"])
def test_damaged_checkpoint_train_and_eval(kind, trained, out_dir, cache_dir, tmp_path, monkeypatch, capsys):
    path = _corrupt_copies(trained, tmp_path)[kind]
    code, text = train_cli([f"ckpt_path={path}"], out_dir, cache_dir, monkeypatch, capsys)  # resume
    assert_clean_failure(code, text, path.name, "use another checkpoint")
    code, text = train_cli(["train=false", f"ckpt_path={path}"], out_dir, cache_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, path.name)
    code, text = eval_cli([f"eval.checkpoints=[{path}]", "eval.lengths=[4]"], out_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, path.name, "use another checkpoint")
    assert_untouched(out_dir)


def test_eval_checkpoint_missing(out_dir, tmp_path, monkeypatch, capsys):
    code, text = eval_cli([f"eval.checkpoints=[{tmp_path}/gone.ckpt]"], out_dir, monkeypatch, capsys)
    assert_clean_failure(code, text, "gone.ckpt", "does not exist")
    assert_untouched(out_dir)


@pytest.mark.parametrize(
    ("override", "needle"),
    [("pe=alibi", "model.pe: checkpoint='rope', config='alibi'"), ("data.symbols=20", "model.vocab_size")],
)
def test_checkpoint_config_mismatch_is_reported(
    override, needle, trained, out_dir, cache_dir, monkeypatch, capsys
):
    """posformer-train reports a different PE or vocabulary (it does not silently use either config)."""
    ckpt = trained / "checkpoints" / "last.ckpt"
    for mode in (["train=false"], []):  # evaluate-only, and resume
        code, text = train_cli(
            [*mode, f"ckpt_path={ckpt}", override], out_dir, cache_dir, monkeypatch, capsys
        )
        assert_clean_failure(code, text, "trained with a different model", needle)
    assert_untouched(out_dir)


def test_eval_uses_checkpoint_config_but_reports_vocab_mismatch(trained, out_dir, monkeypatch, capsys):
    """posformer-eval builds the model from the checkpoint's own config; data overrides that change the
    vocabulary are reported."""
    ckpt = trained / "checkpoints" / "last.ckpt"
    code, text = eval_cli(
        [f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]", "+eval.data.symbols=20"],
        out_dir,
        monkeypatch,
        capsys,
    )
    assert_clean_failure(code, text, "vocabulary")
    assert_untouched(out_dir)


# ------------------------------------------------------------------ inputs and numerics
def _no_eval_outputs(run: Path) -> None:
    assert not (run / "extrapolation.json").exists(), "a failed evaluation wrote results"


EVAL_CASES = {
    # name: (overrides, texts that must appear)
    "lengths_fraction": (["eval.lengths=[2.5,4]"], ["eval.lengths=[2.5, 4]", "[2.5]", "no fractions"]),
    "lengths_word": (["eval.lengths=abc"], ["eval.lengths='abc'", "list of positive integers", "[64, 128"]),
    "lengths_bare_int": (["eval.lengths=8"], ["eval.lengths=8", "one length is written eval.lengths=[8]"]),
    "lengths_zero": (["eval.lengths=[0,4]"], ["contains [0]", ">= 1"]),
    "length_multiples_negative": (["eval.length_multiples=[-1,2]"], ["eval.length_multiples", "[-1]"]),
    "max_batches_zero": (["eval.lengths=[4]", "eval.max_batches=0"], ["eval.max_batches=0", ">= 1", "null"]),
    "max_batches_negative": (["eval.lengths=[4]", "eval.max_batches=-2"], ["eval.max_batches=-2", ">= 1"]),
    "task_positions_word": (
        ["eval.task_positions=[shuffled]"],
        ["eval.task_positions=['shuffled']", "ordinary / randomized"],
    ),
    "positions_seed_negative": (["eval.positions_seed=-1"], ["eval.positions_seed=-1", ">= 0"]),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_bad_eval_value(case, trained, out_dir, monkeypatch, capsys):
    """Evaluation values are checked before a checkpoint is loaded: exit 2, one line, nothing written."""
    overrides, needles = EVAL_CASES[case]
    ckpt = trained / "checkpoints" / "last.ckpt"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", *overrides], out_dir, monkeypatch, capsys)
    assert code == 2
    assert_clean_failure(code, text, "posformer-eval: error: ", *needles)
    _no_eval_outputs(out_dir)
    assert_untouched(out_dir)


def _edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    ckpt = torch.load(src, map_location="cpu", weights_only=True)
    torch.save(edit(ckpt), dst)
    return dst


def _newer_lightning(ckpt: dict) -> dict:
    return {**ckpt, "pytorch-lightning_version": "99.0.0"}


@pytest.mark.parametrize(
    ("kind", "edit", "needles"),
    [
        (
            "raw_state_dict",
            lambda ck: {k.removeprefix("model."): v for k, v in ck["state_dict"].items()},
            ["is a raw state_dict", "not a Lightning checkpoint", "written by posformer-train"],
        ),
        (
            "newer_lightning",
            _newer_lightning,
            [
                "written by Lightning 99.0.0",
                "newer than the installed",
                "restart at step 0",
                "Upgrade Lightning",
            ],
        ),
    ],
)
def test_foreign_checkpoint_train_and_eval(
    kind, edit, needles, trained, out_dir, cache_dir, tmp_path, monkeypatch, capsys
):
    """A raw state_dict file and a checkpoint of a newer Lightning format: refused by resume, by
    ``train=false`` and by posformer-eval, before any work, with nothing written."""
    path = _edited_checkpoint(trained / "checkpoints" / "last.ckpt", tmp_path / f"{kind}.ckpt", edit)
    before = path.read_bytes()
    for mode in ([], ["train=false"]):
        code, text = train_cli([*mode, f"ckpt_path={path}"], out_dir, cache_dir, monkeypatch, capsys)
        assert_clean_failure(code, text, f"{kind}.ckpt", *needles)
        assert "step 1" not in text and not (out_dir / "config.yaml").exists()
    code, text = eval_cli([f"eval.checkpoints=[{path}]", "eval.lengths=[4]"], out_dir, monkeypatch, capsys)
    assert code == 2
    assert_clean_failure(code, text, f"{kind}.ckpt", *needles)
    assert path.read_bytes() == before
    _no_eval_outputs(out_dir)
    assert_untouched(out_dir)


def test_checkpoint_copied_out_of_its_run_dir_evaluates(trained, tmp_path, monkeypatch, capsys):
    """posformer-eval needs only the checkpoint: its data config and seed are saved inside it."""
    alone = tmp_path / "elsewhere" / "model.ckpt"
    alone.parent.mkdir()
    alone.write_bytes((trained / "checkpoints" / "last.ckpt").read_bytes())
    assert not list(alone.parent.parent.glob("**/config.yaml"))
    hp = torch.load(alone, map_location="cpu", weights_only=True)["hyper_parameters"]["data"]
    assert hp["config"]["task"] == "reverse" and hp["seed"] == 0
    out = tmp_path / "eval"
    code, text = eval_cli([f"eval.checkpoints=[{alone}]", "eval.lengths=[4,8]"], out, monkeypatch, capsys)
    assert code == 0, text[-2000:]
    rows = json.loads((out / "extrapolation.json").read_text())["results"]
    assert {r["length"]: (r["status"], r["in_distribution"]) for r in rows} == {
        4: ("ok", True),
        8: ("ok", False),
    }
    # the same numbers as the checkpoint evaluated inside its run dir
    inside = tmp_path / "eval_inside"
    ckpt = trained / "checkpoints" / "last.ckpt"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4,8]"], inside, monkeypatch, capsys)
    assert code == 0, text[-2000:]
    rows_in = json.loads((inside / "extrapolation.json").read_text())["results"]
    assert [r["exact_match"] for r in rows] == [r["exact_match"] for r in rows_in]
    assert [r["n_sequences"] for r in rows] == [r["n_sequences"] for r in rows_in]


def _truncated_results(trained: Path, tmp_path: Path, monkeypatch, capsys) -> bytes:
    good = tmp_path / "good"
    ckpt = trained / "checkpoints" / "last.ckpt"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], good, monkeypatch, capsys)
    assert code == 0, text[-2000:]
    data = (good / "extrapolation.json").read_bytes()
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "kind",  # an evaluation run each (truncated: two): malformed stays fast
    [
        "malformed",
        *(pytest.param(k, marks=pytest.mark.slow) for k in ("truncated", "wrong_layout", "not_utf8")),
    ],
)
def test_unreadable_earlier_results_are_moved_aside(kind, trained, out_dir, tmp_path, monkeypatch, capsys):
    """An earlier extrapolation.json that cannot be read: one line says where it was moved, the sweep
    starts over (exit 0), and the old bytes survive in ``extrapolation.json.corrupt-<time>``."""
    bad = {
        "malformed": b'{"meta": {}, "results": [{"key": ',
        "wrong_layout": b"[1, 2, 3]\n",
        "not_utf8": b'{"meta": {"label": "caf\xe9"}, "results": []}',
    }.get(kind) or _truncated_results(trained, tmp_path, monkeypatch, capsys)
    (out_dir / "extrapolation.json").write_bytes(bad)
    ckpt = trained / "checkpoints" / "last.ckpt"
    code, text = eval_cli([f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4]"], out_dir, monkeypatch, capsys)
    assert code == 0, text[-2000:]
    assert "Traceback" not in text
    warning = [ln for ln in text.splitlines() if "is unreadable" in ln]
    assert len(warning) == 1 and "moved it to extrapolation.json.corrupt-" in warning[0], text[-2000:]
    aside = list(out_dir.glob("extrapolation.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == bad
    rows = json.loads((out_dir / "extrapolation.json").read_text())["results"]
    assert [(r["length"], r["status"]) for r in rows] == [(4, "ok")]
    assert_untouched(out_dir)


def test_fp16_true_trains_finitely_with_safe_eps(out_dir, cache_dir, monkeypatch, capsys):
    """``trainer.precision=16-true`` with the default Adam eps=1e-9 (0 in float16: NaN at step 1 before
    the fix): eps is raised to 1e-4 with one warning line and the loss stays finite."""
    args = [
        "trainer.precision=16-true",
        "trainer.max_steps=12",
        "trainer.val_check_interval=12",
        "evaluate=false",
    ]
    code, text = train_cli(args, out_dir, cache_dir, monkeypatch, capsys)
    assert code == 0, text[-3000:]
    warning = [ln for ln in text.splitlines() if "optim.eps=1e-09 is below the smallest normal float16" in ln]
    assert len(warning) == 1 and "optim.eps=0.0001" in warning[0], text[-2000:]
    results = json.loads((out_dir / "results.json").read_text())
    assert results["global_step"] == 12
    assert torch.isfinite(torch.tensor([results["train"]["train/loss"], results["val"]["val/loss"]])).all()


def test_safe_eps_units():
    from posformer.lit.optim import safe_eps

    half, full = [torch.zeros(2, dtype=torch.float16)], [torch.zeros(2)]
    assert safe_eps(1e-9, full) == (1e-9, "")
    eps, line = safe_eps(1e-9, half)
    assert eps == pytest.approx(1e-4) and "float16" in line and "\n" not in line
    assert safe_eps(1e-3, half) == (1e-3, "")
    assert safe_eps(1e-9, [torch.zeros(2, dtype=torch.bfloat16)]) == (1e-9, "")  # bf16: fp32's range
