"""``posformer-train``: train a model with Hydra + Lightning, then evaluate it at several lengths.

    posformer-train                                  # the default experiment
    posformer-train pe=alibi trainer.max_steps=500   # override groups/values
    posformer-train -m pe=sinusoidal,rope,alibi seed=0,1,2   # a sweep (one run dir per job)
    python -m posformer.cli.train --help                 # config groups and options

The flow (validate, train, evaluate, write ``results.{json,csv,md}`` and ``config.yaml`` in the run
directory, print a short table and the output paths) is :func:`posformer.lit.run.run`; this module is
its Hydra main. Errors a user can cause are one ``error: ...`` line on stderr and exit status 1; in a
multirun the failing job writes that line to its ``error.txt`` and the sweep goes on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from posformer.cli.boundary import ErrorBoundary, error_boundary, precheck_run_dir
from posformer.configs import register_resolvers

register_resolvers()


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from posformer.io import atomic_write_text
    from posformer.lit.results import headline
    from posformer.lit.run import run

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    boundary = ErrorBoundary(exit_on_error=not multirun)
    with boundary:
        results = run(cfg)
    if boundary.message is not None:  # multirun: keep the sweep going; the job's directory records it
        atomic_write_text(Path(cfg.paths.output_dir) / "error.txt", boundary.message + "\n")
        return None
    return headline(results["results"]).get("hp/exact_match_train_len")


def __getattr__(name: str) -> Any:
    """``from posformer.cli.train import run``: the flow, imported lazily (keeps start-up light)."""
    if name == "run":
        from posformer.lit.run import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console script ``posformer-train``."""
    with error_boundary():
        precheck_run_dir(sys.argv[1:])  # Hydra creates the run dir first and would fail with a traceback
    _hydra_main()


if __name__ == "__main__":
    main()
