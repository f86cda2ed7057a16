"""The Hydra callback of ``posformer-train -m`` (``hydra.callbacks.sweep_summary`` in
``configs/hydra/default.yaml``): when the multirun ends, its sweep summary
(:func:`posformer.eval.sweep.collect`) and the jobs that failed; exit status 1 if any did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from posformer.eval.sweep import collect, print_failures, print_summary
from posformer.eval.sweep_jobs import load_jobs


class SweepSummary(Callback):
    """Hydra callback: when a multirun ends, summarise its sweep dir; exit 1 if any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        runs, failed = load_jobs(sweep_dir) if sweep_dir.is_dir() else ([], [])
        if runs:
            print_summary(collect(sweep_dir), sweep_dir)
        if failed:
            print_failures(failed, len(runs) + len(failed))
            raise SystemExit(1)
