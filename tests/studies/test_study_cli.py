"""``posformer-study`` and the ``scripts/`` wrappers over :mod:`posformer.studies`: a bad argument is
one line and exit status 2, a study that cannot go on one line and status 1; the leaderboard and the
Multi30k table are rebuilt from the committed records alone (``docs/studies/``), into fresh folders,
and match ``docs/leaderboard.md`` and the committed figures byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posformer.cli import study

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "studies"
FIGURES = ROOT / "docs" / "figures"
#: the leaderboard's figures that the committed records determine
FROM_RECORDS = [
    "leaderboard_algorithmic_reverse",
    "leaderboard_algorithmic_sort",
    "leaderboard_lm_nonoverlap",
    "leaderboard_lm_position_loss",
    "leaderboard_lm_sliding",
    "leaderboard_multi30k",
]


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> str:
    """Run ``posformer-study argv``; it must exit with ``status`` after exactly one stderr line."""
    with pytest.raises(SystemExit) as exc:
        study.main(argv)
    assert exc.value.code == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "posformer-study: error: the following arguments are required: STUDY"),
        (["bogus"], "posformer-study: error: argument STUDY: invalid choice: 'bogus'"),
        (["lm", "--size", "huge"], "posformer-study lm: error: argument --size: invalid choice: 'huge'"),
        (["algorithmic", "--seeds", "x"], "posformer-study algorithmic: error: argument --seeds: invalid"),
        (["leaderboard", "--bogus"], "posformer-study: error: unrecognized arguments: --bogus"),
    ],
)
def test_argument_errors_are_one_line_and_status_2(capsys, argv: list[str], message: str) -> None:
    assert one_error_line(capsys, argv, 2).startswith(message)


def test_a_study_that_cannot_go_on_is_one_line_and_status_1(capsys, tmp_path: Path) -> None:
    err = one_error_line(capsys, ["multi30k", "--steps", "300", "--out", str(tmp_path / "out")], 1)
    assert err.startswith("posformer-study: error: --steps 300: must be a multiple of --ckpt-every 250")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    err = one_error_line(
        capsys, ["multi30k", "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--cores", "none"], 1
    )
    assert f"--data {tmp_path}: no train.de[.gz] there" in err  # runs to train: the data is needed


def test_every_study_has_a_subcommand_and_no_script_edits_sys_path() -> None:
    assert set(study.STUDIES) == {"lm", "algorithmic", "multi30k", "rope-extension", "hybrid", "leaderboard"}
    for module in study.STUDIES.values():
        assert callable(module.add_arguments) and callable(module.run_study)
    files = [
        *ROOT.glob("scripts/study_*.py"),
        ROOT / "scripts" / "leaderboard.py",
        *ROOT.glob("posformer/studies/*.py"),
        *ROOT.glob("tests/test_study_*.py"),
    ]
    assert not [f.name for f in files if "sys.path.insert" in f.read_text() and f.name != Path(__file__).name]


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.slow
def test_leaderboard_rebuilds_the_tables_and_figures_from_the_records(tmp_path: Path, capsys) -> None:
    """From a copy of ``docs/studies`` alone (no study outputs): the LM, algorithmic, Multi30k and
    indirect-indexing tables of ``docs/leaderboard.md`` and their committed figures, byte for byte;
    the FIRE-threshold LM ablation (no records) is noted as not run."""
    records = tmp_path / "records"
    shutil.copytree(RECORDS, records)
    figures, tables = tmp_path / "figures", tmp_path / "tables.md"
    args = ["leaderboard", "--studies", str(tmp_path / "studies"), "--figures", str(figures)]
    args += ["--tables", str(tables), "--records", str(records)]
    assert study.main(args) == 0
    text = tables.read_text()
    doc = (ROOT / "docs" / "leaderboard.md").read_text().splitlines()
    rows = table_lines(text)
    lm_pes = {json.loads(p.read_text())["pe"] for p in (RECORDS / "lm_small").glob("*.json")}
    indirect_pes = {json.loads(p.read_text())["pe"] for p in (RECORDS / "indirect_index").glob("*.json")}
    assert len(lm_pes) >= 8 and indirect_pes == {"pope", "rope"}
    # the LM table (header, rule, a row per recorded PE), two algorithmic tables (header, rule, 14 PEs,
    # 2 means), Multi30k, indirect indexing (header, rule, PoPE, RoPE)
    assert len(rows) == 2 + len(lm_pes) + 2 * 18 + 5 + 4
    assert [r for r in rows if r not in doc] == []
    assert text.count("(not run yet: no ") == 1  # the FIRE-threshold ablation of the LM study
    for name in FROM_RECORDS:
        for ext in ("png", "svg"):
            made, committed = figures / f"{name}.{ext}", FIGURES / f"{name}.{ext}"
            assert made.read_bytes() == committed.read_bytes(), f"{made.name} differs from docs/figures"
    assert sorted(p.stem for p in figures.glob("*.svg")) == FROM_RECORDS  # nothing else written


def test_multi30k_table_from_the_records_into_a_fresh_out(tmp_path: Path, capsys) -> None:
    """``--launch-for 0`` with a new ``--out``: nothing trains, no data is needed, the summary is written
    (it was a FileNotFoundError traceback) and its table is the leaderboard's."""
    ledger = tmp_path / "ledger"
    shutil.copytree(RECORDS / "multi30k", ledger)
    out = tmp_path / "fresh" / "multi30k"
    argv = ["multi30k", "--pes", "sinusoidal", "learned", "rope", "--seeds", "0", "1", "2", "--steps", "2500"]
    argv += ["--out", str(out), "--ledger", str(ledger), "--launch-for", "0", "--cores", "none"]
    study.main([*argv, "--data", str(tmp_path / "no_data")])
    summary = (out / "summary.md").read_text()
    assert "Runs: 9 of 9 recorded." in summary
    assert "| rope | 38.51 ± 0.38 | 57.77 ± 0.31 | s0 38.08, s1 38.71, s2 38.75 |" in summary
    assert not (out / "train").exists() or not any((out / "train").iterdir())
    for ext in ("png", "svg"):  # the leaderboard's figure is this study's
        committed = FIGURES / f"leaderboard_multi30k.{ext}"
        assert (out / f"summary_bleu.{ext}").read_bytes() == committed.read_bytes()


@pytest.mark.slow
def test_scripts_and_the_command_report_errors_in_one_line(tmp_path: Path) -> None:
    """The wrappers in ``scripts/`` and the installed ``posformer-study``, as processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = [
        (
            [sys.executable, str(ROOT / "scripts" / "study_algorithmic.py"), "--bogus"],
            2,
            "study_algorithmic.py: error: unrecognized arguments: --bogus",
        ),
        (
            [sys.executable, str(ROOT / "scripts" / "study_multi30k.py"), "--steps", "300"],
            1,
            "study_multi30k.py: error: --steps 300",
        ),
        (
            [str(Path(sys.executable).parent / "posformer-study"), "rope-extension", "--size", "x"],
            2,
            "posformer-study rope-extension: error: argument --size",
        ),
    ]
    for cmd, status, message in cases:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        assert (done.returncode, done.stderr.count("\n")) == (status, 1), done.stderr
        assert done.stderr.startswith(message) and done.stdout == ""
