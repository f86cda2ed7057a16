"""Short runs, the quiet console, the step progress bar, results tables and --help."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from posformer.lit.optim import fit_to_run, schedule_factor, warmup_steps

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.d_ff=32",
    "data.n_train=64",
    "data.n_val=16",
    "data.n_eval_per_length=8",
    "data.batch_size=16",
    "data.train_len=[1,4]",
    "data.eval_lengths=[4,8]",
    "logger=none",
    "callbacks.lr_monitor=null",
    "callbacks.pe_heatmap=null",
    "torch_threads=1",
]


# ------------------------------------------------------------------------------------------ short runs
def test_warmup_fraction_is_a_share_of_the_schedule():
    assert warmup_steps({"name": "cosine", "warmup_steps": 0.05}, 2000) == 100
    assert warmup_steps({"name": "cosine", "warmup_steps": 0.05, "total_steps": 400}, 2000) == 20
    assert warmup_steps({"name": "constant", "warmup_steps": 0.01}, 50) == 1  # at least one step
    assert warmup_steps({"name": "cosine", "warmup_steps": 7}, 2000) == 7
    # the default (0.05 of 2000) is the old default of 100 steps: same learning rates, same weights
    frac = schedule_factor(
        {"name": "cosine", "warmup_steps": 0.05, "min_lr_ratio": 0.1}, d_model=64, max_steps=2000
    )
    steps = schedule_factor(
        {"name": "cosine", "warmup_steps": 100, "min_lr_ratio": 0.1}, d_model=64, max_steps=2000
    )
    assert [frac(s) for s in range(0, 2000, 37)] == [steps(s) for s in range(0, 2000, 37)]


def test_fit_to_run_clamps_what_does_not_fit_in_one_line():
    changes, message = fit_to_run(
        {"name": "cosine", "warmup_steps": 100}, {"max_steps": 50, "val_check_interval": 250}
    )
    assert changes == {"schedule.warmup_steps": 5, "trainer.val_check_interval": 50}
    assert "\n" not in message and "trainer.max_steps=50" in message
    assert "schedule.warmup_steps 100 -> 5" in message and "trainer.val_check_interval 250 -> 50" in message


def test_fit_to_run_leaves_a_fitting_run_alone():
    assert fit_to_run(
        {"name": "cosine", "warmup_steps": 100}, {"max_steps": 2000, "val_check_interval": 250}
    ) == (
        {},
        "",
    )
    # a fraction always fits; it is only resolved to steps
    assert fit_to_run({"name": "cosine", "warmup_steps": 0.1}, {"max_steps": 50}) == (
        {"schedule.warmup_steps": 5},
        "",
    )
    assert fit_to_run({"name": "cosine", "warmup_steps": 100}, {"max_steps": -1, "max_epochs": 3}) == ({}, "")


def test_short_run_validates_keeps_a_best_checkpoint_and_warns_once(tmp_path, caplog):
    """A 4-step run with the default warm-up and validation interval (250) trains, validates at the
    end, evaluates its best checkpoint and says what it clamped in one warning."""
    from hydra import compose, initialize_config_module

    from posformer.training import run

    overrides = [
        *TINY,
        "trainer.max_steps=4",
        "schedule.warmup_steps=100",
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}/run",
        f"paths.cache_dir={tmp_path}/cache",
    ]
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with caplog.at_level(logging.WARNING, logger="posformer"):
        results = run(cfg)
    assert results["val"] and "val/loss" in results["val"]
    assert (
        results["checkpoint"]["best"] and results["checkpoint"]["evaluated"] == results["checkpoint"]["best"]
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "short run" in warned[0]
    written = (tmp_path / "run" / "config.yaml").read_text()
    assert "warmup_steps: 0" in written or "warmup_steps: 1" in written  # the clamped value is recorded


# ------------------------------------------------------------------------------------------ console
def test_console_filter_drops_known_noise_and_file_only_records():
    from posformer.cli.quiet import ConsoleFilter, ConsoleFormatter
    from posformer.utils.format import FILE_ONLY

    def record(msg: str, level: int = logging.INFO, **extra) -> logging.LogRecord:
        rec = logging.LogRecord("lightning.pytorch", level, __file__, 1, msg, None, None)
        rec.__dict__.update(extra)
        return rec

    f = ConsoleFilter()
    for noise in (
        "GPU available: False, used: False",
        "TPU available: False, using: 0 TPU cores",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
        "Restoring states from the checkpoint path at /x.ckpt",
        "Loaded model weights from the checkpoint at /x.ckpt",
        "`Trainer.fit` stopped: `max_steps=50` reached.",
    ):
        assert not f.filter(record(noise)), noise
    assert f.filter(record("model: decoder, pe=rope, d_model=16, 1,000 parameters, seed 0"))
    assert not f.filter(record("| table |", **FILE_ONLY))
    fmt = ConsoleFormatter("%(message)s")
    assert fmt.format(record("clamped", logging.WARNING)) == "warning: clamped"
    assert fmt.format(record("model: x")) == "model: x"


def test_quiet_console_ignores_the_known_warnings_only():
    from posformer.cli.quiet import quiet_console

    lightning_loggers = {
        n: logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")
    }
    saved = {n: (list(lg.handlers), lg.propagate) for n, lg in lightning_loggers.items()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_console()
            warnings.warn(
                "`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1
            )
            warnings.warn(
                "It is recommended to use `self.log('val/loss', ..., sync_dist=True)`", stacklevel=1
            )
            warnings.warn("something new", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["something new"]
        assert all(lg.propagate for lg in lightning_loggers.values())
    finally:
        for n, (handlers, propagate) in saved.items():
            lightning_loggers[n].handlers[:] = handlers
            lightning_loggers[n].propagate = propagate


def test_bar_metrics_follow_the_task_type():
    from posformer.lit.progress import bar_metrics

    logged = {"train/loss": 2.0, "val/ppl": 9.0, "val/exact_match": 0.5, "val/loss": 2.1}
    assert bar_metrics(logged, "lm") == {"loss": 2.0, "ppl": pytest.approx(math.exp(2.0)), "val ppl": 9.0}
    assert bar_metrics(logged, "task") == {"loss": 2.0, "val exact": 0.5}
    assert bar_metrics({"train/loss": 1.0}, "task") == {"loss": 1.0}


def test_step_progress_bar_is_one_bar_over_the_steps():
    """6 steps over 3 epochs of 2 batches: one task 'rope step' with total = completed = 6."""
    import lightning as L
    import torch

    from posformer.lit.progress import StepProgressBar

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"model": {"pe": "rope"}, "data": {"task_type": "lm"}})
            self.w = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.w(batch[0]).pow(2).mean()
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    bar = StepProgressBar()
    trainer = L.Trainer(
        max_steps=6,
        max_epochs=-1,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Tiny(), data)
    tasks = [t for t in bar.progress.tasks if t.visible]
    assert len(tasks) == 1
    assert tasks[0].description.endswith("rope step") and tasks[0].total == 6 and tasks[0].completed == 6
    assert set(bar.get_metrics(trainer, trainer.lightning_module)) == {"loss", "ppl"}


def test_results_tables_show_the_metrics_of_the_task_type():
    from posformer.lit.results import results_markdown, table_columns

    lm = [key for key, _ in table_columns("lm")]
    task = [key for key, _ in table_columns("task")]
    assert "exact_match" not in lm and "ppl" in lm
    assert "ppl" not in task and task[2] == "exact_match"
    row = {
        "length": 8,
        "in_distribution": True,
        "exact_match": 0.0,
        "token_acc": 0.3,
        "loss": 2.0,
        "ppl": 7.4,
        "n_sequences": 4,
        "n_tokens": 32,
        "note": "",
    }
    text = results_markdown([row], "t", "lm")
    assert "ppl" in text and "exact match" not in text and "note" not in text


# ------------------------------------------------------------------------------------------ commands
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSFORMER_ROOT": str(cwd), "COLUMNS": "120"}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; from posformer.cli.{args[0]} import main; sys.argv[0]='x'; main()",
            *args[1:],
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize("main", ["train", "evaluate"])
def test_help_has_a_description_the_pe_list_and_examples(main, tmp_path):
    from posformer.pe import list_encodings

    out = _cli(main, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Examples:" in out.stdout and "Config groups" in out.stdout
    assert all(name in out.stdout for name in list_encodings())
    assert out.stdout.startswith("posformer-")


@pytest.mark.slow
def test_train_and_eval_consoles_are_quiet_and_eval_writes_its_log(tmp_path):
    """One line per fact: no third-party tips, no duplicated lines; posformer-eval prints a table and
    writes eval.log."""
    out = _cli("train", *TINY, "trainer.max_steps=4", "hydra.run.dir=run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    for noise in ("GPU available", "TPU available", "Tip:", "LeafSpec", "Restoring states", "Epoch 0/"):
        assert noise not in text, noise
    lines = [line for line in text.splitlines() if line.strip()]
    assert sum("parameters, attention " in line and "seed 0" in line for line in lines) == 1  # the model line
    assert "step" in text and "exact match" in text and "| ppl" not in text
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ev = _cli(
        "evaluate", f"eval.checkpoints=[{ckpt}]", "eval.lengths=[4,8]", "hydra.run.dir=ev", cwd=tmp_path
    )
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "exact match by length" in ev.stdout and "4*" in ev.stdout and "Restoring states" not in ev.stdout
    log = (tmp_path / "ev" / "eval.log").read_text()
    assert "exact match by length (* = trained)" in log and "| model |" in log and "extrapolation.md" in log
