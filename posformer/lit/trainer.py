"""The Lightning side of a training run: the Trainer's arguments, callbacks and loggers, the probes of
their output dirs, the messages for too few batches and for running out of memory, and the final
evaluation at several lengths through ``Trainer.test``. The flow that uses them is
:mod:`posformer.training`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
from collections.abc import Mapping
from typing import Any

import hydra
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from posformer.configs.schema import OWN_TRAINER_KEYS, TrainConfig
from posformer.data import batch_width
from posformer.devices import resolve_trainer
from posformer.errors import DataError, ResourceError, is_out_of_memory
from posformer.io import check_writable_dir
from posformer.lit.data import ShardedLoader
from posformer.lit.optim import fit_to_run
from posformer.lit.results import COUNTS, EVAL_KEYS, nan_row
from posformer.model.size import oom_cause

log = logging.getLogger("posformer.cli.train")

__all__ = [
    "check_batches_per_process",
    "check_output_dirs",
    "evaluate_lengths",
    "fit_schedule_to_run",
    "free_device_memory",
    "instantiate_group",
    "process_count",
    "trainer_kwargs",
    "training_oom",
]


def instantiate_group(group: Mapping[str, Any] | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (``null`` entries skipped)."""
    objs = []
    for _, conf in (group or {}).items():
        if conf is not None and "_target_" in conf:
            objs.append(hydra.utils.instantiate(conf))
    return objs


def trainer_kwargs(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """``lightning.Trainer`` keyword arguments from the ``trainer`` settings (posformer's own keys,
    ``context_parallel``, left out), with ``accelerator: auto`` and ``precision: auto`` made concrete
    (:func:`posformer.devices.resolve_trainer`)."""
    kw = {k: v for k, v in trainer.items() if k not in OWN_TRAINER_KEYS}  # posformer's keys stay here
    kw.update(resolve_trainer(trainer)._asdict())
    keep_none = ("val_check_interval", "check_val_every_n_epoch")  # None is meaningful for these two
    return {k: v for k, v in kw.items() if v is not None or k in keep_none}


# ------------------------------------------------------------------------------------------ evaluation
def evaluate_lengths(
    trainer: Any, module: Any, dm: Any, lengths: list[int], max_positions: int | None, ckpt_path: str | None
) -> list[dict[str, Any]]:
    """Evaluate ``module`` on one dataloader per length; lengths the PE cannot represent are reported."""
    loaders = dm.eval_dataloaders(lengths)
    train_length = int(getattr(dm, "train_length", max(lengths)))
    keep, rows = {}, {}
    for length, loader in loaders.items():
        if max_positions is not None:
            width = batch_width(next(iter(loader)))
            if width > max_positions:
                rows[length] = {
                    **nan_row(length, length <= train_length),
                    "note": f"skipped: needs {width} positions, PE has {max_positions}",
                }
                continue
        keep[length] = loader

    def test(lengths: list[int]) -> None:
        module.test_lengths = lengths
        trainer.test(
            module, dataloaders=[ShardedLoader(keep[n]) for n in lengths], ckpt_path=ckpt_path, verbose=False
        )
        # from the logged metrics: under ddp_spawn the module's own attributes stay in the workers
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        for length in lengths:
            res = {key: metrics.get(f"eval/len_{length}/{key}", float("nan")) for key in EVAL_KEYS}
            res.update({key: int(res[key]) for key in COUNTS})
            rows[length] = {"length": length, "in_distribution": length <= train_length, **res, "note": ""}

    if keep:
        try:
            test(list(keep))
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # one length at a time: the ones that fit are reported, the others say why they are missing
            log.warning("out of memory in the final evaluation; evaluating one length at a time")
            for length in keep:
                try:
                    test([length])
                except Exception as exc_one:
                    if not is_out_of_memory(exc_one):
                        raise
                    free_device_memory()
                    first_line = str(exc_one).strip().splitlines()[0][:160]
                    rows[length] = {
                        **nan_row(length, length <= train_length),
                        "note": f"out of memory ({first_line}); lower data.batch_size / "
                        "model.attention_chunk_mb or evaluate with posformer-eval",
                    }
    return [rows[k] for k in sorted(rows)]


def fit_schedule_to_run(s: TrainConfig) -> TrainConfig:
    """The settings with :func:`posformer.lit.optim.fit_to_run`'s changes; warns once."""
    changes, message = fit_to_run(dataclasses.asdict(s.schedule), s.trainer)
    if message:
        log.warning(message)
    schedule = {k.partition(".")[2]: v for k, v in changes.items() if k.startswith("schedule.")}
    trainer = {k.partition(".")[2]: v for k, v in changes.items() if k.startswith("trainer.")}
    return dataclasses.replace(
        s, schedule=dataclasses.replace(s.schedule, **schedule), trainer={**s.trainer, **trainer}
    )


def free_device_memory() -> None:
    """Collect garbage and return cached CUDA memory (after an out-of-memory error)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ lifecycle
def check_output_dirs(callbacks: list[Any], loggers: list[Any]) -> None:
    """Probe every directory the trainer will write to (checkpoints, loggers), creating none."""
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            check_writable_dir(
                cb.dirpath,
                "checkpoint directory",
                create=False,
                fix="callbacks.model_checkpoint.dirpath=/writable/dir (or hydra.run.dir=outputs/my_run)",
            )
    for lg in loggers:
        save_dir = getattr(lg, "save_dir", None) or getattr(lg, "root_dir", None)
        if save_dir:
            check_writable_dir(
                save_dir,
                f"{type(lg).__name__} directory",
                create=False,
                fix="logger=none, or a writable logger save_dir / hydra.run.dir=outputs/my_run",
            )


def training_oom(exc: BaseException, s: TrainConfig, trainer: Any, batch: str) -> ResourceError:
    """The one-line error for running out of memory in ``fit``: the batch, what to lower, what is kept."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    bs = getattr(s.data, "batch_size", None)
    acc = int(s.trainer.get("accumulate_grad_batches") or 1)
    ckpt = trainer.checkpoint_callback
    last = (getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")) if ckpt else ""
    smaller = (
        f"lower data.batch_size={bs} (e.g. data.batch_size={max(int(bs) // 2, 1)} "
        f"trainer.accumulate_grad_batches={2 * acc} keeps the effective batch)"
        if isinstance(bs, int)
        else "lower data.batch_size"
    )
    kept = f"Earlier checkpoints are intact (last: {last})." if last else "No checkpoint had been saved yet."
    shapes = [(int(b), int(t)) for b, t in re.findall(r"(\d+)x(\d+)", batch)]
    cfg = getattr(getattr(trainer, "lightning_module", None), "model_config", None)
    if shapes and cfg is not None:
        model_is_the_cause, words = oom_cause(cfg, shapes[0][0], max(t for _, t in shapes))
        if model_is_the_cause:
            return ResourceError(
                f"out of memory at training step {trainer.global_step} with a batch of {batch} ({first}); "
                f"{words}. {kept}"
            )
        smaller = f"{words}: {smaller}"
    return ResourceError(
        f"out of memory at training step {trainer.global_step} with a batch of {batch} ({first}): {smaller}, "
        "shorten the training sequences or lower model.attention_chunk_mb, or use "
        f"trainer.precision=bf16-mixed. {kept}"
    )


def check_batches_per_process(trainer: Mapping[str, Any], n_val_batches: int) -> None:
    """Every DDP process validates its own share of the batches (the ``trainer.context_parallel``
    processes of one sequence share theirs): refuse, before spawning, too few."""
    world = max((process_count(trainer) or 1) // int(trainer.get("context_parallel") or 1), 1)  # data ranks
    if 0 < n_val_batches < world:
        raise DataError(
            f"the validation split has {n_val_batches} batch(es) but {world} data-parallel processes "
            f"(trainer.devices x num_nodes / context_parallel) each need at least one: raise data.n_val "
            f"(e.g. data.n_val={world * 32}), lower "
            "data.batch_size (or data.eval_batch_size), or use fewer devices."
        )


def process_count(trainer: Mapping[str, Any]) -> int | None:
    """The processes of a run, ``trainer.devices x num_nodes``; ``None`` when ``devices`` is ``auto``,
    ``-1`` or a list the launch resolves."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1) or 1
    if isinstance(devices, list):
        return len(devices) * int(nodes)
    return devices * int(nodes) if isinstance(devices, int) and devices > 0 else None
