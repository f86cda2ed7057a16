"""``posformer-bench ... > bench.log``: the whole table in the file, what was skipped and why, every flag
documented with its default."""

from __future__ import annotations

from pathlib import Path

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
