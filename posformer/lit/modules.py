"""LightningModules: :class:`LanguageModelModule` (decoder-only) and :class:`Seq2SeqModule`
(encoder-decoder).

Both are built from plain dicts (``ModelConfig`` fields, optimiser, schedule, loss and position
settings) saved with ``save_hyperparameters``, so ``Module.load_from_checkpoint(path)`` rebuilds the
model without Hydra. Evaluation is exact: :meth:`PosformerModule.evaluate_batch` returns *sums*
(loss, tokens, correct tokens, sequences, exact sequences) that callers add up over batches, ranks
and lengths before dividing.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import Tensor

from posformer.checkpoints import check_checkpoint_matches, compile_options
from posformer.errors import ConfigError
from posformer.lit.context_parallel import (
    context_mesh,
    sequence_loss,
    shared_positions,
    split_accuracy,
    split_batch,
    split_stats,
)
from posformer.lit.data import ResumableLoader
from posformer.lit.optim import build_optimizer, build_schedule, grad_scaler, unscales_in_step
from posformer.metrics import REGISTRY, SUMS, names, reduce, sequence_stats, table_metrics
from posformer.model import ModelConfig, build_model
from posformer.model.parallel import ContextParallel
from posformer.model.positions import float_positions, pose_positions, randomized_positions

#: the metrics of a validation, logged as ``val/<name>``: the language-model table's first
VAL_METRICS = tuple(dict.fromkeys([*table_metrics("lm"), *names()]))
#: the padding masks a batch leaves out when they hide nothing (the model's queries; ``src_mask`` stays:
#: cross-attention takes it as it is)
DROPPABLE_MASKS = ("attention_mask", "tgt_mask")


def without_full_masks(batch: Any) -> Any:
    """``batch`` without the masks of :data:`DROPPABLE_MASKS` that are all True (no padding): the model
    then keeps its fused causal path. The masks are read here, on the host, before the batch moves to
    the device (:meth:`PosformerModule.on_before_batch_transfer`); on a GPU the same read in the step
    would be a host sync per batch. Anything but a mapping is returned as it is."""
    if not isinstance(batch, Mapping):
        return batch
    full = [k for k in DROPPABLE_MASKS if isinstance(batch.get(k), Tensor) and bool(batch[k].all())]
    return {k: v for k, v in batch.items() if k not in full} if full else batch


def collect_rng_states() -> dict[str, Any]:
    """Global torch/CUDA/numpy/python RNG states in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Inverse of :func:`collect_rng_states`."""
    torch.set_rng_state(states["torch"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    state = states["python"]
    random.setstate((state[0], tuple(state[1]), state[2]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class PosformerModule(L.LightningModule):
    """Shared training/evaluation logic. Subclasses implement :meth:`logits`.

    Args:
        model: ``ModelConfig`` fields (``vocab_size`` and ``pad_id`` filled in from the data).
        optim: optimiser settings (``name``, ``lr``, ``betas``, ``eps``, ``weight_decay``, ``no_decay``).
        schedule: learning-rate schedule (``name``, ``warmup_steps``, ``multiplier``, ``min_lr_ratio``,
            ``total_steps``).
        loss: ``label_smoothing``.
        positions: ``randomized`` and ``n_max`` (randomized positions in training steps only); ``sampler``
            (``pose`` with ``pose_chunks``, ``float``) draws them instead.
        max_steps: training length, for schedules that decay over the run.
        data: facts about the data (``task_type``, ...) kept for evaluation tools.
        compile: ``torch.compile`` settings (:func:`posformer.checkpoints.compile_options`); off when missing.
        variant: the name of the run's variant (``+variant=prope``), its label everywhere; ``None``: no
            variant (then not a hyper-parameter at all).

    ``context_parallel`` (set by the run, not a hyper-parameter: a checkpoint loads in any layout): the
    processes that split each sequence; above 1, ``setup`` builds the ``data x context`` mesh
    (:mod:`posformer.lit.context_parallel`) and the training and validation steps run on this rank's
    slice of every row.
    """

    kind: str = ""

    def __init__(
        self,
        model: Mapping[str, Any],
        optim: Mapping[str, Any] | None = None,
        schedule: Mapping[str, Any] | None = None,
        loss: Mapping[str, Any] | None = None,
        positions: Mapping[str, Any] | None = None,
        max_steps: int = -1,
        data: Mapping[str, Any] | None = None,
        compile: Mapping[str, Any] | None = None,  # noqa: A002 (the config key)
        variant: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(logger=False)
        if variant is None:  # no variant: the hyper-parameters (and checkpoints) as before variants existed
            self.hparams.pop("variant", None)
        cfg = ModelConfig(**dict(model))
        if cfg.kind != self.kind:
            raise ConfigError(
                f"{type(self).__name__} needs model.kind={self.kind!r}, got {cfg.kind!r}; use "
                f"{module_class(cfg.kind).__name__} (posformer.lit.module_class(kind))."
            )
        self.model_config = cfg
        self.model = build_model(cfg)
        self.compile_cfg = compile_options(compile)
        if self.compile_cfg is not None:
            # Module.compile keeps the parameter names (checkpoints stay loadable without compile);
            # every training/evaluation forward goes through model(...), so all of it is compiled.
            self.model.compile(**self.compile_cfg)
        self.optim_cfg = dict(optim or {"name": "adamw", "lr": 1e-3})
        self.schedule_cfg = dict(schedule or {"name": "constant", "warmup_steps": 0})
        self.label_smoothing = float((loss or {}).get("label_smoothing", 0.0))
        pos = dict(positions or {})
        self.sampler = str(pos.get("sampler", "none") or "none")
        self.pose_chunks = int(pos.get("pose_chunks", 2) or 2)
        #: training steps draw their positions (randomized integers or the sampler's)
        self.randomized = bool(pos.get("randomized", False)) or self.sampler != "none"
        self.n_max = int(pos.get("n_max", 0) or 0)
        self.max_steps = int(max_steps)
        self.test_lengths: list[int] | None = None
        self.test_results: dict[int, dict[str, float]] = {}
        self._stats: dict[str, dict[int, Tensor]] = {"val": {}, "test": {}}
        self._rng_to_restore: dict[str, Any] | None = None
        self.context_parallel = 1
        self._cp: ContextParallel | None = None

    # ------------------------------------------------------------------ model calls
    def setup(self, stage: str) -> None:
        """The context-parallel group of this process when the run splits sequences across several of
        its processes (``None`` otherwise, e.g. in a one-device evaluation of the same module)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        self._cp = None
        if self.context_parallel > 1 and world > 1:
            self._cp = context_mesh(self.context_parallel, self.trainer.strategy.root_device.type)[1]

    @property
    def context_group(self) -> ContextParallel | None:
        """The processes this one splits each sequence with (``None``: it holds whole sequences)."""
        return self._cp

    def logits(
        self, batch: Mapping[str, Tensor], randomize: bool = False, parallel: ContextParallel | None = None
    ) -> Tensor:
        """Logits (B, T, V) for a batch; ``randomize``: randomized positions (training only);
        ``parallel``: the batch is this rank's slice (B, T/P) of rows split across the group, and so
        are the logits (B, T/P, V)."""
        raise NotImplementedError

    def _random_positions(
        self, batch: int, length: int, device: torch.device, parallel: ContextParallel | None = None
    ) -> Tensor:
        if parallel is not None:  # the whole rows' positions, the same on every rank of the group
            return shared_positions(batch, length * parallel.size, self.n_max, parallel, device, self._draw)
        return self._draw(batch, length, self.n_max, device=device)

    def _draw(self, batch: int, length: int, n_max: int, *, device: torch.device) -> Tensor:
        """Training positions (B, T): ``positions.sampler``'s, else randomized integers (Ruoss et al.)."""
        if self.sampler == "pose":
            return pose_positions(batch, length, n_max, self.pose_chunks, device=device)
        if self.sampler == "float":
            return float_positions(batch, length, n_max, device=device)
        return randomized_positions(batch, length, n_max, device=device)

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        return self.logits(batch)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Every loop's batch, still on the host: masks that hide nothing are left out
        (:func:`without_full_masks`), so no step reads a mask on the device."""
        return without_full_masks(batch)

    # ------------------------------------------------------------------ metrics
    @torch.no_grad()
    def evaluate_batch(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Summed statistics of one batch with ordinary positions and teacher forcing.

        Returns 0-d float64 tensors: ``loss_sum`` (cross-entropy summed over scored tokens, no label
        smoothing), ``n_tokens``, ``n_correct_tokens`` (argmax == label), ``n_sequences`` (rows with at
        least one scored token) and ``n_exact`` (rows whose scored tokens are all correct).
        """
        if self._cp is not None:  # rows split across the context group: counted once per row
            part = split_batch(batch, self._cp)
            return split_stats(self.logits(part, parallel=self._cp), part["labels"], self._cp)
        logits = self.logits(batch)
        return sequence_stats(logits, batch["labels"])

    def _accumulate(self, stage: str, idx: int, stats: Mapping[str, Tensor]) -> None:
        vec = torch.stack([stats[k] for k in SUMS])
        store = self._stats[stage]
        store[idx] = store[idx] + vec if idx in store else vec

    def _reduced(self, stage: str) -> dict[int, dict[str, float]]:
        out = {}
        for idx in sorted(self._stats[stage]):
            vec = self._stats[stage][idx]
            if self.trainer is not None and self.trainer.world_size > 1:
                vec = self.trainer.strategy.reduce(vec.clone(), reduce_op="sum")
            out[idx] = reduce(dict(zip(SUMS, vec.tolist())))
        self._stats[stage] = {}
        return out

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        if self._cp is not None:
            return self._split_training_step(batch, self._cp)
        logits = self.logits(batch, randomize=self.randomized)
        labels = batch["labels"]
        loss = F.cross_entropy(
            logits.float().flatten(0, 1),
            labels.flatten(),
            ignore_index=-100,
            label_smoothing=self.label_smoothing,
        )
        scored = labels != -100
        acc = ((logits.detach().argmax(-1) == labels) & scored).sum() / scored.sum().clamp(min=1)
        bs = labels.shape[0]
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=bs)
        self.log("train/token_acc", acc, batch_size=bs)
        return loss

    def _split_training_step(self, batch: Mapping[str, Tensor], cp: ContextParallel) -> Tensor:
        """The step on this rank's slice of every row: the loss over the whole rows, scaled for the
        data-parallel mean (:func:`~posformer.lit.context_parallel.sequence_loss`); logs what the unsplit
        step logs (the whole rows' loss and accuracy, the same on every rank of the group)."""
        part = split_batch(batch, cp)
        logits = self.logits(part, randomize=self.randomized, parallel=cp)  # (B, T/P, V)
        labels = part["labels"]
        loss, whole = sequence_loss(logits, labels, cp, label_smoothing=self.label_smoothing)
        bs = labels.shape[0]
        self.log("train/loss", whole, prog_bar=True, batch_size=bs)
        self.log("train/token_acc", split_accuracy(logits.detach(), labels, cp), batch_size=bs)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        scaler = grad_scaler(self._trainer)
        if scaler is not None and unscales_in_step(optimizer):
            # fp16 with a fused optimiser: Lightning leaves the gradients scaled for the optimiser to
            # unscale in its step; unscale them now (after every callback's hook, the NaN guard's mark
            # included) so that the norm below and the clipping see true gradients, as with any other
            # optimiser. The scaler's step then passes no scale and keeps the skip flag (torch's recipe
            # "unscale_, clip, step"); nothing is read on the host.
            scaler.unscale_(optimizer)
        every = max(int(self.trainer.log_every_n_steps), 1) if self.trainer is not None else 1
        if self.global_step % every:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            self.log("train/grad_norm", norm)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, with two cases its plugins refuse:

        * FSDP, by norm: the norm over every process's shards, by the root FSDP module's own
          ``clip_grad_norm_`` (Lightning's FSDP plugin refuses norm clipping: it has no reference to it);
        * fp16 with a fused optimiser, whose gradients :meth:`on_before_optimizer_step` has unscaled:
          the same clipping without Lightning's AMP plugin, which refuses every optimiser that unscales
          in its step (it cannot know they are unscaled).
        """
        val = gradient_clip_val or 0.0
        how = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        sharded = getattr(self.trainer.model, "clip_grad_norm_", None)  # FSDP's root module has one
        if val > 0 and how == GradClipAlgorithmType.NORM and callable(sharded):
            sharded(val)
        elif grad_scaler(self.trainer) is not None and unscales_in_step(optimizer):
            Precision.clip_gradients(self.trainer.precision_plugin, optimizer, val, how)  # by norm or value
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def apply_switches(self, step: int) -> None:
        """The layer kinds' PE switches due at training step ``step`` (:mod:`posformer.model.schedule`)."""
        self.model.apply_switches(step, self.max_steps if self.max_steps > 0 else None)

    def on_validation_start(self) -> None:
        if self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:  # after step s: its PEs
            self.apply_switches(self.global_step)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.apply_switches(self.global_step)
        loader = self.trainer.train_dataloader if self._trainer is not None else None
        if isinstance(loader, ResumableLoader):
            loader.consumed = batch_idx + 1
        if self._rng_to_restore is not None:  # resumed: continue the RNG stream of the original run
            set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["posformer_rng"] = collect_rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint_matches(checkpoint, self.hparams["model"])  # a different PE/size/vocab: clear error
        self._rng_to_restore = checkpoint.get("posformer_rng")
        self.apply_switches(int(checkpoint.get("global_step", 0)))  # before the weights: their PEs

    # ------------------------------------------------------------------ validation / test
    # Statistics start empty at every epoch: an epoch cut short (an error, an interrupt) leaves nothing
    # behind that the next one would count twice.
    def on_validation_epoch_start(self) -> None:
        self._stats["val"] = {}

    def on_test_epoch_start(self) -> None:
        self._stats["test"] = {}

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._accumulate("val", dataloader_idx, self.evaluate_batch(batch))

    def on_validation_epoch_end(self) -> None:
        for idx, res in self._reduced("val").items():
            prefix = "val" if idx == 0 else f"val_{idx}"
            for key in VAL_METRICS:
                self.log(f"{prefix}/{key}", res[key], prog_bar=REGISTRY[key].progress, sync_dist=False)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._accumulate("test", dataloader_idx, self.evaluate_batch(batch))

    def on_test_epoch_end(self) -> None:
        lengths = self.test_lengths
        results = {}
        for idx, res in self._reduced("test").items():
            length = lengths[idx] if lengths is not None else idx
            results[int(length)] = res
            for key in (*VAL_METRICS, *names(kinds=("count",))):
                self.log(f"eval/len_{length}/{key}", float(res[key]), add_dataloader_idx=False)
        self.test_results = results

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = build_optimizer(self.model, self.optim_cfg, self.schedule_cfg)
        max_steps = self.max_steps
        if max_steps <= 0 and self.trainer is not None:
            max_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = build_schedule(
            optimizer, self.schedule_cfg, d_model=self.model_config.d_model, max_steps=max(max_steps, 1)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    def num_parameters(self) -> int:
        return self.model.num_parameters()


class LanguageModelModule(PosformerModule):
    """Decoder-only model: language modelling and decoder-only tasks.

    Batches: ``input_ids`` (B, T), ``labels`` (B, T) (already shifted, -100 = not scored),
    ``attention_mask`` (B, T) bool (True = real token); packed rows (``data.pack=true``) also carry
    ``segment_ids`` (B, T), passed to the model (block-diagonal attention, positions per document).
    """

    kind = "decoder"

    def logits(
        self, batch: Mapping[str, Tensor], randomize: bool = False, parallel: ContextParallel | None = None
    ) -> Tensor:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")  # None without padding (on_before_batch_transfer)
        pos = self._random_positions(*ids.shape, ids.device, parallel) if randomize else None
        split = {} if parallel is None else {"parallel": parallel}
        segments = batch.get("segment_ids")
        if segments is not None:  # packed documents
            return self.model(ids, positions=pos, attention_mask=mask, segment_ids=segments, **split)
        return self.model(ids, positions=pos, attention_mask=mask, **split)


class Seq2SeqModule(PosformerModule):
    """Encoder-decoder model: sequence-to-sequence tasks and translation.

    Batches: ``src_ids`` (B, S), ``src_mask`` (B, S), ``tgt_ids`` (B, T) (BOS first), ``tgt_mask``
    (B, T), ``labels`` (B, T) (-100 = not scored).
    """

    kind = "encoder_decoder"

    def logits(
        self, batch: Mapping[str, Tensor], randomize: bool = False, parallel: ContextParallel | None = None
    ) -> Tensor:
        if parallel is not None:
            raise ConfigError(
                "trainer.context_parallel > 1 splits decoder-only models only (not supported yet)"
            )
        src, tgt = batch["src_ids"], batch["tgt_ids"]
        src_mask, tgt_mask = batch.get("src_mask"), batch.get("tgt_mask")  # tgt_mask: see attention_mask
        src_pos = tgt_pos = None
        if randomize:
            src_pos = self._random_positions(src.shape[0], src.shape[1], src.device)
            tgt_pos = self._random_positions(tgt.shape[0], tgt.shape[1], tgt.device)
        return self.model(src, tgt, src_mask, tgt_mask, src_pos=src_pos, tgt_pos=tgt_pos)  # (B, T, V)


def module_class(kind: str) -> type[PosformerModule]:
    """The LightningModule class for a ``model.kind``."""
    classes = {"decoder": LanguageModelModule, "encoder_decoder": Seq2SeqModule}
    if kind not in classes:
        raise ConfigError(f"model.kind={kind!r} is unknown; valid: {', '.join(classes)}.")
    return classes[kind]
