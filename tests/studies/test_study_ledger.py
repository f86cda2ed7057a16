"""The studies' committed per-run records (:mod:`posformer.studies.ledger`): a recorded run is finished for
the queue, the algorithmic study evaluates and records only finished runs that have no record and
builds its rows from the records alone, a ledger of other settings is refused, and the queue starts no
run after its launch window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posformer.cli import study as study_cli
from posformer.studies import algorithmic as study_algorithmic
from posformer.studies import algorithmic_summary
from posformer.studies import jobs as study_jobs
from posformer.studies import ledger as study_ledger
from posformer.studies.common import StudyError
from posformer.studies.jobs import Job, run_jobs


def test_records_round_trip_and_name_the_finished_runs(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    assert study_ledger.recorded(ledger) == set() and study_ledger.read_records(None) == {}
    for name, seed, seconds in (("3_rope_s1", 1, 2.5), ("4_rope_s2", 2, 1.0)):
        record = {"pe": "rope", "seed": seed, "invocations": [{"seconds": seconds}]}
        study_ledger.write_record(ledger, name, record)
    recs = study_ledger.read_records(ledger)
    assert set(recs) == study_ledger.recorded(ledger) == {"3_rope_s1", "4_rope_s2"}
    assert recs["3_rope_s1"]["run"] == "3_rope_s1" and recs["3_rope_s1"]["format"] == study_ledger.FORMAT
    assert recs["3_rope_s1"]["commit"]  # the code that trained it
    assert study_ledger.train_seconds(recs) == (3.5, 2)
    assert not list(ledger.glob("*.tmp"))
    (ledger / "5_bad_s0.json").write_text("{not json")
    with pytest.raises(StudyError, match="5_bad_s0.json: not valid JSON"):
        study_ledger.read_records(ledger)
    (ledger / "5_bad_s0.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(StudyError, match="record format 99"):
        study_ledger.read_records(ledger)


def test_queue_skips_recorded_runs_and_launches_nothing_after_its_window(tmp_path: Path, capsys) -> None:
    # "a" is recorded: skipped although its run dir is empty; "b" would run, but the window is over
    assert run_jobs([Job("a", []), Job("b", [])], tmp_path, [], recorded={"a"}, launch_until=0.0) == 0.0
    out = capsys.readouterr().out
    assert "1 of 2 runs already finished" in out and "1 run(s) left for the next call" in out
    assert not (tmp_path / "logs").exists()  # nothing was started


def _finished_run(sweep: Path, name: str, pe: str, randomized: bool, seed: int, steps: int) -> Path:
    run = sweep / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    (run / "config.yaml").write_text(f"seed: {seed}\npositions:\n  randomized: {randomized}\n")
    (run / "results.json").write_text(json.dumps({"global_step": steps}))
    (sweep / "logs").mkdir(exist_ok=True)
    (sweep / "logs" / f"{name}.jsonl").write_text(json.dumps({"seconds": 10.0, "returncode": 0}) + "\n")
    return run


def _eval_rows(cmd: list[str]) -> list[dict]:
    """The rows a ``posformer-eval`` ``cmd`` writes here: each of its checkpoints at lengths 16 and 32,
    with ordinary positions and, when asked for, randomized ones (0.5 more exact match)."""
    ckpts = next(c for c in cmd if c.startswith("eval.checkpoints="))
    both = "eval.task_positions=[ordinary,randomized]" in cmd
    modes = ["task", "task_randomized"] if both else ["task"]
    return [
        {
            "checkpoint": c,
            "pe": "rope",
            "mode": m,
            "length": n,
            "in_distribution": n <= 16,
            "status": "ok",
            "exact_match": (1.0 if n <= 16 else 0.25) + (m == "task_randomized") * 0.5,
            "token_acc": 0.5,
            "label": "x",
            "key": "k",
        }
        for c in ckpts.split("=", 1)[1].strip("[]").split(",")
        for n in (16, 32)
        for m in modes
    ]


def test_algorithmic_study_records_finished_runs_once_and_reads_rows_from_records(tmp_path, monkeypatch):
    sweep, ledger = tmp_path / "train", tmp_path / "ledger"
    _finished_run(sweep, "0_rope_s0", "rope", False, 0, 900)
    _finished_run(sweep, "1_rope_randomized_s0", "rope", True, 0, 1200)
    (sweep / "2_rope_s1" / "checkpoints").mkdir(parents=True)  # interrupted: a checkpoint, no results
    (sweep / "2_rope_s1" / "checkpoints" / "last.ckpt").write_bytes(b"")
    calls: list[list[str]] = []

    def fake_eval(cmd: list[str], log: Path) -> float:
        calls.append(cmd)
        out = Path(next(c for c in cmd if c.startswith("eval.output_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        (out / "extrapolation.json").write_text(json.dumps({"results": _eval_rows(cmd)}))
        return 7.0

    monkeypatch.setattr(study_algorithmic, "run", fake_eval)
    common = ["data.task=reverse", "trainer.max_steps=3000"]
    assert study_algorithmic.record_runs(sweep, ledger, [16, 32], common) == 14.0
    # plain runs with ordinary positions; randomized runs also with randomized ones (Ruoss et al.)
    both = "eval.task_positions=[ordinary,randomized]"
    assert [("0_rope_s0" in " ".join(c), both in c) for c in calls] == [(True, False), (False, True)]
    assert "2_rope_s1" not in " ".join(calls[0] + calls[1])  # the interrupted run is left out
    assert study_algorithmic.record_runs(sweep, ledger, [16, 32], common) == 0.0  # all recorded: no eval
    assert len(calls) == 2
    recs = study_ledger.read_records(ledger)
    assert set(recs) == {"0_rope_s0", "1_rope_randomized_s0"}
    rand = recs["1_rope_randomized_s0"]
    assert (rand["randomized"], rand["seed"], rand["steps"], rand["overrides"]) == (True, 0, 1200, common)
    assert rand["invocations"] == [{"seconds": 10.0, "returncode": 0}]
    assert "checkpoint" not in rand["rows"][0] and "label" not in rand["rows"][0]  # nothing machine-bound
    import shutil

    shutil.rmtree(sweep)  # a fresh clone: only the records are left
    rows = algorithmic_summary.rows_of(study_ledger.read_records(ledger))
    ordinary = "rope + randomized" + algorithmic_summary.ORDINARY_EVAL
    assert {(r["series"], r["steps"], r["length"]) for r in rows} == {
        ("rope", 900, 16),
        ("rope", 900, 32),
        ("rope + randomized", 1200, 16),
        ("rope + randomized", 1200, 32),
        (ordinary, 1200, 16),
        (ordinary, 1200, 32),
    }
    ood = algorithmic_summary.series_means(rows, ["rope", "rope + randomized", ordinary], hi=16)["ood"]
    assert ood[("exact_match", "rope")]["mean"] == 0.25 and ood[("exact_match", ordinary)]["mean"] == 0.25
    assert ood[("exact_match", "rope + randomized")]["mean"] == 0.75  # the randomized-positions evaluation
    study_algorithmic.check_setup(recs, common, ledger)  # same settings: accepted
    with pytest.raises(StudyError, match=r"0_rope_s0.json: trained with other settings.*max_steps=500"):
        study_algorithmic.check_setup(recs, ["data.task=reverse", "trainer.max_steps=500"], ledger)


def test_multi30k_study_translates_each_finished_run_once_and_summarises_the_records(tmp_path, monkeypatch):
    from posformer.studies import multi30k as study_multi30k

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.de").write_text("x\n")
    out, ledger = tmp_path / "out", tmp_path / "ledger"
    translated: list[str] = []

    def fake_jobs(jobs, sweep, common, cores=None, recorded=frozenset(), launch_until=None):
        for job in jobs[:2]:  # the launch window ends after two runs
            if job.name not in recorded:
                (sweep / job.name).mkdir(parents=True, exist_ok=True)
                (sweep / job.name / "results.json").write_text(json.dumps({"global_step": 500}))
        return 1.0

    def fake_translate(run_dir: Path, steps: int, average: int) -> dict:
        translated.append(run_dir.name)
        return {"bleu": 30.0 + len(translated), "chrf": 55.0}

    monkeypatch.setattr(study_multi30k, "run_jobs", fake_jobs)
    monkeypatch.setattr(study_multi30k, "translate", fake_translate)
    argv = ["multi30k", "--pes", "sinusoidal", "rope", "--seeds", "0", "1", "--steps", "500"]
    argv += ["--ckpt-every", "100", "--data", str(data), "--out", str(out), "--ledger", str(ledger)]
    argv += ["--cores", "none"]  # any core: the queue is a stand-in
    study_cli.dispatch(argv)
    # seed-major: a study cut short after two runs has every PE at seed 0, not one PE at both seeds
    assert translated == ["0_sinusoidal_s0", "1_rope_s0"]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["summary"]) == ["sinusoidal", "rope"]
    assert [v["n"] for v in summary["summary"].values()] == [1, 1]
    assert "Runs: 2 of 4 recorded." in (out / "summary.md").read_text()
    study_cli.dispatch(argv)  # again: both are recorded, nothing is translated twice
    assert translated == ["0_sinusoidal_s0", "1_rope_s0"]
    with pytest.raises(StudyError, match="trained with other settings"):
        study_cli.dispatch([*argv, "--extra", "model.dropout=0.3"])


def test_invocations_of_a_run_without_a_log_are_empty(tmp_path: Path) -> None:
    assert study_ledger.invocations(tmp_path, "nothing") == []
    (tmp_path / "logs").mkdir()
    study_jobs.record_invocation(tmp_path, "r", 0, 3.0, 0)
    study_jobs.record_invocation(tmp_path, "r", 1, 4.5, 130)  # interrupted, then resumed
    assert [i["seconds"] for i in study_ledger.invocations(tmp_path, "r")] == [3.0, 4.5]
