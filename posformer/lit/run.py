"""One training run: train a model as a composed config says, then evaluate it at several lengths.

Flow of :func:`run`: validate the config -> lock the run dir and take over SIGTERM/SIGINT
(:mod:`posformer.lit.lifecycle`) -> seed -> datamodule -> module (new, or rebuilt from ``ckpt_path``
with ``train=false``; its PE is the run's only one) -> checks that need the data, the PE's limit and
the resume checkpoint (damaged, another model, already finished) -> the device and precision
(``trainer.accelerator/precision: auto`` resolved by :mod:`posformer.devices`, named on the model line
and in ``results.json``; ``config.yaml`` keeps what was asked) -> every output dir probed
(checkpoints, loggers) -> only then the first write: stale ``*.tmp`` files removed, the run dir's
``config.yaml`` -> ``Trainer.fit`` (``ckpt_path`` resumes exactly; a signal saves a resumable
checkpoint and exits 128 + signum; out of memory names the batch) -> evaluation at the training
length and longer lengths (:func:`evaluate_lengths`) -> ``results.{json,csv,md}``, TensorBoard hparams
and a short report on stdout (:mod:`posformer.lit.results`). A run that fails before ``fit`` leaves
every file of its run dir as it was.

``posformer-train`` (:mod:`posformer.cli.train`) is the Hydra main around :func:`run`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posformer.errors import DataError, Interrupted, ResourceError, is_out_of_memory
from posformer.io import atomic_write_text, check_writable_dir
from posformer.lit.results import EVAL_KEYS, log_hparams, nan_row, report, write_results

log = logging.getLogger("posformer.cli.train")

__all__ = ["evaluate_lengths", "instantiate_group", "run", "trainer_kwargs"]


# ------------------------------------------------------------------------------------------ pieces
def instantiate_group(group: Mapping[str, Any] | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (``null`` entries skipped)."""
    import hydra

    objs = []
    for _, conf in (group or {}).items():
        if conf is not None and "_target_" in conf:
            objs.append(hydra.utils.instantiate(conf))
    return objs


def trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """``lightning.Trainer`` keyword arguments from ``cfg.trainer``, with ``accelerator: auto`` and
    ``precision: auto`` made concrete (:func:`posformer.devices.resolve_trainer`)."""
    from posformer.devices import resolve_trainer

    kw = OmegaConf.to_container(cfg.trainer, resolve=True)
    kw.update(resolve_trainer(kw)._asdict())
    keep_none = ("val_check_interval", "check_val_every_n_epoch")  # None is meaningful for these two
    return {k: v for k, v in kw.items() if v is not None or k in keep_none}


# ------------------------------------------------------------------------------------------ evaluation
def evaluate_lengths(
    trainer: Any, module: Any, dm: Any, lengths: list[int], max_positions: int | None, ckpt_path: str | None
) -> list[dict[str, Any]]:
    """Evaluate ``module`` on one dataloader per length; lengths the PE cannot represent are reported."""
    from posformer.config import batch_width
    from posformer.lit.data import ShardedLoader

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
            res["n_sequences"], res["n_tokens"] = int(res["n_sequences"]), int(res["n_tokens"])
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
                    _free_device_memory()
                    first_line = str(exc_one).strip().splitlines()[0][:160]
                    rows[length] = {
                        **nan_row(length, length <= train_length),
                        "note": f"out of memory ({first_line}); lower data.batch_size / "
                        "model.attention_chunk_mb or evaluate with posformer-eval",
                    }
    return [rows[k] for k in sorted(rows)]


def _fit_to_run(cfg: DictConfig) -> None:
    """Apply :func:`posformer.lit.optim.fit_to_run` to ``cfg`` (in place) and warn once."""
    from posformer.lit.optim import fit_to_run

    changes, message = fit_to_run(cfg.schedule, cfg.trainer)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False)
    if message:
        log.warning(message)


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ lifecycle
def check_output_dirs(callbacks: list[Any], loggers: list[Any]) -> None:
    """Probe every directory the trainer will write to (checkpoints, loggers), creating none."""
    from lightning.pytorch.callbacks import ModelCheckpoint

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


def training_oom(exc: BaseException, cfg: DictConfig, trainer: Any, batch: str) -> ResourceError:
    """The one-line error for running out of memory in ``fit``: the batch, what to lower, what is kept."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    bs = cfg.data.get("batch_size")
    acc = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    ckpt = trainer.checkpoint_callback
    last = (getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")) if ckpt else ""
    smaller = (
        f"lower data.batch_size={bs} (e.g. data.batch_size={max(int(bs) // 2, 1)} "
        f"trainer.accumulate_grad_batches={2 * acc} keeps the effective batch)"
        if isinstance(bs, int)
        else "lower data.batch_size"
    )
    return ResourceError(
        f"out of memory at training step {trainer.global_step} with a batch of {batch} ({first}): {smaller}, "
        "shorten the training sequences or lower model.attention_chunk_mb, or use "
        "trainer.precision=bf16-mixed. "
        + (f"Earlier checkpoints are intact (last: {last})." if last else "No checkpoint had been saved yet.")
    )


# ------------------------------------------------------------------------------------------ the run
def check_batches_per_process(cfg: DictConfig, n_val_batches: int) -> None:
    """Every DDP process validates its own share of the batches: refuse, before spawning, too few."""
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1) or 1
    world = (devices if isinstance(devices, int) and devices > 0 else 1) * int(nodes)
    if 0 < n_val_batches < world:
        raise DataError(
            f"the validation split has {n_val_batches} batch(es) but trainer.devices x num_nodes = {world} "
            f"processes each need at least one: raise data.n_val (e.g. data.n_val={world * 32}), lower "
            "data.batch_size (or data.eval_batch_size), or use fewer devices."
        )


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` says; returns the results dict (also written to the run dir).

    Holds the run dir's lock and the SIGTERM/SIGINT handlers for the whole run
    (:mod:`posformer.lit.lifecycle`).
    """
    from posformer.config import validate_config
    from posformer.lit.lifecycle import Interrupts, RunLock, primary_process

    validate_config(cfg)
    out_dir = Path(cfg.paths.output_dir)
    check_writable_dir(out_dir)  # before any work: an unwritable run dir fails in a second
    with RunLock(out_dir, enabled=primary_process()), Interrupts() as interrupts:
        return _run(cfg, out_dir, interrupts)


def _run(cfg: DictConfig, out_dir: Path, interrupts: Any) -> dict[str, Any]:
    import lightning as L
    import torch

    from posformer.config import check_data_fit, model_fields
    from posformer.cpu import configure_cpu
    from posformer.data import build_datamodule
    from posformer.devices import describe_device, device_name, resolve_trainer
    from posformer.io import SafeCheckpointIO, remove_stale_tmp, safe_load_checkpoint
    from posformer.lit.checkpoint import check_checkpoint_matches, load_module
    from posformer.lit.lifecycle import (
        SignalCheckpoint,
        check_resumable,
        primary_process,
        resume_command,
        signal_name,
    )
    from posformer.lit.modules import module_class
    from posformer.model.backends.flex import reset_compiled

    started = time.perf_counter()
    _fit_to_run(cfg)  # a warm-up or validation interval longer than the run: clamped, one warning line
    configure_cpu(cfg.get("torch_threads") or None, cfg.get("flush_denormal", True))
    reset_compiled()  # the jobs of a multirun share one process: each compiles (and counts) its own graphs
    L.seed_everything(int(cfg.seed), workers=True)
    if cfg.trainer.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)

    kind = cfg.model.kind
    dm = build_datamodule(cfg.data, kind, int(cfg.seed))
    dm.prepare_data()
    dm.setup("fit")
    facts = {"vocab_size": int(dm.vocab_size), "pad_id": int(getattr(dm, "pad_id", 0))}
    if getattr(dm, "src_vocab_size", None):
        facts["src_vocab_size"] = int(dm.src_vocab_size)
    fields = model_fields(cfg.model, **facts)

    cls = module_class(kind)
    summary = dm.config_summary() if hasattr(dm, "config_summary") else {}
    data_info = {
        "task_type": getattr(dm, "task_type", "task"),
        "train_length": getattr(dm, "train_length", None),
        **{k: v for k, v in summary.items() if isinstance(v, int | float | str | bool | list)},
    }
    hp = {
        "model": fields,
        "optim": OmegaConf.to_container(cfg.optim, resolve=True),
        "schedule": OmegaConf.to_container(cfg.schedule, resolve=True),
        "loss": OmegaConf.to_container(cfg.loss, resolve=True),
        "positions": OmegaConf.to_container(cfg.positions, resolve=True),
        "max_steps": int(cfg.trainer.max_steps),
        # + the data config and run seed: posformer-eval rebuilds the data from the checkpoint alone
        "data": {
            **data_info, "config": OmegaConf.to_container(cfg.data, resolve=True), "seed": int(cfg.seed)
        },
        "compile": OmegaConf.to_container(cfg.compile, resolve=True) if cfg.get("compile") else None,
    }
    if not cfg.train and cfg.ckpt_path:
        module = load_module(cls, cfg.ckpt_path, expected_model=fields)  # weights_only; mismatch -> error
    else:
        module = cls(**hp)
    max_positions = module.model.max_positions  # the run's one PE, asked for its limit
    if cfg.train:
        check_data_fit(cfg, dm, max_positions)
        check_batches_per_process(cfg, len(dm.val_dataloader()))
    resume = cfg.get("ckpt_path") if cfg.train else None
    if resume:  # damaged, unsafe, another model, already finished: refused before anything is written
        ckpt = safe_load_checkpoint(resume, mmap=True)
        check_checkpoint_matches(ckpt, fields, path=resume)
        check_resumable(ckpt, str(resume), int(cfg.trainer.max_steps), out_dir)
        del ckpt
    n_params = module.num_parameters()
    device = resolve_trainer(cfg.trainer)  # auto -> cuda / cpu and bf16-mixed / 16-mixed / 32-true
    log.info(
        "model: %s, pe=%s, d_model=%s, %s parameters, seed %s, %s", kind, fields["pe"], fields["d_model"],
        f"{n_params:,}", cfg.seed, describe_device(device, cfg.trainer.get("devices", 1)),
    )

    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    if not loggers:  # nothing to write learning rates to
        from lightning.pytorch.callbacks import LearningRateMonitor

        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    check_output_dirs(callbacks, loggers)

    # the first write into the run dir: every check above has passed
    if primary_process():
        for stale in remove_stale_tmp(out_dir):
            log.info("removed %s (left by a write that was killed half-way)", stale)
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if hasattr(dm, "save_tokenizer"):  # <run_dir>/tokenizer/: the run is reusable without the data cache
        dm.save_tokenizer(out_dir)
    interrupts.describe = lambda s: (
        f"interrupted by {signal_name(s)} before the first training step; nothing was trained. "
        "Re-run the same command."
    )
    on_signal = SignalCheckpoint(interrupts, functools.partial(resume_command, out_dir), out_dir)
    trainer = L.Trainer(
        **trainer_kwargs(cfg),
        callbacks=[*callbacks, on_signal],
        logger=loggers or False,
        plugins=[SafeCheckpointIO()],
    )

    if cfg.train:
        # Loaders, not the datamodule: ResumableLoader gives exact mid-epoch resumption and rank sharding.
        from posformer.lit.data import ResumableLoader, ShardedLoader

        try:
            trainer.fit(
                module,
                train_dataloaders=ResumableLoader(dm.train_dataloader()),
                val_dataloaders=ShardedLoader(dm.val_dataloader()),
                ckpt_path=cfg.get("ckpt_path"),
            )
        except Exception as exc:
            if is_out_of_memory(exc):
                raise training_oom(exc, cfg, trainer, on_signal.last_batch) from None
            raise
        finally:
            interrupts.deferring = False
    train_time = time.perf_counter() - started
    # final training/validation metrics, read before evaluation replaces the trainer's metrics
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    val = {k: v for k, v in metrics.items() if k.startswith("val/")}
    train = {k: v for k, v in metrics.items() if k.startswith("train/")}

    ckpt_cb = trainer.checkpoint_callback
    best = getattr(ckpt_cb, "best_model_path", "") or ""
    last = getattr(ckpt_cb, "last_model_path", "") or ""
    global_step = int(trainer.global_step)
    if global_step == 0 and cfg.train and (last or best):  # ddp_spawn: the loop ran in the workers
        global_step = int(safe_load_checkpoint(last or best, verify=False, mmap=True).get("global_step", 0))
    eval_ckpt = best if (cfg.get("eval_ckpt", "best") == "best" and best and cfg.train) else None
    final = last or best or str(cfg.get("ckpt_path") or "")
    if interrupts.signum is not None:  # arrived during the last step's validation or as fit ended
        raise Interrupted(
            interrupts.signum,
            f"interrupted by {signal_name(interrupts.signum)} as training ended (step {global_step}); "
            f"training is complete, checkpoint {final}; evaluate it with: "
            f"{resume_command(out_dir, final, train=False)}",
        )
    interrupts.describe = lambda s: (
        f"interrupted by {signal_name(s)} during the final evaluation (training finished at step "
        f"{global_step}); no results were written; evaluate the checkpoint with: "
        f"{resume_command(out_dir, final, train=False) if final else 'posformer-eval'}"
    )
    if cfg.evaluate and cfg.train and cfg.get("eval_ckpt", "best") == "best" and not best:
        log.warning("no best checkpoint (the run never validated): evaluating the final weights")

    rows: list[dict[str, Any]] = []
    # plain `ddp` re-executes this script per rank: only global rank 0 evaluates and writes results
    worker = torch.distributed.is_available() and torch.distributed.is_initialized()
    if cfg.evaluate and not (worker and torch.distributed.get_rank() != 0):
        lengths = sorted(
            set(getattr(dm, "eval_lengths", []) or []) | {int(getattr(dm, "train_length", 0))} - {0}
        )
        eval_trainer = trainer
        if trainer.world_size > 1:  # evaluate in this (the launching) process on one device: exact, simple
            eval_trainer = L.Trainer(
                accelerator=device.accelerator,
                devices=1,
                precision=device.precision,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                default_root_dir=str(out_dir),
            )
        rows = evaluate_lengths(eval_trainer, module, dm, lengths, max_positions, eval_ckpt)

    results = {
        "task_name": cfg.task_name,
        "pe": fields["pe"],
        "model_kind": kind,
        "seed": int(cfg.seed),
        "parameters": n_params,
        "global_step": global_step,
        "train_length": data_info.get("train_length"),
        "data": data_info,
        "world_size": int(trainer.world_size),
        # what trainer.accelerator / trainer.precision resolved to (config.yaml keeps what was asked)
        "accelerator": device.accelerator,
        "precision": device.precision,
        "device": device_name(device, cfg.trainer.get("devices", 1)),
        "train": train,
        "val": val,
        "results": rows,
        "checkpoint": {"best": best, "last": last, "evaluated": eval_ckpt or "final weights"},
        "output_dir": str(out_dir),
        "wall_time_s": round(time.perf_counter() - started, 2),
        "train_time_s": round(train_time, 2),
    }
    if trainer.is_global_zero:
        write_results(out_dir, results)
        log_hparams(trainer, cfg, rows, results)
        report(trainer, results, rows, out_dir)
    return results
