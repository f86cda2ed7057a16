"""``posformer-train``: train a model with Hydra + Lightning, then evaluate it at several lengths.

    posformer-train                                  # the default experiment
    posformer-train pe=alibi trainer.max_steps=500   # override groups/values
    posformer-train -m pe=sinusoidal,rope,alibi seed=0,1,2   # a sweep (one run dir per job)
    python -m posformer.cli.train --help                 # config groups and options

Flow: validate the config -> seed -> datamodule -> module -> Trainer.fit (``ckpt_path`` resumes
exactly) -> evaluation at the training length and longer lengths -> ``results.{json,csv,md}`` and
``config.yaml`` in the run directory, a short table and the output paths on stdout.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from posformer.errors import PosformerError, is_out_of_memory

log = logging.getLogger("posformer.cli.train")

EVAL_KEYS = ("exact_match", "token_acc", "loss", "ppl", "n_sequences", "n_tokens")
RESULT_COLUMNS = (
    "length",
    "in_distribution",
    "exact_match",
    "token_acc",
    "loss",
    "ppl",
    "n_sequences",
    "n_tokens",
    "note",
)


# ------------------------------------------------------------------------------------------ hydra
from posformer.configs import job_dirname, register_resolvers  # noqa: E402,F401  (job_dirname: re-exported)

register_resolvers()


# ------------------------------------------------------------------------------------------ files
def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    from posformer.io import atomic_write_text  # fsync, keeps file modes, cleans up on errors

    return atomic_write_text(path, text)


def _fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return "" if v is None else str(v)


def results_markdown(rows: list[dict[str, Any]], title: str = "") -> str:
    head = "| length | in-dist | exact match | token acc | loss | ppl | sequences | note |"
    lines = ([f"## {title}", ""] if title else []) + [head, "|---:|:---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r['length']} | {'yes' if r['in_distribution'] else 'no'} | {_fmt(r['exact_match'])} | "
            f"{_fmt(r['token_acc'])} | {_fmt(r['loss'])} | {_fmt(r['ppl'], 3)} | {r['n_sequences']} | "
            f"{r.get('note') or ''} |"
        )
    return "\n".join(lines) + "\n"


def results_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(RESULT_COLUMNS), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------ pieces
def instantiate_group(group: Mapping[str, Any] | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (``null`` entries skipped)."""
    objs = []
    for _, conf in (group or {}).items():
        if conf is not None and "_target_" in conf:
            objs.append(hydra.utils.instantiate(conf))
    return objs


def trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    kw = OmegaConf.to_container(cfg.trainer, resolve=True)
    keep_none = ("val_check_interval", "check_val_every_n_epoch")  # None is meaningful for these two
    return {k: v for k, v in kw.items() if v is not None or k in keep_none}


def _pe_max_positions(fields: Mapping[str, Any]) -> int | None:
    """The PE's position limit (``None``: unbounded), asked of the PE itself (built causal)."""
    from posformer.pe import build_encoding

    pe = build_encoding(
        fields["pe"],
        d_model=fields["d_model"],
        n_heads=fields["n_heads"],
        causal=True,
        **(fields.get("pe_options") or {}),
    )
    return pe.max_positions


def _console() -> Any:
    try:
        from rich.console import Console

        return Console()
    except ModuleNotFoundError:  # pragma: no cover
        return None


def print_results(rows: list[dict[str, Any]], title: str) -> None:
    console = _console()
    if console is None:
        print(results_markdown(rows, title))
        return
    from rich.table import Table

    table = Table(title=title)
    for col, just in (
        ("length", "right"),
        ("in-dist", "center"),
        ("exact match", "right"),
        ("token acc", "right"),
        ("loss", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=just)
    for r in rows:
        table.add_row(
            str(r["length"]),
            "yes" if r["in_distribution"] else "no",
            _fmt(r["exact_match"]),
            _fmt(r["token_acc"]),
            _fmt(r["loss"]),
            r.get("note") or "",
        )
    console.print(table)


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
                    **_nan_row(length, length <= train_length),
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
                        **_nan_row(length, length <= train_length),
                        "note": f"out of memory ({first_line}); lower data.batch_size / "
                        "model.attention_chunk_mb or evaluate with posformer-eval",
                    }
    return [rows[k] for k in sorted(rows)]


def _nan_row(length: int, in_distribution: bool) -> dict[str, Any]:
    """A result row for a length that was not evaluated: NaN metrics, zero counts."""
    counts = ("n_sequences", "n_tokens")
    metrics = {k: 0 if k in counts else float("nan") for k in EVAL_KEYS}
    return {"length": length, "in_distribution": in_distribution, **metrics}


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
    from posformer.io import SafeCheckpointIO, check_writable_dir, load_module, safe_load_checkpoint
    from posformer.lit import module_class

    started = time.perf_counter()
    out_dir = Path(cfg.paths.output_dir)
    check_writable_dir(out_dir)  # before any work: an unwritable run dir fails in a second
    write_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
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
    max_positions = _pe_max_positions(fields)
    if cfg.train:
        check_data_fit(cfg, dm, max_positions)

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
        _write_results(out_dir, results)
        _log_hparams(trainer, cfg, rows, results)
        _report(trainer, results, rows, out_dir)
    return results


def _write_results(out_dir: Path, results: dict[str, Any]) -> None:
    write_atomic(out_dir / "results.json", json.dumps(_json_safe(results), indent=2) + "\n")
    write_atomic(out_dir / "results.csv", results_csv(results["results"]))
    title = f"{results['task_name']}: {results['model_kind']}, pe={results['pe']}, seed={results['seed']}"
    write_atomic(out_dir / "results.md", results_markdown(results["results"], title))


def _headline(rows: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    ind = [r for r in rows if r["in_distribution"] and r["n_sequences"]]
    ood = [r for r in rows if not r["in_distribution"] and r["n_sequences"]]
    if ind:
        out["hp/exact_match_train_len"] = ind[-1]["exact_match"]
    if ood:
        out["hp/exact_match_longest"] = ood[-1]["exact_match"]
        out["hp/exact_match_ood_mean"] = sum(r["exact_match"] for r in ood) / len(ood)
    return out


def _log_hparams(trainer: Any, cfg: DictConfig, rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    container = OmegaConf.to_container(cfg, resolve=True)
    params = {
        k: container[k] for k in ("model", "optim", "schedule", "loss", "positions", "seed") if k in container
    }
    params["data"] = results["data"]
    params["trainer"] = {
        k: container["trainer"].get(k) for k in ("max_steps", "precision", "accumulate_grad_batches")
    }
    metrics = _headline(rows)
    for key, value in results["val"].items():
        metrics[f"hp/{key.replace('/', '_')}"] = value
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.log_hyperparams(params, metrics=metrics or None)
            for r in rows:
                if r["n_sequences"]:
                    logger.experiment.add_scalar("eval/exact_match_vs_length", r["exact_match"], r["length"])
                    logger.experiment.add_scalar("eval/token_acc_vs_length", r["token_acc"], r["length"])
            logger.experiment.flush()


def _report(trainer: Any, results: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> None:
    if rows:
        print_results(
            rows,
            f"{results['model_kind']} / pe={results['pe']} / seed={results['seed']} — "
            f"trained on lengths <= {results['train_length']}",
        )
    tb = [lg.log_dir for lg in trainer.loggers if type(lg).__name__ == "TensorBoardLogger"]
    lines = [
        f"checkpoint : {results['checkpoint']['best'] or results['checkpoint']['last'] or 'none saved'}",
        f"tensorboard: {tb[0] if tb else 'disabled'}" + (f"  (tensorboard --logdir {out_dir})" if tb else ""),
        f"results    : {out_dir / 'results.md'} (.json, .csv)",
        f"wall time  : {results['wall_time_s']:.1f} s ({results['global_step']} steps)",
    ]
    for line in lines:
        print(line, flush=True)


# ------------------------------------------------------------------------------------------ entry point
@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        results = run(cfg)
    except PosformerError as exc:
        msg = f"error: {exc}"
        print(msg, file=sys.stderr)
        if multirun:  # keep the sweep going; the job's directory records the failure
            write_atomic(Path(cfg.paths.output_dir) / "error.txt", msg + "\n")
            return None
        raise SystemExit(1) from None
    head = _headline(results["results"])
    return head.get("hp/exact_match_train_len")


def main() -> None:
    """Console script ``posformer-train``."""
    from posformer.io import precheck_run_dir

    try:
        precheck_run_dir(sys.argv[1:])  # Hydra creates the run dir first and would fail with a traceback
    except PosformerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    _hydra_main()


if __name__ == "__main__":
    main()
