"""The ecosystem's loggers and tools: logger configs (CSV, TensorBoard, W&B, MLflow) that write their
files, hparams and figures through the generic logger API, early stopping, the train main's
objective, the Optuna sweeper, FSDP and the missing-plugin hint."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module

from posformer.configs import plugins
from posformer.errors import ConfigError
from posformer.lit.loggers import objective

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
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "schedule.warmup_steps=1",
    "callbacks.progress_bar=null",
    "+trainer.enable_progress_bar=false",
    "callbacks.pe_heatmap.length=8",
]
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
PACKAGE = {"wandb": "wandb", "mlflow": "mlflow"}


def compose_train(overrides: list[str], tmp_path: Path):
    with initialize_config_module("posformer.configs", version_base="1.3"):
        return compose(
            "train",
            overrides=[
                *overrides,
                f"paths.root_dir={tmp_path}",
                f"paths.output_dir={tmp_path}/run",
                f"paths.cache_dir={tmp_path}/cache",
            ],
        )


def train(overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    from posformer.training import run

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # nothing of W&B outside the test's folder
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    return run(compose_train([*TINY, *overrides], tmp_path))


@pytest.mark.parametrize("name", LOGGERS)
def test_every_logger_config_composes_and_names_an_importable_class(name: str, tmp_path: Path) -> None:
    from hydra.utils import get_class

    cfg = compose_train([f"logger={name}"], tmp_path)
    [(key, conf)] = cfg.logger.items()
    assert key == name and get_class(conf._target_).__module__.startswith("lightning.pytorch.loggers")


def _written(name: str, run_dir: Path) -> dict[str, str]:
    """What a logger wrote under the run dir: ``{"hparams": ..., "curves": ..., "figure": ...}``, as text."""
    if name == "csv":
        return {
            "hparams": (run_dir / "csv" / "hparams.yaml").read_text(),
            "curves": (run_dir / "csv" / "metrics.csv").read_text(),
            "figure": "",
        }
    if name == "tensorboard":
        events = b"".join(p.read_bytes() for p in (run_dir / "tensorboard").rglob("events.out.tfevents*"))
        text = events.decode("latin-1")
        return {"hparams": text, "curves": text, "figure": text}
    if name == "wandb":
        import wandb

        wandb.finish()  # offline: the run file is complete once W&B's service has flushed it
        [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
        deadline = time.monotonic() + 60  # the service writes asynchronously (slow on a loaded machine)
        text = run_file.read_bytes().decode("latin-1")
        wanted = ("schedule", "exact_match_vs_length")
        while not all(k in text for k in wanted) and time.monotonic() < deadline:
            time.sleep(0.5)
            text = run_file.read_bytes().decode("latin-1")
        return {"hparams": text, "curves": text, "figure": text}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("posformer").experiment_id])
    figures = [f.path for f in client.list_artifacts(run.info.run_id, "position_logits")]
    figures += [g.path for f in figures for g in client.list_artifacts(run.info.run_id, f)]
    assert all(str(run_dir) in p for p in (run.info.artifact_uri,))  # artifacts in the run dir
    return {
        "hparams": " ".join(run.data.params),
        "curves": " ".join(run.data.metrics),
        "figure": " ".join(figures),
    }


@pytest.mark.parametrize(
    "name",
    [*LOGGERS[:-1], pytest.param("mlflow", marks=pytest.mark.slow)],  # MLflow: ~30 s of store set-up
)
def test_a_tiny_run_with_each_logger_writes_hparams_curves_and_figures(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name in PACKAGE:
        pytest.importorskip(PACKAGE[name], reason=f"logger={name} needs the [{name}] extra")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    results = train([f"logger={name}"], tmp_path, monkeypatch)
    run_dir = Path(results["output_dir"])
    assert not list(cwd.iterdir())  # no ./mlruns, ./wandb or ./lightning_logs: all in the run dir
    written = _written(name, run_dir)
    assert "seed" in written["hparams"] and "schedule" in written["hparams"]  # hparams through the API
    assert "exact_match_vs_length" in written["curves"] and "train/loss" in written["curves"].replace(
        "train_loss", "train/loss"
    )
    if name != "csv":  # CSV takes no images
        assert "position_logits" in written["figure"]


def test_early_stopping_is_off_by_default_and_stops_on_val_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "early_stopping" not in compose_train([], tmp_path).callbacks
    cfg = compose_train(["callbacks=early_stopping"], tmp_path)
    assert cfg.callbacks.early_stopping.monitor == "val/loss" and "model_checkpoint" in cfg.callbacks
    # a threshold every loss meets: stop at the first validation (step 2 of 8)
    results = train(
        [
            "callbacks=early_stopping",
            "callbacks.early_stopping.stopping_threshold=1.0e9",
            "trainer.max_steps=8",
            "logger=none",
            "callbacks.lr_monitor=null",
            "callbacks.pe_heatmap=null",
        ],
        tmp_path,
        monkeypatch,
    )
    assert results["global_step"] == 2


def test_objective_is_val_loss_for_language_models_and_exact_match_for_tasks() -> None:
    rows = [{"in_distribution": True, "n_sequences": 8, "exact_match": 0.25, "loss": 2.5, "length": 4}]
    assert objective({"data": {"task_type": "lm"}, "val": {"val/loss": 1.5}, "results": rows}) == 1.5
    assert objective({"data": {"task_type": "lm"}, "val": {}, "results": rows}) == 2.5
    assert objective({"data": {"task_type": "task"}, "val": {"val/loss": 1.5}, "results": rows}) == 0.25
    assert math.isnan(objective({"data": {"task_type": "task"}, "val": {}, "results": []}))


def test_fsdp_strategy_config_composes(tmp_path: Path) -> None:
    cfg = compose_train(["trainer=fsdp"], tmp_path)
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == 2


def test_sweeper_and_launcher_configs_compose(tmp_path: Path) -> None:
    cases = [("hydra/launcher=submitit_slurm", "launcher")]
    if plugins._importable("hydra_plugins.hydra_optuna_sweeper"):  # its base config ships with the plugin
        cases.insert(0, ("hydra/sweeper=posformer_optuna", "sweeper"))
    with initialize_config_module("posformer.configs", version_base="1.3"):
        for override, key in cases:
            cfg = compose("train", overrides=[override], return_hydra_config=True)
            assert "hydra_plugins" in cfg.hydra[key]._target_
    assert cfg.hydra.launcher.submitit_folder.endswith("/.submitit/%j")


def test_a_missing_plugin_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "_importable", lambda module: False)
    with pytest.raises(
        ConfigError,
        match=r"hydra/launcher=submitit_slurm needs the hydra-submitit-launcher "
        r"package.*pip install -e '\.\[slurm\]'",
    ):
        plugins.check_plugins(["-m", "pe=rope,alibi", "hydra/launcher=submitit_slurm"])
    with pytest.raises(ConfigError, match=r"logger=wandb needs the wandb package.*\[wandb\]"):
        plugins.check_plugins(["logger=wandb"])
    plugins.check_plugins(["logger=csv", "pe=rope"])  # core loggers need nothing


@pytest.mark.slow  # a subprocess
def test_missing_launcher_plugin_from_the_command_line(tmp_path: Path) -> None:
    if plugins._importable("hydra_plugins.hydra_submitit_launcher"):
        pytest.skip("hydra-submitit-launcher is installed")
    proc = subprocess.run(
        [sys.executable, "-m", "posformer.cli.train", "-m", "hydra/launcher=submitit_slurm", "seed=0,1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "pip install -e '.[slurm]'" in proc.stderr and not (tmp_path / "outputs").exists()


@pytest.mark.slow  # a 2-trial Optuna study, each trial a tiny training job
def test_optuna_sweep_of_two_trials(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="needs the [optuna] extra")
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "posformer.cli.train",
            "-m",
            "hydra/sweeper=posformer_optuna",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.direction=maximize",
            "optim.lr=interval(0.001,0.01)",
            *TINY,
            "logger=none",
            "callbacks.pe_heatmap=null",
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=${hydra.job.num}",  # trial dirs by number (Optuna writes no multirun.yaml)
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert 0.001 <= best["best_params"]["optim.lr"] <= 0.01 and 0.0 <= best["best_value"] <= 1.0
    assert len(list(sweep.glob("*/results.json"))) == 2
