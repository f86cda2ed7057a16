"""The LM study's ledger (:mod:`posformer.studies.lm`): runs queued seed-major, every finished run
recorded on the core it trained on before the queue goes on (``run_jobs(on_done=...)``), a setup keyed
by the text's content, and the leaderboard's LM table and figures built from records alone (one seed:
the mean without a ``±``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posformer.pe import list_encodings
from posformer.studies import jobs as study_jobs
from posformer.studies import leaderboard, lm
from posformer.studies.aggregate import fmt_cell
from posformer.studies.common import StudyError
from posformer.studies.jobs import Job, run_jobs


def test_jobs_are_seed_major() -> None:
    names = [j.name for j in lm.jobs(["rope", "alibi", "t5"], [0, 1])]
    assert names == ["0_rope_s0", "1_alibi_s0", "2_t5_s0", "3_rope_s1", "4_alibi_s1", "5_t5_s1"]


def test_setup_names_the_text_by_content_not_path(tmp_path: Path) -> None:
    size = lm.SIZES["tiny"]
    a, b, c = tmp_path / "a.txt", tmp_path / "sub" / "b.txt", tmp_path / "c.txt"
    b.parent.mkdir()
    a.write_text("to be or not to be")
    b.write_text("to be or not to be")
    c.write_text("to be or not to bee")
    assert lm.study_setup(size, a, []) == lm.study_setup(size, b, [])
    assert lm.study_setup(size, a, []) != lm.study_setup(size, c, [])
    assert not [o for o in lm.study_setup(size, a, []) if str(tmp_path) in o]
    assert lm.study_setup(size, a, ["pe_options.x=1"]) != lm.study_setup(size, a, [])


def _fake_training(monkeypatch: pytest.MonkeyPatch, fail: set[str]) -> None:
    """``job_command`` -> a process that writes the run's ``results.json`` (or exits 1 for ``fail``)."""

    def command(job: Job, run_dir: Path, common: list[str]) -> list[str]:
        code = (
            "raise SystemExit(1)"
            if job.name in fail
            else (
                f"import pathlib; d = pathlib.Path({str(run_dir)!r}); d.mkdir(parents=True, exist_ok=True); "
                "(d / 'results.json').write_text('{}')"
            )
        )
        return [sys.executable, "-c", code]

    monkeypatch.setattr(study_jobs, "job_command", command)


def test_on_done_is_called_for_each_finished_job_before_its_core_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_training(monkeypatch, fail={"b"})
    seen: list[tuple[str, int | None, bool]] = []

    def on_done(job: Job, core: int | None) -> None:
        seen.append((job.name, core, (tmp_path / job.name / "results.json").is_file()))

    with pytest.raises(StudyError, match="1 run\\(s\\) failed: b"):
        run_jobs([Job("a", []), Job("b", []), Job("c", [])], tmp_path, [], cores=[None], on_done=on_done)
    assert seen == [("a", None, True), ("c", None, True)]  # not for the failed job


def test_a_failed_recording_fails_its_job_and_the_queue_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_training(monkeypatch, fail=set())
    seen = []

    def on_done(job: Job, core: int | None) -> None:
        seen.append(job.name)
        if job.name == "a":
            raise StudyError("evaluation failed")

    with pytest.raises(StudyError, match="1 run\\(s\\) failed: a"):
        run_jobs([Job("a", []), Job("b", [])], tmp_path, [], on_done=on_done)
    assert seen == ["a", "b"]


def _record(pe: str, seed: int, ppl: float, curve: list[float]) -> dict:
    rows = [
        {
            "mode": m,
            "length": n,
            "status": "ok",
            "loss": 1.0,
            "ppl": ppl * n / 8,
            "scored_tokens": 64,
            "n_sequences": 64 // n,
            "in_distribution": n == 8,
        }
        for m in ("nonoverlap", "sliding")
        for n in (8, 16)
    ]
    return {
        "format": 1,
        "pe": pe,
        "seed": seed,
        "train_len": 8,
        "rows": rows,
        "position_loss": curve,
        "invocations": [{"seconds": 10.0}],
    }


def test_leaderboard_lm_table_and_figures_from_records(tmp_path: Path) -> None:
    flat, rising = [1.0] * 16, [1.0] * 8 + [2.0] * 8
    records = {
        "0_rope_s0": _record("rope", 0, 3.0, rising),
        "1_alibi_s0": _record("alibi", 0, 2.0, flat),
        "2_rope_s1": _record("rope", 1, 5.0, rising),
    }
    lines = leaderboard.lm_section(records, tmp_path, "lm")
    assert lines[0].startswith("| PE | 1× (8) | 2× (16) | sliding 2× | Δ far−near | ctx gain |")
    assert lines[0].endswith("| n |")
    assert lines[2] == "| alibi | 2.00 | 4.00 | 4.00 | +0.000 | 0.00 | none | 1 |"  # one seed: no ±
    assert lines[3] == "| rope | 4.00 ± 1.41 | 8.00 ± 2.83 | 8.00 ± 2.83 | +1.000 ± 0.000 | 0.00 | none | 2 |"
    made = sorted(p.name for p in tmp_path.glob("*.png"))
    assert made == [
        "leaderboard_lm_nonoverlap.png",
        "leaderboard_lm_position_loss.png",
        "leaderboard_lm_sliding.png",
    ]


def test_fmt_cell_leaves_out_an_undefined_std() -> None:
    assert fmt_cell({"mean": 4.321, "std": 0.0, "n": 1}) == "4.32"
    assert fmt_cell({"mean": 4.321, "std": 0.05, "n": 3}) == "4.32 ± 0.05"
    assert fmt_cell({"mean": -0.0361, "std": 0.009, "n": 3}, 3, sign=True) == "-0.036 ± 0.009"
    assert fmt_cell({"mean": 0.0, "std": 0.0, "n": 0}) == "n/a"


def test_summary_from_the_records_into_a_fresh_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--launch-for 0``: no data, no training, no evaluation; the summary, CSV and figures from the
    records alone, in an ``--out`` that did not exist (one seed: the mean alone)."""
    import json

    from posformer.cli import study

    ledger = tmp_path / "ledger"
    ledger.mkdir()
    for name, pe, ppl in (("0_nope_s0", "nope", 5.0), ("1_rope_s0", "rope", 4.0)):
        rec = _record(pe, 0, ppl, [1.0] * 16)
        rec["train_len"] = 128
        for r in rec["rows"]:
            r["length"] *= 16  # 128 and 256
        (ledger / f"{name}.json").write_text(json.dumps(rec))
    out = tmp_path / "fresh" / "lm"
    args = ["lm", "--size", "small", "--ledger", str(ledger), "--launch-for", "0", "--out", str(out)]
    args += ["--text", str(tmp_path / "no_text.txt")]
    assert study.main(args) == 0
    summary = (out / "summary.md").read_text()
    n_runs = 3 * len(list_encodings())  # the small size: every registered PE x 3 seeds
    assert f"# LM extrapolation study (small): 2 of {n_runs} runs recorded" in summary
    assert "| rope | 4.00 | 8.00 |  |  |  |" in summary
    assert sorted(p.name for p in out.iterdir()) == [
        "summary.csv",
        "summary.md",
        "summary_nonoverlap.png",
        "summary_nonoverlap.svg",
        "summary_sliding.png",
        "summary_sliding.svg",
    ]
