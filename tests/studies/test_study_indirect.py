"""The indirect-indexing study: the algorithmic study's ``--plain-only`` grid and ``--symbols`` override,
and the leaderboard's table of its records (exact match in and beyond the training range, over seeds)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posformer.studies import algorithmic
from posformer.studies.leaderboard import indirect_section
from posformer.studies.ledger import write_record


def test_plain_only_drops_the_randomized_runs_and_symbols_reaches_the_data() -> None:
    both = algorithmic.grid(["pope", "rope"], [0, 1])
    plain = algorithmic.grid(["pope", "rope"], [0, 1], plain_only=True)
    assert len(both) == 8 and len(plain) == 4
    assert {r["positions.randomized"] for r in plain} == {"false"}
    ap = argparse.ArgumentParser()
    algorithmic.add_arguments(ap)
    size = algorithmic.SIZES["indirect"]
    default = algorithmic.train_overrides(ap.parse_args(["--task", "indirect_index"]), size)
    argv = ["--task", "indirect_index", "--symbols", "64", "--n-train", "200000"]
    ours = algorithmic.train_overrides(ap.parse_args(argv), size)
    assert [o for o in ours if o not in default] == ["data.symbols=64", "data.n_train=200000"]
    # existing ledgers keep their setting
    assert not any(o.startswith(("data.symbols", "data.n_train")) for o in default)


def _rows(pe: str, id_em: list[float], ood_em: list[float]) -> list[dict]:
    lengths = [(4, True), (16, True), (24, False), (32, False)]
    ems = [*id_em, *ood_em]
    return [
        {"pe": pe, "mode": "task", "length": n, "in_distribution": d, "status": "ok", "exact_match": em}
        for (n, d), em in zip(lengths, ems, strict=True)
    ]


def test_indirect_table_is_the_mean_and_std_over_seeds_of_each_runs_mean(tmp_path: Path) -> None:
    for i, (pe, seed, id_em, ood_em) in enumerate(
        [
            ("pope", 0, [1.0, 0.8], [0.5, 0.1]),
            ("pope", 1, [1.0, 1.0], [0.3, 0.1]),
            ("rope", 0, [0.2, 0.0], [0.0, 0.0]),
        ]
    ):
        rec = {"pe": pe, "randomized": False, "seed": seed, "rows": _rows(pe, id_em, ood_em)}
        write_record(tmp_path, f"{i}_{pe}_s{seed}", rec)
    lines = indirect_section(tmp_path)
    head = "| PE | exact match %, lengths 4–16 (in distribution) | exact match %, lengths 24, 32 |"
    assert lines[0].startswith(head)
    # rope is listed before pope (the studies' table order); pope: run means 90 and 100, ood 30 and 20
    assert lines[2] == "| rope | 10.00 | 0.00 | 1 | 11.16 |"
    assert lines[3] == "| pope | 95.00 ± 7.07 | 25.00 ± 7.07 | 2 | 94.82 |"
