"""The studies' own logic (:mod:`posformer.studies`) on made-up rows: the loss-per-position pooling
of the leaderboard (every window that reaches a position, weighted by its windows), the context-use
numbers, the OOD means and randomization gain of the algorithmic study, and which PEs skip randomized
runs (from their declared capabilities, not their names)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posformer.pe import ENCODINGS
from posformer.studies import algorithmic_summary as study_algorithmic
from posformer.studies import context_use, leaderboard


def _row(ckpt: str, length: int, curve: list[float], n: int, pe: str = "rope") -> dict:
    return {
        "pe": pe,
        "checkpoint": ckpt,
        "mode": "nonoverlap",
        "length": length,
        "train_len": 2,
        "position_loss": curve,
        "n_sequences": n,
    }


def test_position_curves_use_each_runs_longest_windows_weighted() -> None:
    """Shorter windows tile other text than the longest ones, so they are left out: every position of
    a run's curve is measured on the same windows."""
    rows = [
        _row("a", 2, [4.0, 2.0], n=3),  # 3 windows of 2: shorter than run a's longest, left out
        _row("a", 4, [0.0, 6.0, 1.0, 3.0], n=1),  # 1 window of 4 (main evaluation)
        _row("a", 4, [2.0, 2.0, 3.0, 1.0], n=3),  # 3 more windows of 4 (the position evaluation)
        _row("b", 4, [1.0, 1.0, 1.0, 1.0], n=2),
        {**_row("a", 4, [9.0] * 4, n=5), "mode": "sliding"},  # not a per-window curve: ignored
    ]
    curves = context_use.window_curves(rows, "rope")
    assert curves[0] == pytest.approx(
        [(0.0 + 3 * 2.0) / 4, (6.0 + 3 * 2.0) / 4, (1.0 + 9.0) / 4, (3.0 + 3.0) / 4]
    )
    assert curves[1] == [1.0, 1.0, 1.0, 1.0]
    use = context_use.lm_context_use(rows, ["rope"], L=2)["rope"]
    # near = positions [1, 2) = index 1; far = last half of the window; start = [0, 8) - near
    a = curves[0]
    a_near, a_far = a[1], (a[2] + a[3]) / 2
    assert use["near"][0] == pytest.approx((a_near + 1.0) / 2)
    assert use["delta"][0] == pytest.approx(((a_far - a_near) + 0.0) / 2)
    assert use["start"][0] == pytest.approx((sum(a) / 4 - a_near + 0.0) / 2)


def test_break_position_finds_the_first_stretch_above_the_margin() -> None:
    L = 8
    flat = [1.0] * 64
    assert context_use.break_position(flat, L, span=8) is None
    rising = [1.0] * 32 + [1.5] * 32  # 0.5 nats worse from position 32 on
    # stretches of 8 from p: p = 25 has 1 position past 32 (mean 1.0625), p = 26 has 2 (1.125 > 1.1)
    assert context_use.break_position(rising, L, margin=0.1, span=8) == 26
    assert context_use.fmt_breaks([None, None], 64) == "none"
    assert context_use.fmt_breaks([27, None], 64) == "27/>64"


def test_lm_table_ranks_by_the_longest_length_with_na_last() -> None:
    """The sort key of the LM table: NaN (a PE that cannot represent the length) must not scramble
    the order of the others, as it does as a plain sort key."""
    nan = float("nan")
    agg = {(pe, "nonoverlap", 64): {"mean": m} for pe, m in (("rope", 9.0), ("learned", nan), ("alibi", 4.0))}
    agg[("nope", "nonoverlap", 64)] = {"mean": 5.0}
    order = context_use.rank_by(agg, ["rope", "learned", "nope", "alibi", "xpos"], ("nonoverlap", 64))
    assert order == ["alibi", "nope", "rope", "learned", "xpos"]


def test_ood_means_and_gain() -> None:
    rows = []
    for series, ckpt, acc in (("rope", "p0", 0.2), ("rope", "p1", 0.4), ("rope + randomized", "r0", 0.7)):
        for length, extra in ((8, 0.5), (32, 0.0), (64, 0.2)):
            rows.append(
                {
                    "series": series,
                    "run": ckpt,
                    "length": length,
                    "status": "ok",
                    "token_acc": acc + extra if length > 16 else 1.0,
                    "exact_match": 0.0,
                }
            )
    ood = study_algorithmic.series_means(rows, ["rope", "rope + randomized"], hi=16)["ood"]
    assert ood[("token_acc", "rope")]["mean"] == pytest.approx(0.4)  # runs 0.3 and 0.5
    assert ood[("token_acc", "rope + randomized")]["mean"] == pytest.approx(0.8)
    lines = study_algorithmic.gain_table(
        ood,
        ["rope"],
        {"rope": 1.0, "rope + randomized": 1.0},
        0.9,
        {"rope": 1, "rope + randomized": 2},
    )
    assert any("+40.0" in line for line in lines)


def test_randomized_runs_follow_the_declared_capabilities() -> None:
    """The built-ins that ignore the positions tensor: NoPE (no hooks), CoPE and forgetting ALiBi
    (positions from the content); every other PE gets randomized runs."""
    ignore = {name for name in ENCODINGS if not study_algorithmic.reads_positions(name)}
    assert ignore & {"nope", "rope", "alibi", "cope", "forget_alibi", "learned"} == {
        "nope",
        "cope",
        "forget_alibi",
    }


@pytest.mark.slow
def test_bench_ab_runs_each_revision_from_its_own_tree(tmp_path) -> None:
    """scripts/bench_ab.py: a worker per revision, each importing posformer from its own worktree (the
    'before' worker of HEAD from a temporary checkout, not from this tree), the worktree removed after."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[2]
    before = subprocess.run(["git", "worktree", "list"], cwd=root, capture_output=True, text=True).stdout
    args = ["--before", "HEAD", "--pes", "nope", "--reps", "2", "--warmup", "0", "--d-model", "32"]
    args += ["--n-layers", "1", "--n-heads", "2", "--seq-len", "16", "--batch", "2", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_ab.py"), *args],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "ab.json").read_text())
    assert len(record["pes"]["nope"]["ratios"]) == 2 and record["pes"]["nope"]["ratio"] > 0
    assert record["revisions"]["after"].startswith("working tree")
    assert "| nope |" in (tmp_path / "ab.md").read_text()
    after = subprocess.run(["git", "worktree", "list"], cwd=root, capture_output=True, text=True).stdout
    assert after == before  # the temporary checkout is gone


def test_eval_sweep_skips_an_evaluation_that_is_up_to_date(tmp_path, monkeypatch) -> None:
    """A re-run study does not redo its evaluation; new or re-trained runs, other arguments or changed
    package code make it run again."""
    from posformer.studies import commands as lm

    sweep, out = tmp_path / "train", tmp_path / "eval"
    (sweep / "0_rope_s0").mkdir(parents=True)
    (sweep / "0_rope_s0" / "results.json").write_text("{}")
    calls = []

    def fake_run(args, log, core=None):
        calls.append(args)
        out.mkdir(exist_ok=True)
        (out / "extrapolation.json").write_text("{}")
        return 12.5

    monkeypatch.setattr(lm, "run", fake_run)
    assert lm.eval_sweep(sweep, out, ["eval.lengths=[8]"]) == 12.5
    assert lm.eval_sweep(sweep, out, ["eval.lengths=[8]"]) == 12.5  # skipped, recorded seconds
    assert len(calls) == 1
    lm.eval_sweep(sweep, out, ["eval.lengths=[16]"])  # other arguments
    assert len(calls) == 2
    (sweep / "1_alibi_s0").mkdir()
    (sweep / "1_alibi_s0" / "results.json").write_text("{}")  # one more finished run
    lm.eval_sweep(sweep, out, ["eval.lengths=[16]"])
    assert len(calls) == 3
    monkeypatch.setattr(lm, "package_hash", lambda: "other code")
    lm.eval_sweep(sweep, out, ["eval.lengths=[16]"])
    assert len(calls) == 4
    (out / "extrapolation.json").unlink()  # results gone: evaluated again
    lm.eval_sweep(sweep, out, ["eval.lengths=[16]"])
    assert len(calls) == 5


def test_algorithmic_table_marks_failed_preconditions_and_means_both_gains(tmp_path) -> None:
    import json

    cell = {"mean": 0.5, "std": 0.1, "n": 3, "na": 0}
    series = ["nope", "rope", "rope + randomized", "alibi", "alibi + randomized", "t5"]
    summary = {
        "id_threshold": 0.9,
        "id_exact_match": {
            "nope": 0.95,
            "rope": 0.99,
            "rope + randomized": 0.97,
            "alibi": 0.98,
            "alibi + randomized": 0.5,
            "t5": 0.95,
        },
        "steps": {s: 1000.0 for s in series},
        "ood": {f"{m}|{s}": cell for m in ("exact_match", "token_acc") for s in series},
        "gain_pp": {"rope": {"token_acc": 10.0}, "alibi": {"token_acc": -4.0}},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = leaderboard.algo_section(tmp_path, tmp_path, "reverse")
    alibi = next(line for line in lines if line.startswith("| alibi |"))
    assert "0.50 ✗" in alibi and "0.98 ✗" not in alibi
    assert any("every PE** (n=2)" in line and "+3.0" in line for line in lines)
    assert any("both ID EM ≥ 0.9** (n=1)" in line and "+10.0" in line for line in lines)
    assert "reads no positions" in next(line for line in lines if line.startswith("| nope |"))
    # t5 reads positions but has no randomized runs yet
    assert "not run yet" in next(line for line in lines if line.startswith("| t5 |"))
    table = [line for line in lines if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1, "every row has the header's columns"
    assert (tmp_path / "leaderboard_algorithmic_reverse.svg").is_file()


def multi30k_lines(study: Path, summary: dict) -> list[str]:
    """The leaderboard's Multi30k table for a study dir holding ``summary`` and a stand-in figure."""
    import json

    (study / "summary.json").write_text(json.dumps({"summary": summary}))
    for ext in ("png", "svg"):
        (study / f"summary_bleu.{ext}").write_bytes(b"x")
    return leaderboard.multi30k_section(study, study)


def test_multi30k_table_gives_the_difference_from_the_first_pe_with_its_standard_error(tmp_path) -> None:
    def pe(bleu: float, std: float) -> dict:
        return {"bleu_mean": bleu, "bleu_std": std, "chrf_mean": 60.0, "chrf_std": 0.5, "n": 3}

    lines = multi30k_lines(tmp_path, {"sinusoidal": pe(35.0, 0.3), "rope": pe(37.0, 0.4)})
    rope = next(line for line in lines if line.startswith("| rope |"))
    assert rope.endswith("| +2.00 ± 0.29 |")  # sqrt((0.16 + 0.09) / 3) = 0.289
    assert next(line for line in lines if line.startswith("| sinusoidal |")).endswith("| 3 |  |")
    assert (tmp_path / "leaderboard_multi30k.svg").read_bytes() == b"x"


def test_multi30k_table_gives_no_error_bar_for_a_single_seed(tmp_path) -> None:
    one = {"bleu_mean": 36.5, "bleu_std": 0.0, "chrf_mean": 60.0, "chrf_std": 0.0, "n": 1}
    two = {"bleu_mean": 35.0, "bleu_std": 0.3, "chrf_mean": 59.0, "chrf_std": 0.2, "n": 2}
    lines = multi30k_lines(tmp_path, {"sinusoidal": two, "rope": one})
    rope = next(line for line in lines if line.startswith("| rope |"))
    assert rope == "| rope | 36.50 | 60.00 | 1 | +1.50 |"
    assert "| 35.00 ± 0.30 | 59.00 ± 0.20 | 2 |" in next(line for line in lines if line.startswith("| sin"))
