"""The training progress bar: one step-based bar per run (Lightning's ``RichProgressBar``, subclassed).

    rope step ━━━━━━━━━━━━━━━━ 1200/2000 eta 00:39 loss: 0.412 · val exact: 0.873

Lightning's bar counts batches per epoch (``Epoch 0/-2`` with ``max_epochs=-1``) and shows every
``prog_bar`` metric under its full name. :class:`StepProgressBar` counts optimizer steps over the
whole run (``trainer.global_step`` of ``trainer.max_steps``; a resumed run starts where it stopped),
shows the remaining time (the elapsed time once finished), and the metrics that mean something for
the run's task type (``data.task_type`` of the module's hyper-parameters): the training loss, for
language models and translation the perplexity (of the training loss, and of the last validation),
for tasks the exact match of the last validation (:func:`bar_metrics`). The final evaluation's bar
is removed when it ends. The description names the run: its variant, else its PE (:func:`module_label`).

When standard output is not a terminal (``posformer-train -m ... > sweep.log``, a batch job) a bar
is only noise: :class:`PlainProgress` prints one plain line instead, about twenty times a run and at
least every minute, and one when training ends::

    rope step 1200/2000 (60%) · loss 0.412 · val exact 0.87 · 31,200 tok/s (MFU n/a) · 0:45 elapsed · eta 0:30

The MFU (model FLOPs utilisation, :class:`~posformer.lit.callbacks.Throughput`) needs the devices' peak:
``POSFORMER_PEAK_FLOPS`` (one device's FLOP/s), else a known GPU's 16-bit peak; "n/a" without one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import (
    BatchesProcessedColumn,
    CustomBarColumn,
    RichProgressBarTheme,
)
from rich.progress import TimeRemainingColumn

from posformer.configs.variants import run_label
from posformer.metrics import headline, perplexity

__all__ = ["PlainProgress", "StepProgressBar", "bar_metrics", "progress_bar"]


def module_label(module: Any) -> str:
    """The label of the run a module trains (:func:`posformer.configs.variants.run_label`): its variant's
    name, else its PE (a per-layer schedule: ``rope×1+nope×1``); empty without a model config."""
    hparams = getattr(module, "hparams", {}) or {}
    model = hparams.get("model") or {}
    return run_label(model, hparams.get("variant")) if model or hparams.get("variant") else ""


def bar_metrics(metrics: Mapping[str, Any], task_type: str) -> dict[str, float]:
    """The bar's metrics from the logged ones: ``loss`` (``train/loss``) always, then by the task type's
    headline metric (:func:`posformer.metrics.headline`): ``ppl`` (of the training loss) and ``val ppl``
    for perplexity, ``val exact`` for exact match. Missing metrics are left out.
    """
    main = headline(task_type)
    out: dict[str, float] = {}
    if "train/loss" in metrics:
        out["loss"] = float(metrics["train/loss"])
        if main.name == "ppl":
            out["ppl"] = perplexity(out["loss"])
    if f"val/{main.name}" in metrics:
        out[f"val {main.header.split()[0]}"] = float(metrics[f"val/{main.name}"])  # val ppl, val exact
    return out


class StepProgressBar(RichProgressBar):
    """One bar over the run's optimizer steps (see the module docstring).

    ``refresh_rate``: redraws per second (rich's). The step count moves every step; the metrics
    (device tensors: reading one waits for the step) are read at most every ``metrics_every_s``
    seconds and at the last step, so on a GPU the bar adds no host sync to most steps.
    """

    def __init__(self, refresh_rate: int = 10, bar_width: int = 16, metrics_every_s: float = 1.0) -> None:
        theme = RichProgressBarTheme(metrics_text_delimiter=" · ", metrics_format=".4g")
        super().__init__(refresh_rate=refresh_rate, leave=True, theme=theme)
        self.bar_width = int(bar_width)
        self.metrics_every_s = float(metrics_every_s)
        self._metrics_read = 0.0  # perf_counter() of the last read (or of the start of training)

    # ------------------------------------------------------------------ what is shown
    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    @property
    def test_description(self) -> str:
        return "evaluating"

    def _get_train_description(self, current_epoch: int) -> str:
        module = self.trainer.lightning_module
        return f"{module_label(module) if module else ''} step".strip()

    def configure_columns(self, trainer: L.Trainer) -> list:
        theme = self.theme
        return [
            "[progress.description]{task.description}",
            CustomBarColumn(
                bar_width=self.bar_width,
                complete_style=theme.progress_bar,
                finished_style=theme.progress_bar_finished,
                pulse_style=theme.progress_bar_pulse,
            ),
            BatchesProcessedColumn(style=theme.batch_progress),
            "eta",  # the remaining time; the elapsed time once finished
            TimeRemainingColumn(compact=True, elapsed_when_finished=True),
        ]

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        data = getattr(pl_module, "hparams", {}).get("data") or {}
        return bar_metrics(trainer.callback_metrics, str(data.get("task_type", "task")))

    # ------------------------------------------------------------------ one bar for the run
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._metrics_read = time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.train_progress_bar_id is not None and self.progress is not None:
            return  # a new epoch continues the run's bar
        super().on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)  # resumed: start where it stopped

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        now = time.perf_counter()
        if now - self._metrics_read >= self.metrics_every_s or trainer.global_step == trainer.max_steps:
            self._metrics_read = now
            self._update_metrics(trainer, pl_module)
        self.refresh()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.progress is not None and self.test_progress_bar_id is not None:
            self.progress.remove_task(self.test_progress_bar_id)
            self.test_progress_bar_id = None
            self.refresh(hard=True)
        super().on_test_end(trainer, pl_module)


def _clock(seconds: float) -> str:
    """``h:mm:ss`` / ``m:ss``."""
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class PlainProgress(ProgressBar):
    """Plain progress lines for a log file (see the module docstring); a Lightning ``ProgressBar``, so
    Lightning adds no bar of its own.

    Args:
        lines: about how many lines a run prints (one per ``max_steps / lines`` steps).
        every_s: and at least one line per this many seconds.
    """

    def __init__(self, lines: int = 20, every_s: float = 60.0) -> None:
        super().__init__()
        self.lines, self.every_s = max(int(lines), 1), float(every_s)
        self._enabled = True
        self._started = self._last = 0.0
        self._first_step = 0
        self._val_step: int | None = None  # the step of the last validation (not the sanity check)

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = self._last = time.perf_counter()
        self._first_step = int(trainer.global_step)  # a resumed run: the rate counts this run's steps

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, total = int(trainer.global_step), int(trainer.max_steps or 0)
        every = max(total // self.lines, 1) if total > 0 else 100
        now = time.perf_counter()
        if step % every and now - self._last < self.every_s and step != total:
            return
        self._last = now
        self.line(trainer, pl_module, step, total, now)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_step = int(trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The last line: the step and time, and the last validation's metric with the step it was taken
        at (the progress lines repeat it until the next validation)."""
        elapsed = _clock(time.perf_counter() - self._started)
        line = f"{self._description(pl_module)} finished at step {trainer.global_step} in {elapsed}"
        data = getattr(pl_module, "hparams", {}).get("data") or {}
        val = {
            k: v for k, v in bar_metrics(trainer.callback_metrics, str(data.get("task_type", "task"))).items()
        }
        val = {k: v for k, v in val.items() if k.startswith("val ")}
        if val and self._val_step is not None:
            line += " · final " + " · ".join(f"{k} {v:.4g}" for k, v in val.items())
            line += f" (validated at step {self._val_step})"
        self.print_line(line)

    def line(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, total: int, now: float
    ) -> None:
        """One progress line: step, metrics, throughput, elapsed time and the remaining time."""
        parts = [
            f"{self._description(pl_module)} step {step}"
            + (f"/{total} ({100 * step // total}%)" if total > 0 else "")
        ]
        data = getattr(pl_module, "hparams", {}).get("data") or {}
        shown = bar_metrics(trainer.callback_metrics, str(data.get("task_type", "task")))
        parts += [f"{k} {v:.4g}" for k, v in shown.items()]
        tok_s = trainer.callback_metrics.get("train/tokens_per_s")
        if tok_s is not None:
            mfu = trainer.callback_metrics.get("train/mfu")  # only with a known peak (POSFORMER_PEAK_FLOPS)
            parts.append(
                f"{float(tok_s):,.0f} tok/s (MFU {f'{100 * float(mfu):.1f}%' if mfu is not None else 'n/a'})"
            )
        elapsed = now - self._started
        parts.append(f"{_clock(elapsed)} elapsed")
        done = step - self._first_step
        if total > 0 and done > 0:
            parts.append(f"eta {_clock(elapsed / done * (total - step))}")
        self.print_line(" · ".join(parts))

    def print_line(self, text: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(text, flush=True)

    @staticmethod
    def _description(pl_module: L.LightningModule) -> str:
        return module_label(pl_module) or "training"


def progress_bar(rich: bool = True, refresh_rate: int = 10, metrics_every_s: float = 1.0) -> Callback:
    """The run's progress display: :class:`PlainProgress` lines when standard output is not a terminal
    (a log file); else the :class:`StepProgressBar` (metrics read at most every ``metrics_every_s``
    seconds), or Lightning's plain TQDM bar (``rich=false`` or no ``rich``; it reads them every
    ``refresh_rate`` steps)."""
    if not sys.stdout.isatty():
        return PlainProgress()
    if rich:
        try:
            return StepProgressBar(refresh_rate=refresh_rate, metrics_every_s=metrics_every_s)
        except ModuleNotFoundError:  # rich missing: fall back
            pass
    return TQDMProgressBar(refresh_rate=refresh_rate)
