"""One training run, as ``posformer-train`` does it: the flow in one screen (:func:`run`).

    run(cfg)                            read the config once into settings (every problem at once,
                                        nothing written yet), lock the run dir, take over SIGTERM/SIGINT:
      s = setup_process(s)              schedule clamped to the run, CPU threads, compile caches, seed
      prepared = prepare(s, out_dir)    data, module (new, or a checkpoint's with train=false), every
                                        check that needs them, the device, callbacks and loggers
      trainer = start(...)              the first write (config.yaml, tokenizer), then the Trainer
      fitted = fit(...)                 Trainer.fit: exact resume from ckpt_path; a signal saves a
                                        resumable checkpoint; out of memory names the batch to lower
      rows = evaluate(...)              the training length and longer ones, by Trainer.test
      return finish(...)                results.{json,csv,md}, TensorBoard hparams, the report

A run that fails before :func:`start` leaves every file of its run dir as it was. The Lightning
pieces (Trainer arguments, output-dir probes, the final evaluation) are in :mod:`posformer.lit.trainer`,
the results files in :mod:`posformer.lit.results`, the run dir's lock and signals in
:mod:`posformer.lit.lifecycle`. ``posformer-train`` (:mod:`posformer.cli.train`) is the Hydra main
around :func:`run`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from posformer.checkpoints import (
    check_checkpoint_matches,
    check_data_fingerprint,
    data_fingerprint,
    load_weights,
    safe_load_checkpoint,
    tokenizer_mismatch,
)
from posformer.configs.schema import TrainConfig
from posformer.configs.settings import config_yaml, read_train
from posformer.configs.variants import variant_name
from posformer.cpu import configure_cpu
from posformer.data import build_datamodule, check_data_fit
from posformer.devices import (
    Device,
    compute_dtype,
    cpu_bf16_note,
    describe_attention,
    describe_device,
    device_name,
    resolve_trainer,
)
from posformer.errors import CheckpointError, ConfigError, Interrupted, is_out_of_memory
from posformer.io import atomic_write_text, check_layout, check_writable_dir, remove_stale_tmp
from posformer.lit.checkpoint import ConfinedCheckpointState, SafeCheckpointIO, load_module
from posformer.lit.context_parallel import check_context_parallel
from posformer.lit.data import ResumableLoader, ShardedLoader
from posformer.lit.lifecycle import (
    RunLock,
    SignalCheckpoint,
    check_resumable,
    check_run_dir_owner,
    primary_process,
    resume_command,
    write_owner,
)
from posformer.lit.loggers import log_hparams
from posformer.lit.modules import PosformerModule, module_class
from posformer.lit.results import report, write_results
from posformer.lit.trainer import (
    check_batches_per_process,
    check_output_dirs,
    evaluate_lengths,
    fit_schedule_to_run,
    instantiate_group,
    process_count,
    trainer_kwargs,
    training_oom,
)
from posformer.model.backends.flex import reset_compiled
from posformer.model.config import describe_schedule
from posformer.model.positions import position_limit
from posformer.signals import Interrupts, signal_name

log = logging.getLogger("posformer.cli.train")

#: what a run writes into its run dir, as files and as directories (checked before the first write)
RUN_FILES = (
    "config.yaml",
    "results.json",
    "results.csv",
    "results.md",
    "train.log",
    ".posformer.lock",
    ".posformer.run.json",
    "error.txt",
)
RUN_DIRS = ("checkpoints", "tokenizer", ".hydra", "tensorboard")

__all__ = ["Fitted", "Prepared", "run"]


@dataclass
class Prepared:
    """Everything built and checked before the first write into the run dir."""

    dm: L.LightningDataModule
    module: PosformerModule
    fields: dict[str, Any]  # ModelConfig fields (with the data's vocabulary)
    data_info: dict[str, Any]  # task type, training length and the data's summary, for results
    max_positions: int | None  # the most positions its evaluation forwards represent (None: unbounded)
    device: Device  # the resolved accelerator and precision
    callbacks: list[Any]
    loggers: list[Any]


@dataclass
class Fitted:
    """What training left: its final metrics and checkpoints."""

    train: dict[str, float]  # train/* metrics of the last logged step
    val: dict[str, float]  # val/* metrics of the last validation
    best: str
    last: str
    global_step: int
    eval_ckpt: str | None  # the weights the final evaluation loads (None: the final weights)
    seconds: float  # from the start of the run to the end of fit


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` (the composed config) says; returns the results dict (also written
    to the run dir).

    The config is read once (:func:`~posformer.configs.settings.read_train`); everything below takes
    the settings. Holds the run dir's lock and the SIGTERM/SIGINT handlers for the whole run
    (:mod:`posformer.lit.lifecycle`).
    """
    s = read_train(cfg)
    check_precision_plugin(s.trainer.get("precision"))  # Lightning would fail after the first write
    out_dir = Path(s.paths["output_dir"])
    check_writable_dir(out_dir)  # before any work: an unwritable run dir fails in a second
    check_layout(out_dir, RUN_FILES, RUN_DIRS)  # a directory where a file goes, a loop: one line, now
    with RunLock(out_dir, enabled=primary_process()), Interrupts() as interrupts:
        started = time.perf_counter()
        s = setup_process(s)
        prepared = prepare(s, out_dir, cfg.get("data") if OmegaConf.is_config(cfg) else None)
        if primary_process():  # a new run never replaces another's results (resume is the way back in)
            check_run_dir_owner(out_dir, train=s.train, ckpt_path=s.ckpt_path)
        trainer, on_signal = start(s, out_dir, prepared, interrupts)
        fitted = fit(s, trainer, prepared, interrupts, on_signal, out_dir, started)
        rows = evaluate(s, trainer, prepared, fitted, interrupts, out_dir)
        return finish(s, trainer, prepared, fitted, rows, out_dir, started)


# ------------------------------------------------------------------------------------------ before
#: ``trainer.precision`` values whose Lightning plugin needs a package posformer does not install:
#: value -> (module Lightning imports, what to install)
PRECISION_PACKAGES: dict[str, tuple[str, str]] = {
    "transformer-engine": ("transformer_engine", "transformer_engine[pytorch]"),
    "transformer-engine-float16": ("transformer_engine", "transformer_engine[pytorch]"),
}


def _schedule_entry(fields: dict[str, Any]) -> dict[str, str]:
    """``{"pe_schedule": "rope×3+nope×1"}`` for a model with a per-layer schedule, else ``{}`` (the
    results of unscheduled models stay as they were)."""
    scheduled = describe_schedule(fields)
    return {"pe_schedule": scheduled} if scheduled != fields["pe"] else {}


def _fallback_entry(model: torch.nn.Module) -> dict[str, str]:
    """``{"attention_fallback": reason}`` when FlexAttention failed for ``model`` under ``auto`` and its
    later calls took SDPA or the materialised paths (:class:`~posformer.model.policy.FlexFallback`);
    ``{}`` otherwise (the results of runs without one stay as they were)."""
    reason = getattr(model, "attention_fallback", None)
    return {"attention_fallback": reason} if reason else {}


def check_precision_plugin(precision: Any) -> None:
    """A ``trainer.precision`` whose plugin needs a package that is not installed: one line naming the
    package and the install command, before any work (Lightning raises at ``Trainer(...)``)."""
    need = PRECISION_PACKAGES.get(str(precision))
    if need is None:
        return
    module, package = need
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install: as good as none
        found = False
    if not found:
        raise ConfigError(
            f"trainer.precision={precision} needs the {module} package, which is not installed; install it "
            f"(pip install '{package}'; FP8 needs an NVIDIA Hopper/Ada GPU or newer) or choose another "
            "precision, e.g. trainer.precision=bf16-mixed (or auto)."
        )


def setup_process(s: TrainConfig) -> TrainConfig:
    """Process-wide settings of the run; returns the settings with the schedule fit to the run."""
    s = fit_schedule_to_run(s)  # a warm-up or validation interval longer than the run: clamped, one warning
    configure_cpu(s.torch_threads or None, s.flush_denormal)
    # process-wide: every job of a multirun sets its own (null: torch's default, highest)
    torch.set_float32_matmul_precision(str(s.float32_matmul_precision or "highest"))
    reset_compiled()  # the jobs of a multirun share one process: each compiles (and counts) its own graphs
    L.seed_everything(s.seed, workers=True)
    if s.trainer.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    return s


def prepare(s: TrainConfig, out_dir: Path, data_node: Any = None) -> Prepared:
    """Data, module, device, callbacks and loggers, with every check that needs them; writes nothing.
    ``data_node``: the composed ``data`` section (an error about a value it reads from the environment
    names the variable)."""
    dm = build_datamodule(s.data, s.model["kind"], s.seed, source=data_node)
    dm.prepare_data()
    dm.setup("fit")
    facts = {"vocab_size": int(dm.vocab_size), "pad_id": int(getattr(dm, "pad_id", 0))}
    if getattr(dm, "src_vocab_size", None):
        facts["src_vocab_size"] = int(dm.src_vocab_size)
    fields = {**s.model, **facts}  # the ModelConfig fields, the data's vocabulary filled in
    summary = dm.config_summary() if hasattr(dm, "config_summary") else {}
    data_info = {
        "task_type": getattr(dm, "task_type", "task"),
        "train_length": getattr(dm, "train_length", None),
        **{k: v for k, v in summary.items() if isinstance(v, int | float | str | bool | list)},
    }
    fingerprint = data_fingerprint(dm)  # checked at resume and by posformer-eval
    if fingerprint is not None:
        data_info["fingerprint"] = fingerprint
    context = int(s.trainer.get("context_parallel") or 1)
    if s.train:  # split sequences: refused in one line before any work
        check_context_parallel(
            context,
            world=process_count(s.trainer),
            model=fields,
            task_type=data_info["task_type"],
            length=data_info["train_length"],
        )
    module = _module(s, fields, data_info)
    module.context_parallel = context if s.train else 1
    device = resolve_trainer(s.trainer)  # auto -> cuda / cpu and bf16-mixed / 16-mixed / 32-true
    dtype = compute_dtype(device.precision, device.accelerator)
    limit = position_limit(module.model, dtype)  # the run's PEs, asked for their limit in its dtype
    evaluable = position_limit(module.model, dtype, centred=True)  # evaluation's forwards (no cache)
    max_positions = evaluable[0] if evaluable else None
    if s.train:
        if note := cpu_bf16_note(device):
            log.warning(note)
        drawn = s.positions.randomized or s.positions.sampler != "none"
        check_data_fit(dm, s.positions.n_max if drawn else None, limit, dtype)
        check_batches_per_process(s.trainer, len(dm.val_dataloader()))
    resume = s.ckpt_path if s.train else None
    if resume:  # damaged, unsafe, another model, already finished: refused before anything is written
        ckpt = safe_load_checkpoint(resume, mmap=True)
        check_checkpoint_matches(ckpt, fields, path=resume)
        check_resumable(ckpt, str(resume), int(s.trainer["max_steps"]), out_dir)
        saved_data = (ckpt.get("hyper_parameters") or {}).get("data") or {}
        other_tokenizer = tokenizer_mismatch(saved_data, dm, resume, doing="resume")
        if other_tokenizer:
            raise CheckpointError(f"{other_tokenizer}, or start a new run.")
        other_data = check_data_fingerprint(saved_data, dm, resume, doing="resume")
        if other_data:  # another task with the same vocabulary, an edited data file, another tokenizer
            raise CheckpointError(f"{other_data} (the same data config and file), or start a new run.")
        del ckpt
    log.info(
        "model: %s%s, pe=%s, d_model=%s, %s parameters, attention %s, seed %s, %s",
        fields["kind"],
        f", variant {name}" if (name := variant_name(s.variant)) else "",
        describe_schedule(fields),
        fields["d_model"],
        f"{module.num_parameters():,}",
        describe_attention(str(fields.get("attention_backend") or "auto"), device.accelerator),
        s.seed,
        describe_device(device, s.trainer.get("devices", 1)),
    )
    callbacks, loggers = instantiate_group(s.callbacks), instantiate_group(s.logger)
    if not loggers:  # nothing to write learning rates to
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    check_output_dirs(callbacks, loggers)
    return Prepared(dm, module, fields, data_info, max_positions, device, callbacks, loggers)


def overrides_line(out_dir: Path) -> str:
    """``config     : <run>/config.yaml (overrides: pe=alibi trainer.max_steps=200)``: where the resolved
    config is, and what the command line changed (Hydra's task overrides; none outside a Hydra app)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    except (ImportError, ValueError):
        given = None
    said = "" if given is None else f" (overrides: {' '.join(given) or 'none'})"
    return f"config     : {out_dir / 'config.yaml'}{said}"


def _module(s: TrainConfig, fields: dict[str, Any], data_info: dict[str, Any]) -> PosformerModule:
    """The LightningModule: new (its hyper-parameters are all ``posformer-eval`` needs to rebuild it),
    initialised from ``init_from``'s weights when given, or the checkpoint's when ``train=false``
    (weights-only; another model is refused)."""
    cls = module_class(fields["kind"])
    if not s.train and s.ckpt_path:
        return load_module(cls, s.ckpt_path, expected_model=fields)
    plain = dataclasses.asdict  # hyper-parameters are plain values (checkpoints load weights-only)
    module = cls(
        model=fields,
        optim=plain(s.optim),
        schedule=plain(s.schedule),
        loss=plain(s.loss),
        positions=plain(s.positions),
        max_steps=int(s.trainer["max_steps"]),
        # + the data config and run seed: posformer-eval rebuilds the data from the checkpoint alone
        data={**data_info, "config": plain_data(s.data), "seed": s.seed},
        compile=plain(s.compile),
        **({"variant": name} if (name := variant_name(s.variant)) else {}),
    )
    if s.init_from:
        changed = load_weights(module, s.init_from)
        note = f" (model settings changed: {'; '.join(changed)})" if changed else ""
        log.info("init_from: %s tensors from %s%s", len(module.state_dict()), s.init_from, note)
    return module


def plain_data(data: Any) -> dict[str, Any]:
    """The data section as plain values: a dataset's options, or a plugin dataset's mapping."""
    return dataclasses.asdict(data) if dataclasses.is_dataclass(data) else dict(data)


def start(
    s: TrainConfig, out_dir: Path, p: Prepared, interrupts: Interrupts
) -> tuple[L.Trainer, SignalCheckpoint]:
    """The first write into the run dir (every check has passed), then the Trainer."""
    if primary_process():
        for stale in remove_stale_tmp(out_dir):
            log.info("removed %s (left by a write that was killed half-way)", stale)
    atomic_write_text(out_dir / "config.yaml", config_yaml(s))
    if primary_process():
        log.info("%s", overrides_line(out_dir))
    if primary_process():  # the run dir's owner: a later new run into it is refused (check_run_dir_owner)
        created = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_owner(out_dir, {"created": created, "seed": s.seed, "pe": p.fields["pe"]})
    if hasattr(p.dm, "save_tokenizer"):  # <run_dir>/tokenizer/: the run is reusable without the data cache
        p.dm.save_tokenizer(out_dir)
    interrupts.describe = lambda s: (
        f"interrupted by {signal_name(s)} before the first training step; nothing was trained. "
        "Re-run the same command."
    )
    on_signal = SignalCheckpoint(interrupts, functools.partial(resume_command, out_dir), out_dir)
    trainer = L.Trainer(
        **trainer_kwargs(s.trainer),
        callbacks=[*p.callbacks, on_signal, ConfinedCheckpointState()],  # resume: paths stay in the run
        logger=p.loggers or False,
        plugins=[SafeCheckpointIO()],
    )
    return trainer, on_signal


# ------------------------------------------------------------------------------------------ training
def fit(
    s: TrainConfig,
    trainer: L.Trainer,
    p: Prepared,
    interrupts: Interrupts,
    on_signal: SignalCheckpoint,
    out_dir: Path,
    started: float,
) -> Fitted:
    """``Trainer.fit`` (when ``s.train``), then what it left; a signal that arrived as it ended stops."""
    if s.train:
        try:  # loaders, not the datamodule: ResumableLoader resumes mid-epoch exactly and shards ranks
            trainer.fit(
                p.module,
                train_dataloaders=ResumableLoader(p.dm.train_dataloader(), p.module.context_parallel),
                val_dataloaders=ShardedLoader(p.dm.val_dataloader(), p.module.context_parallel),
                ckpt_path=s.ckpt_path,
            )
        except Exception as exc:
            if is_out_of_memory(exc):
                raise training_oom(exc, s, trainer, on_signal.last_batch) from None
            raise
        finally:
            interrupts.deferring = False
    seconds = time.perf_counter() - started
    # final training/validation metrics, read before evaluation replaces the trainer's metrics
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    ckpt_cb = trainer.checkpoint_callback
    best = getattr(ckpt_cb, "best_model_path", "") or ""
    last = getattr(ckpt_cb, "last_model_path", "") or ""
    global_step = int(trainer.global_step)
    if global_step == 0 and s.train and (last or best):  # ddp_spawn: the loop ran in the workers
        global_step = int(safe_load_checkpoint(last or best, verify=False, mmap=True).get("global_step", 0))
    eval_ckpt = best if (s.eval_ckpt == "best" and best and s.train) else None
    final = last or best or str(s.ckpt_path or "")
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
    return Fitted(
        train={k: v for k, v in metrics.items() if k.startswith("train/")},
        val={k: v for k, v in metrics.items() if k.startswith("val/")},
        best=best,
        last=last,
        global_step=global_step,
        eval_ckpt=eval_ckpt,
        seconds=seconds,
    )


# ------------------------------------------------------------------------------------------ after
def evaluate(
    s: TrainConfig, trainer: L.Trainer, p: Prepared, fitted: Fitted, interrupts: Interrupts, out_dir: Path
) -> list[dict[str, Any]]:
    """Rows of the final evaluation at the training length and ``data.eval_lengths`` (global rank 0)."""
    if s.evaluate and s.train and s.eval_ckpt == "best" and not fitted.best:
        log.warning("no best checkpoint (the run never validated): evaluating the final weights")
    # plain `ddp` re-executes this script per rank: only global rank 0 evaluates and writes results
    worker = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not s.evaluate or (worker and torch.distributed.get_rank() != 0):
        return []
    dm = p.dm
    train_length = {int(getattr(dm, "train_length", 0))} - {0}
    lengths = sorted(set(getattr(dm, "eval_lengths", []) or []) | train_length)
    eval_trainer = trainer
    if trainer.world_size > 1:  # evaluate in this (the launching) process on one device: exact, simple
        eval_trainer = L.Trainer(
            accelerator=p.device.accelerator,
            devices=1,
            precision=p.device.precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=str(out_dir),
        )
    return evaluate_lengths(eval_trainer, p.module, dm, lengths, p.max_positions, fitted.eval_ckpt)


def finish(
    s: TrainConfig,
    trainer: L.Trainer,
    p: Prepared,
    fitted: Fitted,
    rows: list[dict[str, Any]],
    out_dir: Path,
    started: float,
) -> dict[str, Any]:
    """The results dict; written (``results.{json,csv,md}``), logged and reported by global rank 0."""
    results = {
        "task_name": s.task_name,
        "pe": p.fields["pe"],
        **({"variant": name} if (name := variant_name(s.variant)) else {}),  # +variant=<name>; none: absent
        **_schedule_entry(p.fields),  # a per-layer schedule: pe_schedule=rope×3+nope×1; none: absent
        "model_kind": p.fields["kind"],
        "seed": s.seed,
        "parameters": p.module.num_parameters(),
        "global_step": fitted.global_step,
        "train_length": p.data_info.get("train_length"),
        "data": p.data_info,
        "world_size": int(trainer.world_size),
        # what trainer.accelerator / trainer.precision resolved to (config.yaml keeps what was asked)
        "accelerator": p.device.accelerator,
        "precision": p.device.precision,
        "device": device_name(p.device, s.trainer.get("devices", 1)),
        **_fallback_entry(p.module.model),  # FlexAttention failed under auto: why (absent otherwise)
        "train": fitted.train,
        "val": fitted.val,
        "results": rows,
        "checkpoint": {
            "best": fitted.best,
            "last": fitted.last,
            "evaluated": fitted.eval_ckpt or "final weights",
        },
        "output_dir": str(out_dir),
        "wall_time_s": round(time.perf_counter() - started, 2),
        "train_time_s": round(fitted.seconds, 2),
    }
    if trainer.is_global_zero:
        write_results(out_dir, results)
        log_hparams(trainer, dataclasses.asdict(s), rows, results)
        report(trainer, results, rows, out_dir)
    return results
