"""One training run: train a model as a composed config says, then evaluate it at several lengths.

Flow of :func:`run`: validate the config (before anything is written) -> the run dir's
``config.yaml`` -> seed -> datamodule -> module (new, or rebuilt from ``ckpt_path`` with
``train=false``; its PE is the run's only one) -> checks that need the data and the PE's limit ->
``Trainer.fit`` (``ckpt_path`` resumes exactly) -> evaluation at the training length and longer
lengths (:func:`evaluate_lengths`) -> ``results.{json,csv,md}``, TensorBoard hparams and a short
report on stdout (:mod:`posformer.lit.results`).

``posformer-train`` (:mod:`posformer.cli.train`) is the Hydra main around :func:`run`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posformer.errors import is_out_of_memory
from posformer.io import atomic_write_text
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
    kw = OmegaConf.to_container(cfg.trainer, resolve=True)
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


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ the run
def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` says; returns the results dict (also written to the run dir)."""
    from posformer.config import check_data_fit, model_fields, validate_config

    validate_config(cfg)

    import lightning as L
    import torch

    from posformer.data import build_datamodule
    from posformer.io import SafeCheckpointIO, check_writable_dir, safe_load_checkpoint
    from posformer.lit.checkpoint import load_module
    from posformer.lit.modules import module_class

    started = time.perf_counter()
    out_dir = Path(cfg.paths.output_dir)
    check_writable_dir(out_dir)  # before any work: an unwritable run dir fails in a second
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg.torch_threads))
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
        "data": data_info,
        "compile": OmegaConf.to_container(cfg.compile, resolve=True) if cfg.get("compile") else None,
    }
    if not cfg.train and cfg.ckpt_path:
        module = load_module(cls, cfg.ckpt_path, expected_model=fields)  # weights_only; mismatch -> error
    else:
        module = cls(**hp)
    max_positions = module.model.max_positions  # the run's one PE, asked for its limit
    if cfg.train:
        check_data_fit(cfg, dm, max_positions)
    n_params = module.num_parameters()
    log.info("model: %s, pe=%s, %s parameters", kind, fields["pe"], f"{n_params:,}")
    print(f"[posformer] model={kind} pe={fields['pe']} d_model={fields['d_model']} parameters={n_params:,}")

    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    if not loggers:  # nothing to write learning rates to
        from lightning.pytorch.callbacks import LearningRateMonitor

        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    trainer = L.Trainer(
        **trainer_kwargs(cfg), callbacks=callbacks, logger=loggers or False, plugins=[SafeCheckpointIO()]
    )

    if cfg.train:
        # Loaders, not the datamodule: ResumableLoader gives exact mid-epoch resumption and rank sharding.
        from posformer.lit.data import ResumableLoader, ShardedLoader

        trainer.fit(
            module,
            train_dataloaders=ResumableLoader(dm.train_dataloader()),
            val_dataloaders=ShardedLoader(dm.val_dataloader()),
            ckpt_path=cfg.get("ckpt_path"),
        )
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
                accelerator=cfg.trainer.accelerator,
                devices=1,
                precision=cfg.trainer.precision,
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
