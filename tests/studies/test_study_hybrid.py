"""The hybrid-stack study (``posformer-study hybrid``): its job list, the overrides of
each stack (composed through Hydra into the per-layer schedule the stack claims), and the table and
figure built from committed records alone. No training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from posformer.model import ModelConfig
from posformer.model.schedule import Span, Temperature
from posformer.studies import hybrid
from posformer.studies.common import StudyError
from posformer.studies.ledger import read_records, write_record

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "studies" / "hybrid_corpus32"


def _model_config(stack: str, span: int = 16) -> ModelConfig:
    """The model config ``posformer-train`` builds for ``stack`` with the study's overrides."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=[*hybrid.BASE, *hybrid.stack_overrides(stack, span)])
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(fields, dict)
    return ModelConfig(**{**fields, "vocab_size": 40, "pad_id": 0})


def test_jobs_are_seed_major_and_named_by_stack_and_seed() -> None:
    todo, grid = hybrid.jobs(hybrid.STACK_NAMES, [0, 1, 2], span=16)
    assert len(todo) == 18 and grid[:6] == [(s, 0) for s in hybrid.STACK_NAMES]
    assert [j.name for j in todo[5:8]] == ["5_gemma3_s0", "6_rope_s1", "7_nope_s1"]
    assert todo[7].overrides == ["pe=nope", "seed=1"]
    # the first seed's jobs keep their names when more seeds are added (a pilot is the study's seed 0)
    assert [j.name for j in hybrid.jobs(hybrid.STACK_NAMES, [0], 16)[0]] == [j.name for j in todo[:6]]


@pytest.mark.parametrize(
    ("stack", "pes", "spans", "temperature"),
    [
        ("rope", ["rope"] * 4, [Span()] * 4, None),
        ("alibi", ["alibi"] * 4, [Span()] * 4, None),
        (
            "irope",
            ["rope", "rope", "rope", "nope"],
            [Span("chunked", 16)] * 3 + [Span()],
            Temperature("llama4", floor_scale=16.0, attn_scale=0.1),
        ),
        ("rnope_swa", ["rope", "rope", "rope", "nope"], [Span("sliding", 16)] * 3 + [Span()], None),
        ("gemma3", ["rope"] * 4, [Span("sliding", 16)] * 3 + [Span()], None),
        ("gemma3_10k", ["rope"] * 4, [Span("sliding", 16)] * 3 + [Span()], None),
    ],
)
def test_each_stack_composes_to_the_schedule_it_claims(stack, pes, spans, temperature) -> None:
    cfg = _model_config(stack)
    assert cfg.n_layers == 4 and cfg.d_model == 64
    plan = cfg.layer_plan("decoder")
    if stack in ("rope", "alibi"):  # no schedule: today's model, its PE in every layer, full attention
        assert cfg.pe == stack and plan is None and not cfg.layer_kinds
        return
    assert cfg.pe == "nope"
    assert [k.pe for k in plan] == pes and [k.span for k in plan] == spans
    if temperature is not None:
        assert plan[3].temperature == temperature and plan[0].temperature == Temperature()
    if stack.startswith("gemma3"):  # the ablation differs in the global base alone
        assert plan[0].pe_options["base"] == 1e4
        assert plan[3].pe_options["base"] == (1e6 if stack == "gemma3" else 1e4)


def test_the_span_follows_the_option_and_an_unknown_stack_is_refused() -> None:
    assert [k.span for k in _model_config("rnope_swa", span=8).layer_plan("decoder")][0] == Span("sliding", 8)
    with pytest.raises(StudyError, match="unknown stack 'mamba'; valid: rope, nope"):
        hybrid.stack_overrides("mamba", 16)


def _fake_ledger(ledger: Path, setup: list[str]) -> None:
    """Two seeds of rope and irope: rope's perplexity doubles with each length, irope's stays 2 (+ seed)."""
    for i, (stack, seed) in enumerate([("rope", 0), ("irope", 0), ("rope", 1), ("irope", 1)]):
        rows = []
        for m in hybrid.MULTIPLES:
            ppl = (2.0 * m if stack == "rope" else 2.0) + seed
            for mode in ("nonoverlap", "sliding"):
                rows.append(
                    {
                        "mode": mode,
                        "length": 32 * m,
                        "status": "ok",
                        "loss": math.log(ppl),
                        "ppl": ppl,
                        "scored_tokens": 8192,
                        "in_distribution": m == 1,
                    }
                )
        write_record(
            ledger,
            f"{i}_{stack}_s{seed}",
            {
                "stack": stack,
                "seed": seed,
                "steps": 600,
                "train_time_s": 50.0,
                "invocations": [{"seconds": 60.0, "returncode": 0, "core": 1}],
                "setup": setup,
                "rows": rows,
            },
        )


def _args(tmp_path: Path, ledger: Path, **kw) -> object:
    import argparse

    ap = argparse.ArgumentParser()
    hybrid.add_arguments(ap)
    argv = [
        "--ledger",
        str(ledger),
        "--out",
        str(tmp_path / "out"),
        "--figure",
        str(tmp_path / "fig" / "h"),
        "--launch-for",
        "0",
        *[x for k, v in kw.items() for x in (f"--{k}", str(v))],
    ]
    args = ap.parse_args(argv)
    args.command = "posformer-study hybrid " + " ".join(argv)
    return args


def _setup(train_len: int = 32, steps: int = 600) -> list[str]:
    common = [
        *hybrid.BASE,
        f"data.block_size={train_len}",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps // 2}",
    ]
    return [*common, f"span={train_len // 2}", *hybrid.eval_overrides(train_len)]


def test_the_table_and_figure_come_from_the_records_alone(tmp_path, capsys) -> None:
    ledger = tmp_path / "ledger"
    _fake_ledger(ledger, _setup())
    hybrid.run_study(_args(tmp_path, ledger))
    text = capsys.readouterr().out
    assert "| rope | 2.50 ± 0.71 | 4.50 ± 0.71 | 8.50 ± 0.71 | 16.50 ± 0.71 | 32.50 ± 0.71 |" in text
    assert "| irope | 2.50 ± 0.71 | 2.50 ± 0.71 |" in text
    assert "| stack | 32* | 64 | 128 | 256 | 512 |" in text and "240 s summed over 4 process runs" in text
    assert text.index("| rope |") < text.index("| irope |")  # the stacks' order, not the records'
    assert (tmp_path / "fig" / "h.png").stat().st_size > 0 and (tmp_path / "fig" / "h.svg").is_file()
    agg = hybrid.summarise(read_records(ledger))
    assert agg[("rope", "nonoverlap", 512)]["n"] == 2 and agg[("rope", "nonoverlap", 512)]["mean"] == 32.5


def test_records_of_other_settings_are_refused_before_any_work(tmp_path) -> None:
    ledger = tmp_path / "ledger"
    _fake_ledger(ledger, _setup(steps=300))
    with pytest.raises(StudyError, match=r"trained with other settings .*trainer.max_steps=600"):
        hybrid.run_study(_args(tmp_path, ledger))
    assert not (tmp_path / "out").exists() and not (tmp_path / "fig").exists()


def test_a_span_longer_than_the_training_length_is_refused(tmp_path) -> None:
    with pytest.raises(StudyError, match="--span 64: must be in 1..--train-len 32"):
        hybrid.run_study(_args(tmp_path, tmp_path / "ledger", span=64))


def test_the_committed_records_rebuild_the_leaderboard_tables_and_figure(tmp_path, capsys) -> None:
    """A fresh clone's ``posformer-study hybrid --launch-for 0``: the tables of ``docs/leaderboard.md``
    and its committed figure, byte for byte, from ``docs/studies/hybrid_corpus32`` alone."""
    hybrid.run_study(_args(tmp_path, COMMITTED))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    doc = (COMMITTED.parents[2] / "docs" / "leaderboard.md").read_text().splitlines()
    assert len(rows) == 2 * 7 and [r for r in rows if r not in doc] == []
    for ext in ("png", "svg"):
        made = tmp_path / "fig" / f"h.{ext}"
        committed = COMMITTED.parents[1] / "figures" / f"leaderboard_hybrid.{ext}"
        assert made.read_bytes() == committed.read_bytes(), f"{made.name} differs from {committed}"


def test_the_committed_passkey_records_rebuild_the_needle_table_and_heat_maps(tmp_path, capsys) -> None:
    ledger = COMMITTED.parent / "hybrid_passkey64"
    hybrid.run_study(_args(tmp_path, ledger, task="passkey"))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    doc = (COMMITTED.parents[2] / "docs" / "leaderboard.md").read_text().splitlines()
    assert len(rows) == 7 and [r for r in rows if r not in doc] == []
    for ext in ("png", "svg"):
        committed = COMMITTED.parents[1] / "figures" / f"leaderboard_hybrid_needle.{ext}"
        assert (tmp_path / "fig" / f"h.{ext}").read_bytes() == committed.read_bytes()
    assert all(len(r["cells"]) == 25 and r["steps"] == 800 for r in read_records(ledger).values())


def test_the_committed_records_hold_every_length_of_both_modes() -> None:
    records = read_records(COMMITTED)
    for name, rec in records.items():
        got = {(r["mode"], r["length"]) for r in rec["rows"] if r["status"] == "ok"}
        want = {(m, 32 * k) for m in ("nonoverlap", "sliding") for k in hybrid.MULTIPLES}
        assert got == want, name
        assert rec["steps"] == 600 and rec["stack"] in hybrid.STACK_NAMES + hybrid.ABLATIONS


def test_the_passkey_task_trains_on_passkey_and_scores_the_needle_grid() -> None:
    common = hybrid.task_common("passkey", 64, 800)
    assert common[0] == "data=passkey" and {"data.train_len=[8,64]", "trainer.max_steps=800"} <= set(common)
    args = hybrid.needle_args(64)
    assert args[: args.index("--depths")] == ["--lengths", "32", "64", "128", "256", "512"]
    assert hybrid.task_common("lm", 32, 600)[:3] == [*hybrid.BASE, "data.block_size=32"]
    from hydra import compose, initialize_config_module

    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=[*common, *hybrid.stack_overrides("irope", 32)])
    assert cfg.data.task == "passkey" and cfg.model.n_layers == 4
    assert cfg.model.layer_kinds.local.span.window == 32 and cfg.model.layers.pattern[3] == "global"


def test_the_needle_table_and_heat_maps_come_from_the_records_alone(tmp_path, capsys) -> None:
    ledger = tmp_path / "ledger"
    setup = [*hybrid.task_common("passkey", 64, 800), "span=32", *hybrid.needle_args(64)]
    for i, (stack, seed) in enumerate([("rope", 0), ("nope", 0), ("rope", 1), ("nope", 1)]):
        # rope: found within the training lengths only, and in seed 1 only at depth 1; nope: everywhere
        cells = [
            {
                "length": n,
                "depth": d,
                "token_acc": 1.0,
                "exact_match": 1.0 if stack == "nope" or (n <= 64 and (seed == 0 or d == 1.0)) else 0.0,
            }
            for n in (32, 64, 128, 256, 512)
            for d in hybrid.NEEDLE_DEPTHS
        ]
        write_record(
            ledger,
            f"{i}_{stack}_s{seed}",
            {"stack": stack, "seed": seed, "steps": 800, "invocations": [], "setup": setup, "cells": cells},
        )
    hybrid.run_study(_args(tmp_path, ledger, task="passkey"))
    text = capsys.readouterr().out
    assert "| stack | 32* | 64* | 128 | 256 | 512 |" in text
    assert "| rope | 0.60 ± 0.57 | 0.60 ± 0.57 | 0.00 ± 0.00 |" in text  # seeds: 1.0 and 0.2 (1 depth of 5)
    assert "| nope | 1.00 ± 0.00 |" in text
    cells = hybrid.needle_cells(read_records(ledger))
    assert cells[("rope", 64, 1.0)]["mean"] == 1.0 and cells[("rope", 64, 0.5)]["mean"] == 0.5
    assert (tmp_path / "fig" / "h.png").is_file() and (tmp_path / "fig" / "h.svg").is_file()
