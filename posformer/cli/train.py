"""``posformer-train``: train a model with Hydra + Lightning, then evaluate it at several lengths.

    posformer-train                                  # the default experiment
    posformer-train pe=alibi trainer.max_steps=500   # override groups/values
    posformer-train -m pe=sinusoidal,rope,alibi seed=0,1,2   # a sweep (one run dir per job)
    python -m posformer.cli.train --help                 # config groups and options

The flow (validate, train, evaluate, write ``results.{json,csv,md}`` and ``config.yaml`` in the run
directory, print a short table and the output paths) is :func:`posformer.training.run`; this module is
its Hydra main. Errors a user can cause are one ``error: ...`` line on stderr and exit status 1; in a
multirun the failing job writes that line to its ``error.txt`` and the sweep goes on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from posformer.cli.boundary import ErrorBoundary, check_sweep_dir_free, error_boundary, precheck_run_dir
from posformer.cli.composition import composition_errors
from posformer.cli.help import register_help_resolvers
from posformer.cli.hydra_record import HydraRecord
from posformer.configs import register_resolvers
from posformer.configs.plugins import check_plugins

register_resolvers()
register_help_resolvers()  # ${posformer_pe_list:} of --help

#: where Hydra put the current single run (set when the task starts; read if it fails)
_RUN_DIR: list[Path] = []


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from posformer.cli.quiet import quiet_console
    from posformer.io import atomic_write_text
    from posformer.lit.loggers import objective
    from posformer.training import run

    quiet_console()
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if HydraConfig.initialized():
        _RUN_DIR[:] = [Path(HydraConfig.get().runtime.output_dir)]
    boundary = ErrorBoundary(exit_on_error=not multirun)
    with boundary:
        results = run(cfg)
    if boundary.message is not None:  # multirun: keep the sweep going; the job's directory records it
        atomic_write_text(Path(cfg.paths.output_dir) / "error.txt", boundary.message + "\n")
        return float("nan")  # a sweeper (Optuna) records a failed trial and goes on
    return objective(results)  # val/loss for LMs, exact match for tasks (hydra/sweeper/optuna.yaml)


def __getattr__(name: str) -> Any:
    """``from posformer.cli.train import run``: the flow, imported lazily (keeps start-up light)."""
    if name == "run":
        from posformer.training import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console script ``posformer-train``."""
    with error_boundary():
        precheck_run_dir(sys.argv[1:])  # Hydra creates the run dir first and would fail with a traceback
        check_plugins(sys.argv[1:])  # logger=wandb, hydra/sweeper=optuna, ... without their package
        check_sweep_dir_free(sys.argv[1:])  # a second sweep into a sweep dir would replace its jobs
    record = HydraRecord(sys.argv[1:])  # Hydra writes .hydra/ before any check: undone if the run fails
    try:
        with composition_errors(sys.argv[1:]):  # a wrong type or an unknown key: one line, exit 1
            _hydra_main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            record.restore_after_failure(_RUN_DIR[0] if _RUN_DIR else None)
        raise


if __name__ == "__main__":
    main()
