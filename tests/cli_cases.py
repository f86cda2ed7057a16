"""Command-line cases shared by the bad-input test files: the tiny overrides, the earlier files a failed
run must leave untouched, and in-process calls of the real mains (``sys.argv`` patched).

The fixtures that go with these (``cache_dir``, ``out_dir``: a run dir holding an earlier
``results.json`` and checkpoint, ``trained``) are in ``conftest.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

TINY_MODEL = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32"]
TINY_DATA = [
    "data.n_train=64",
    "data.n_val=16",
    "data.n_eval_per_length=8",
    "data.batch_size=16",
    "data.train_len=[1,4]",
    "data.eval_lengths=[4,8]",
]
TINY_TRAINING = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.log_every_n_steps=1",
    "schedule.warmup_steps=1",
]
#: no loggers, heat maps, learning-rate monitor or progress bar
QUIET = [
    "logger=none",
    "callbacks.lr_monitor=null",
    "callbacks.pe_heatmap=null",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
]
#: a 1-layer d_model 16 model on the synthetic task, 4 steps
TINY = [*TINY_MODEL, *TINY_DATA, *TINY_TRAINING, *QUIET]
#: TINY keeping the last checkpoint without a monitored metric (conftest's ``tiny_run_dir`` was trained so)
TINY_RUN = [*TINY, "callbacks.model_checkpoint.monitor=null"]
TEXT_TINY = [a for a in TINY if not a.startswith("data.")] + ["data.block_size=8", "data.eval_lengths=[8]"]
SENTINEL_RESULTS = b'{"earlier": "results", "keep": true}\n'
SENTINEL_CKPT = b"an earlier checkpoint: must survive every failed run\n"


def assert_untouched(run: Path) -> None:
    assert (run / "results.json").read_bytes() == SENTINEL_RESULTS
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == SENTINEL_CKPT
    leftovers = [p.name for p in run.rglob("*.tmp")]
    assert not leftovers, f"partial files left behind: {leftovers}"


def call(entry, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """Run a console-script entry point in-process; returns (exit code, stdout + stderr)."""
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code = 0
    try:
        entry()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def train_cli(
    args: list[str], run: Path, cache: Path, monkeypatch, capsys, tiny: list[str] | None = None
) -> tuple[int, str]:
    from posformer.cli.train import main

    argv = [
        "posformer-train",
        *(TINY if tiny is None else tiny),
        f"hydra.run.dir={run}",
        f"paths.root_dir={run.parent}",
        f"paths.cache_dir={cache}",
        *args,
    ]
    return call(main, argv, monkeypatch, capsys)


def eval_cli(args: list[str], run: Path, monkeypatch, capsys) -> tuple[int, str]:
    from posformer.cli.evaluate import main

    argv = [
        "posformer-eval",
        f"hydra.run.dir={run}",
        f"eval.output_dir={run}",
        "eval.progress=false",
        "eval.tensorboard=false",
        *args,
    ]
    return call(main, argv, monkeypatch, capsys)


def assert_clean_failure(code: int, text: str, *needles: str) -> None:
    assert code != 0, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text[-2000:]}"


def one_clear_line(code: int, text: str, expected_code: int, *needles: str) -> str:
    """Exit status, no traceback, and the one line that holds every needle (returned)."""
    assert code == expected_code, (code, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if all(n in ln for n in needles)]
    assert len(lines) == 1, f"no single line with {needles} in:\n{text[-3000:]}"
    return lines[0]
