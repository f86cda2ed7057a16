"""``posformer-bench ... > bench.log``: the whole table in the file, what was skipped and why, every flag
documented with its default."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posformer.bench.models import xt_version
from posformer.cli.bench import main, parse_args


def test_piped_bench_prints_the_full_table_and_what_it_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    main(
        [
            "--quick",
            "--pes",
            "nope,alibi",
            "--sections",
            "train",
            "--no-nope-reference",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ alibi")]
    assert rows and "…" not in rows[0]  # not squeezed into 80 columns
    assert len(rows[0]) > 80
    if xt_version() is None:
        assert "x-transformers is not installed: its columns stay empty" in out


def test_every_flag_has_help_with_its_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert len(flags) >= 30
    blocks = text.split("\n  --")[1:]
    undocumented = [b.split()[0] for b in blocks if len(b.split("\n")[0].split()) < 2 and "\n   " not in b]
    assert not undocumented, undocumented
    assert text.count("(default:") >= 25


def test_packed_documents_train_with_their_segment_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--documents 4``: every attention call of the training steps sees 4 equal documents a row, the
    table says so, x-transformers (no segment ids) is not compared, and 0 is a one-line usage error."""
    import json

    import posformer.model.attention as attention
    from posformer.model.backends import BACKENDS

    seen: list[object] = []

    def spy(run: Callable[..., Any]) -> Callable[..., Any]:  # records the segment ids of every call
        return lambda q, k, v, ctx, *rest: (seen.append(ctx.segment_ids), run(q, k, v, ctx, *rest))[1]

    monkeypatch.setattr(attention, "BACKENDS", {name: spy(run) for name, run in BACKENDS.items()})
    argv = ["--quick", "--pes", "forget_alibi", "--sections", "train", "--no-nope-reference"]
    main([*argv, "--documents", "4", "--out", str(tmp_path)])
    assert seen and all(ids is not None and ids.shape == (2, 32) for ids in seen)
    assert seen[0][1].tolist() == [d for d in range(4) for _ in range(8)]
    train = json.loads((tmp_path / "bench.json").read_text())["pes"]["forget_alibi"]["train"]
    assert train["tok_s"] > 0 and "xt_tok_s" not in train
    assert "train tok/s (4 documents a row)" in (tmp_path / "bench.md").read_text()
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--documents", "0", "--out", str(tmp_path / "bad")])
    assert exc.value.code == 2
    assert "--documents 0: must be between 1 and --seq-len (32)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_steps_timed_together_per_repetition(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--steps-per-rep 3``: each timed repetition runs 3 steps between two device syncs and counts
    their tokens; 0 (the default) is 4 on CUDA (a lone step would start with an empty queue and end
    with a sync training never waits for) and 1 on the CPU; a negative value is a one-line usage error."""
    import json

    import torch

    from posformer.bench import measure
    from posformer.bench.config import CUDA_STEPS_PER_REP, BenchConfig, steps_per_rep

    calls: list[str] = []
    step, sync = measure.Trainer.step, measure.sync
    monkeypatch.setattr(measure.Trainer, "step", lambda self: (calls.append("step"), step(self))[1])
    monkeypatch.setattr(measure, "sync", lambda device: (calls.append("sync"), sync(device))[1])
    argv = ["--quick", "--pes", "alibi", "--sections", "train", "--no-nope-reference", "--no-compare"]
    main([*argv, "--steps-per-rep", "3", "--out", str(tmp_path)])  # --quick: 1 warm-up step, 2 reps
    timed = "".join("s" if c == "sync" else "x" for c in calls)
    assert timed == "x" + "sxxxs" * 2  # each repetition: three steps, a sync at each end only
    cfg = json.loads((tmp_path / "bench.json").read_text())["config"]
    assert cfg["steps_per_rep"] == 3
    assert steps_per_rep(BenchConfig(), torch.device("cuda")) == CUDA_STEPS_PER_REP > 1
    assert steps_per_rep(BenchConfig(), torch.device("cpu")) == 1
    assert steps_per_rep(BenchConfig(steps_per_rep=2), torch.device("cuda")) == 2
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--steps-per-rep", "-1", "--out", str(tmp_path / "bad")])
    assert exc.value.code == 2
    assert "--steps-per-rep -1: must be at least 1 (or 0: auto)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_length_past_the_pes_range_is_recorded_and_the_bench_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xPos past the positions it represents in the bench's dtype (here made 100, centred too): that
    length's entry is the one-line reason, the shorter one is timed, and the other PEs run."""
    import json

    from posformer.pe.rope.xpos import XPosEncoding

    monkeypatch.setattr(XPosEncoding, "max_positions_in", lambda self, dtype, centred=False: 100)
    argv = ["--quick", "--pes", "xpos,rope", "--sections", "eval", "--no-nope-reference", "--no-compare"]
    main([*argv, "--eval-lengths", "64,128", "--out", str(tmp_path)])
    pes = json.loads((tmp_path / "bench.json").read_text())["pes"]
    assert pes["xpos"]["eval"]["64"]["tok_s"] > 0
    assert "represents 100 positions in float32" in pes["xpos"]["eval"]["128"]["error"]
    assert pes["rope"]["eval"]["128"]["tok_s"] > 0
