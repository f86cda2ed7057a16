"""Training callbacks: the PE heat maps (start and end of training), the non-finite loss guard,
throughput and the progress bar."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from posformer.devices import module_device, peak_flops
from posformer.errors import PosformerError
from posformer.lit.optim import grad_scaler, unscales_in_step
from posformer.lit.progress import progress_bar as step_progress_bar
from posformer.model.flops import flops_per_token
from posformer.model.positions import arange_positions
from posformer.pe.base import PositionalEncoding
from posformer.pe.probe import position_logits
from posformer.utils.figures import write_figure


class TrainingDivergedError(PosformerError, RuntimeError):
    """The training loss became NaN or infinite."""


def progress_bar(rich: bool = True, refresh_rate: int = 10, metrics_every_s: float = 1.0) -> Callback:
    """The step-based progress bar (:func:`posformer.lit.progress.progress_bar`)."""
    return step_progress_bar(rich=rich, refresh_rate=refresh_rate, metrics_every_s=metrics_every_s)


def pe_modules(model: torch.nn.Module) -> dict[str, PositionalEncoding]:
    """The model's positional encodings by attribute path (``pe``, ``pe_enc``, ``pe_dec``, ...)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, PositionalEncoding)}


#: the attention a model's PE module serves, by its attribute name (titles and logger tags)
ATTENTION_NAMES = {
    "pe": "self-attention",
    "pe_enc": "encoder self-attention",
    "pe_dec": "decoder self-attention",
    "pe_cross": "cross-attention",
}


def logit_label(pe: PositionalEncoding) -> str:
    """What :func:`~posformer.pe.probe.position_logits` draws for this PE, by its
    declared hooks (never its name): a bias is added to the attention logits; a rotary PE changes
    q·k (drawn: the logit of all-ones q and k after rotation); an embedding PE is added to the input
    (drawn: the similarity PE(i)·PE(j)/√D)."""
    hooks = pe.caps.hooks
    if "bias" in hooks:
        return "bias added to the logit q·k/√Dh"
    if "rotary" in hooks:
        return "logit q·k/√Dh of all-ones q, k after rotation"
    if "embed" in hooks:
        return "PE(i)·PE(j)/√D (added to the input)"
    return "no positional term (zero)"


def pe_figure(
    pe: PositionalEncoding,
    length: int,
    max_heads: int = 4,
    title: str = "",
    device: torch.device | None = None,
) -> Any:
    """A matplotlib figure of :func:`~posformer.pe.probe.position_logits` at positions ``0 … length-1``
    (H, T, T): one heat map per head (the first ``max_heads``) on one diverging colour scale centred at
    0 (a signed term: red raises attention, blue lowers it), the colour bar labelled by the PE's hook
    kind (:func:`logit_label`). For a causal PE the upper triangle (keys after the query, which attention
    never looks at) is blank and left out of the colour scale.

    The logits are computed on ``device`` (default: the PE's own, :func:`module_device`; pass the
    model's for a parameter-free PE), then drawn from a CPU copy."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    positions = arange_positions(length, device=device if device is not None else module_device(pe))
    logits = position_logits(pe, positions).detach().double().cpu()  # (H, T, T)
    n_heads = logits.shape[0]
    heads = min(n_heads, max_heads)
    logits = logits[:heads]
    if pe.causal:
        hidden = torch.ones(length, length, dtype=torch.bool, device=logits.device).triu(1)  # (T, T)
        logits = logits.masked_fill(hidden, float("nan"))
    seen = logits[~logits.isnan()]
    lim = float(seen.abs().max()) if seen.numel() else 0.0
    lim = lim if lim > 0 else 1.0
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.85")  # never-looked-at cells: grey
    fig, axes = plt.subplots(1, heads, figsize=(2.7 * heads + 1.0, 3.4), squeeze=False, layout="constrained")
    for h in range(heads):
        ax = axes[0, h]
        im = ax.imshow(logits[h].numpy(), cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(f"head {h + 1} of {n_heads}" if n_heads > 1 else "all heads", fontsize=9)
        ax.set_xlabel("key position")
        if h == 0:
            ax.set_ylabel("query position")
    fig.colorbar(im, ax=list(axes[0]), shrink=0.9, label=logit_label(pe))
    fig.suptitle(title or f"{pe.name}: position-only attention logits", fontsize=10)
    return fig


def figure_array(fig: Any) -> Any:
    """The figure rendered as an (H, W, 3) uint8 array."""
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def log_figure(trainer: L.Trainer, tag: str, fig: Any, step: int) -> None:
    """``fig`` to every logger of ``trainer`` that takes images: the logger's own ``log_image``
    (Weights & Biases, Neptune, ...), else its experiment's ``add_figure`` (TensorBoard) or
    ``log_figure`` (MLflow, as ``<tag>/step<N>.png``); loggers without images (CSV) are skipped."""
    for logger in trainer.loggers:
        if callable(getattr(logger, "log_image", None)):
            logger.log_image(key=tag, images=[figure_array(fig)], step=step)
            continue
        experiment = logger.experiment
        if callable(getattr(experiment, "add_figure", None)):
            experiment.add_figure(tag, fig, global_step=step, close=False)
        elif callable(getattr(experiment, "log_figure", None)) and getattr(logger, "run_id", None):
            experiment.log_figure(logger.run_id, fig, f"{tag}/step{step:07d}.png")


class PEHeatmap(Callback):
    """Each PE's position-only attention logits (:func:`pe_figure`) at the start and at the end of
    training (learned PEs: their initial and their trained values; a PE without parameters is drawn
    once, at the start, titled as unchanged by training).

    Logged with :func:`log_figure` under ``position_logits/<attention>`` (``self-attention``,
    ``encoder self-attention``, ...) at the current step, and saved in the run directory as
    ``position_logits_<module>_{start,end}.{png,svg}``.
    """

    def __init__(self, length: int = 64, max_heads: int = 4, save_png: bool = True):
        self.length, self.max_heads, self.save_png = int(length), int(max_heads), save_png

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer, pl_module, "start")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer, pl_module, "end")

    def draw(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        """Draw, log and save the heat maps of every PE module; ``when``: ``start`` or ``end``."""
        if not trainer.is_global_zero:
            return
        import matplotlib.pyplot as plt

        step = int(trainer.global_step)
        for name, pe in pe_modules(pl_module).items():
            short = name.removeprefix("model.")
            attention = ATTENTION_NAMES.get(short, short)
            fixed = not any(True for _ in pe.parameters())
            if fixed and when == "end":
                continue  # parameter-free: the map at the start is the map at the end
            moment = "parameter-free: the same at every step" if fixed else f"step {step}, {when} of training"
            title = f"{pe.name} PE, {attention}: position-only logits ({moment})"
            with torch.no_grad():
                fig = pe_figure(pe, self.length, self.max_heads, title=title, device=module_device(pl_module))
            log_figure(trainer, f"position_logits/{attention.replace(' ', '_')}", fig, step)
            if self.save_png and trainer.default_root_dir:
                path = Path(trainer.default_root_dir) / f"position_logits_{short}_{when}.png"
                write_figure(fig, path, dpi=110)
            plt.close(fig)


class NonFiniteLossGuard(Callback):
    """Stop at the first NaN/inf training loss, *before* the bad update, with a clear message.

    The optimiser step that would have corrupted the weights never happens and no checkpoint is
    written after it, so the last saved checkpoint is the last good one. With gradient accumulation
    every micro-batch's loss counts. Two ways of doing it, by what the optimiser can do:

    * **On the device** (a fused Adam/AdamW, the CUDA default of
      :func:`~posformer.lit.optim.build_optimizer` or ``optim.fused=true``; several processes take the
      largest flag, an all-reduce on the device): the guard hands the optimiser the step's flag
      ``~isfinite(loss)`` as ``found_inf``, the device tensor with which torch's ``GradScaler`` makes
      a fused kernel skip its update. Under fp16's ``GradScaler``, which owns ``found_inf``, the flag
      reaches it as a NaN in one gradient (:func:`mark_gradients`), before the scaler looks for
      non-finite gradients. Nothing is read on the host in the step: the losses are read together
      every ``trainer.log_every_n_steps`` steps (where the logger reads its metrics anyway), before
      any checkpoint is written, before validation and when training ends. The run stops at that
      read, naming the first bad step; the updates of the bad steps never happened.
    * **On the host** (any other optimiser): the loss is read just before the optimiser step, with the
      backward pass already queued; under DDP every rank takes the decision (one boolean all-reduce).
    """

    def __init__(self) -> None:
        self._loss: torch.Tensor | None = None  # () float32: the first non-finite loss, else the latest
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, flag) unread

    # ------------------------------------------------------------------ every step
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        loss = loss.detach().float().reshape(())
        kept = self._loss
        self._loss = loss if kept is None else torch.where(torch.isfinite(kept), loss, kept)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss, self._loss = self._loss, None
        if loss is None:
            return
        if skips_on_device(trainer, optimizer):
            flag = (~torch.isfinite(loss)).float()  # () 1.0: skip this step's update
            if trainer.world_size > 1:  # the gradients are averaged: every process skips if one must
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # on the device
            if grad_scaler(trainer) is None:
                optimizer.found_inf = flag  # type: ignore[attr-defined]
            else:  # fp16: the scaler sets found_inf from the gradients when it unscales them
                mark_gradients(optimizer, flag)
            self._pending.append((int(trainer.global_step), loss, flag))
            return
        bad = not bool(torch.isfinite(loss))
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            raise self._error(trainer, float(loss), int(trainer.global_step))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for opt in trainer.optimizers:  # the flag is the step's own: never left for a later step
            opt.__dict__.pop("found_inf", None)
        if self._pending and trainer.global_step % max(int(trainer.log_every_n_steps), 1) == 0:
            self.check(trainer)

    # ------------------------------------------------------------------ reads
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.check(trainer)  # raising here writes nothing: no checkpoint after a bad step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: L.Trainer) -> None:
        """Read the steps' losses kept on the device (one host read) and raise at the first bad one."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        read = torch.stack([torch.stack([loss, flag]) for _, loss, flag in pending]).tolist()
        for (step, _, _), (value, flag) in zip(pending, read):
            if flag:  # this process's loss, or (several processes) another's
                shown = str(value) if not math.isfinite(value) else "non-finite in another process"
                raise self._error(trainer, shown, step, skipped=True)

    @staticmethod
    def _error(
        trainer: L.Trainer, value: float | str, step: int, skipped: bool = False
    ) -> TrainingDivergedError:
        ckpt = trainer.checkpoint_callback
        last = (getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")) if ckpt else ""
        lrs = [f"{g['lr']:.3g}" for opt in trainer.optimizers for g in opt.param_groups][:1]
        stopped = (
            f"Training stopped at step {trainer.global_step}; the optimiser skipped the update of every "
            "non-finite step. "
            if skipped
            else "Training stopped before the bad update. "
        )
        return TrainingDivergedError(
            f"training loss became {value} at step {step} (lr={lrs[0] if lrs else 'n/a'}). {stopped}"
            + (f"Last good checkpoint: {last}. " if last else "No checkpoint was saved yet. ")
            + "Fixes: lower optim.lr or raise schedule.warmup_steps, keep trainer.gradient_clip_val > 0, "
            "or use trainer.precision=32-true / bf16-mixed instead of 16-bit."
        )


def skips_on_device(trainer: L.Trainer, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a step's update by a device flag (``found_inf``) with nothing read on
    the host: a fused torch optimiser that takes it (:func:`~posformer.lit.optim.unscales_in_step`).
    Under fp16's gradient scaler its gradients are still scaled in the ``on_before_optimizer_step``
    hooks, so the scaler has not yet looked for non-finite ones: a mark there
    (:func:`mark_gradients`) becomes its ``found_inf``. Several processes agree on the flag by an
    all-reduce on the device (``torch.distributed``)."""
    fused = all(group.get("fused") for group in optimizer.param_groups) and unscales_in_step(optimizer)
    distributed = trainer.world_size == 1 or torch.distributed.is_initialized()
    return fused and distributed


def mark_gradients(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Make one gradient of ``optimizer`` NaN where ``flag`` (a () float, on the device) is 1, and leave
    it as it is where 0: how a step's skip reaches a ``GradScaler``, which owns ``found_inf`` and sets it
    from the gradients (then also halves its scale, as for an overflow)."""
    grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    grad = next(grads, None)
    if grad is None:  # no gradient, nothing to step on
        return
    grad.add_(torch.where(flag > 0, float("nan"), 0.0).to(grad.dtype))  # () broadcast: x + 0 = x


def _input_tokens(batch: dict[str, Any]) -> torch.Tensor | None:
    """Non-padding input tokens of a batch (decoder, or source + target): a 0-d tensor made on the
    batch's device (a Python number, once logged, would be copied there: a host sync per step); None
    without token ids."""
    ids = batch.get("input_ids", batch.get("tgt_ids"))
    if ids is None:
        return None
    mask = batch.get("attention_mask", batch.get("tgt_mask"))  # left out when it hides nothing
    n = mask.sum() if mask is not None else ids.new_full((), ids.numel())
    if "src_mask" in batch:
        n = n + batch["src_mask"].sum()
    return n


def run_flops_per_token(module: L.LightningModule) -> float:
    """Training FLOPs per token of the module's model (:func:`posformer.model.flops.flops_per_token`:
    ``6 N`` for the weight matrices plus ``12 L d T`` for attention, ``T`` the training length; an
    encoder-decoder counts its encoder, decoder and cross-attention layers)."""
    hparams = getattr(module, "hparams", {}) or {}
    cfg = hparams.get("model") or {}
    if cfg.get("kind", "decoder") == "decoder":
        layers = int(cfg.get("n_layers") or 0)
    else:
        layers = int(cfg.get("n_encoder_layers") or 0) + 2 * int(cfg.get("n_decoder_layers") or 0)
    length = (hparams.get("data") or {}).get("train_length") or 0
    length = max(length) if isinstance(length, list | tuple) else int(length)
    model = getattr(module, "model", module)
    return flops_per_token(model, layers, int(cfg.get("d_model") or 0), length)["total"]


class Throughput(Callback):
    """Logs ``train/tokens_per_s``: input tokens (non-padding) per wall-clock second, data loading
    included, measured between consecutive training batches; and ``train/mfu``, the model FLOPs
    utilisation (:func:`run_flops_per_token` × tokens/s over the devices' peak, :func:`peak_flops`: the
    ``POSFORMER_PEAK_FLOPS`` environment variable, else a known GPU's 16-bit peak), when a peak is known."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._flops: float = 0.0  # per token
        self._peak: float | None = None  # FLOP/s of one device

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        root = trainer.strategy.root_device
        self._peak = peak_flops(str(root.type), str(trainer.precision), root.index or 0)
        self._flops = run_flops_per_token(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        n = _input_tokens(batch) if isinstance(batch, dict) else None
        if self._last is not None and n is not None:  # n: read by the logger at its own interval, not here
            pl_module.log(
                "train/tokens_per_s",
                n * trainer.world_size / max(now - self._last, 1e-9),
                on_step=True,
                on_epoch=False,
            )
            if self._peak:  # a device tensor, as tokens/s: no host sync
                mfu = n * self._flops / (max(now - self._last, 1e-9) * self._peak)
                pl_module.log("train/mfu", mfu, on_step=True, on_epoch=False)
        self._last = now

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # do not count validation time
