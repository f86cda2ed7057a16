"""Training callbacks: the PE heat-map figure, the non-finite loss guard, throughput and the
progress bar."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from posformer.errors import PosformerError
from posformer.model.positions import arange_positions
from posformer.pe.base import PositionalEncoding


class TrainingDivergedError(PosformerError, RuntimeError):
    """The training loss became NaN or infinite."""


def progress_bar(rich: bool = True, refresh_rate: int = 10) -> Callback:
    """A RichProgressBar (elapsed and remaining time per epoch) or a plain TQDM bar."""
    if rich:
        try:
            return RichProgressBar(refresh_rate=refresh_rate, leave=True)
        except ModuleNotFoundError:  # rich missing: fall back
            pass
    return TQDMProgressBar(refresh_rate=refresh_rate)


def pe_modules(model: torch.nn.Module) -> dict[str, PositionalEncoding]:
    """The model's positional encodings by attribute path (``pe``, ``pe_enc``, ``pe_dec``, ...)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, PositionalEncoding)}


def pe_figure(pe: PositionalEncoding, length: int, max_heads: int = 4, title: str = ""):
    """A matplotlib figure of ``pe.position_logits(length)``: one (T, T) heat map per head."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    logits = pe.position_logits(arange_positions(length)).detach().float().cpu()  # (H, T, T)
    heads = min(logits.shape[0], max_heads)
    fig, axes = plt.subplots(1, heads, figsize=(3.2 * heads, 3.0), squeeze=False)
    for h in range(heads):
        ax = axes[0, h]
        im = ax.imshow(logits[h].numpy(), cmap="viridis", aspect="auto")
        ax.set_title(f"head {h}" if logits.shape[0] > 1 else "all heads", fontsize=9)
        ax.set_xlabel("key position")
        if h == 0:
            ax.set_ylabel("query position")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title or f"{pe.name}: position-only attention logits", fontsize=10)
    fig.tight_layout()
    return fig


class PEHeatmap(Callback):
    """At train start, log each PE's position-only attention logits as a figure to TensorBoard
    (``pe/<module>``) and save it as ``position_logits_<module>.png`` in the run directory."""

    def __init__(self, length: int = 64, max_heads: int = 4, save_png: bool = True):
        self.length, self.max_heads, self.save_png = int(length), int(max_heads), save_png

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        import matplotlib.pyplot as plt

        for name, pe in pe_modules(pl_module).items():
            short = name.removeprefix("model.")
            fig = pe_figure(
                pe, self.length, self.max_heads, title=f"{pe.name} ({short}): position-only logits"
            )
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_figure(
                        f"pe/{short}", fig, global_step=trainer.global_step, close=False
                    )
            if self.save_png and trainer.default_root_dir:
                path = Path(trainer.default_root_dir) / f"position_logits_{short}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                fig.savefig(path, dpi=90)
            plt.close(fig)


class NonFiniteLossGuard(Callback):
    """Stop at the first NaN/inf training loss, *before* the bad update, with a clear message.

    The optimiser step that would have corrupted the weights never happens and no checkpoint is
    written afterwards, so the last saved checkpoint is the last good one. All ranks agree on the
    decision (one boolean all-reduce per step under DDP).
    """

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return
        ckpt = trainer.checkpoint_callback
        last = (getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")) if ckpt else ""
        lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups][:1]
        raise TrainingDivergedError(
            f"training loss became {float(loss.detach().float())} at step {trainer.global_step} "
            f"(lr={lrs[0] if lrs else 'n/a':.3g}). Training stopped before the bad update. "
            + (f"Last good checkpoint: {last}. " if last else "No checkpoint was saved yet. ")
            + "Fixes: lower optim.lr or raise schedule.warmup_steps, keep trainer.gradient_clip_val > 0, "
            "or use trainer.precision=32-true / bf16-mixed instead of 16-bit."
        )


class Throughput(Callback):
    """Logs ``train/tokens_per_s``: input tokens (non-padding) per wall-clock second, data loading
    included, measured between consecutive training batches."""

    def __init__(self) -> None:
        self._last: float | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None and isinstance(batch, dict):
            mask = batch.get("attention_mask", batch.get("tgt_mask"))
            ids = batch.get("input_ids", batch.get("tgt_ids"))
            n = int(mask.sum()) if mask is not None else (ids.numel() if ids is not None else 0)
            if "src_mask" in batch:
                n += int(batch["src_mask"].sum())
            pl_module.log(
                "train/tokens_per_s",
                n * trainer.world_size / max(now - self._last, 1e-9),
                on_step=True,
                on_epoch=False,
            )
        self._last = now

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # do not count validation time
