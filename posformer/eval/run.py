"""``posformer-eval`` as a library: from the composed ``eval`` config to results.

:func:`dispatch` picks the job from the ``eval`` config group: ``extrapolate`` runs
:func:`run_extrapolation` (checkpoints -> :class:`~posformer.eval.settings.Subject` s with the data
each was trained on -> :func:`~posformer.eval.harness.evaluate_subjects`), ``translate`` runs
:func:`posformer.eval.translate.run_translate`. The command-line main (:mod:`posformer.cli.evaluate`)
only adds the Hydra entry and the error boundary.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posformer.checkpoints import (
    LoadedCheckpoint,
    check_same_data,
    find_checkpoints,
    load_checkpoint,
    peek_model_config,
    safe_load_checkpoint,
    train_length,
)
from posformer.configs.eval_schema import EvalRootConfig, ExtrapolateConfig
from posformer.configs.variants import run_label as run_label_of
from posformer.cpu import configure_cpu
from posformer.data import build_datamodule
from posformer.devices import CUDA_ACCELERATORS, Device, describe_device, device_name, resolve_trainer
from posformer.errors import CheckpointError, ConfigError
from posformer.eval.console import print_results
from posformer.eval.harness import evaluate_subjects
from posformer.eval.limits import check_max_length, check_owner, sources
from posformer.eval.parallel import check_eval_split, spawn
from posformer.eval.results import RESULTS_JSON
from posformer.eval.settings import (
    DEFAULT_MODES,
    EvalSettings,
    Subject,
    file_fingerprint,
    read_eval,
    train_len_max,
)
from posformer.eval.store import Results, set_aside_unreadable
from posformer.eval.sweep_jobs import SEP, run_label
from posformer.eval.translate import run_translate
from posformer.eval.windows import training_scored_tokens
from posformer.io import check_writable_dir
from posformer.model.parallel import ContextParallel
from posformer.model.remap import parse_position_map
from posformer.pe import get_encoding_class
from posformer.signals import Interrupts, signal_name

log = logging.getLogger("posformer.eval")

#: the multiples of each checkpoint's training length evaluated when ``eval.lengths`` is not set
DEFAULT_LENGTH_MULTIPLES = (1, 2, 4, 8, 16)


def checkpoint_paths(x: ExtrapolateConfig) -> list[Path]:
    """``eval.checkpoints`` (a path or a list) plus one checkpoint per run of ``eval.sweep_dir``."""
    ckpts = x.checkpoints or []
    paths = [Path(p) for p in ([ckpts] if isinstance(ckpts, str) else ckpts)]
    if x.sweep_dir:
        for sweep in [x.sweep_dir] if isinstance(x.sweep_dir, str) else x.sweep_dir:
            paths += find_checkpoints(sweep, x.which)
    return paths  # at least one: read_eval requires eval.checkpoints or eval.sweep_dir


def build_data(ck: LoadedCheckpoint, overrides: dict[str, Any]) -> Any:
    """The datamodule a checkpoint was trained on (``eval.data`` merged over its data config), set up."""
    data_cfg = OmegaConf.merge(OmegaConf.create(ck.data_cfg), OmegaConf.create(overrides or {}))
    dm = build_datamodule(data_cfg, ck.model_cfg.get("kind", "decoder"), ck.seed)
    if hasattr(dm, "prepare_data"):
        dm.prepare_data()
    if hasattr(dm, "setup"):
        dm.setup("test")
    return dm


def _label(ck: LoadedCheckpoint, labels: list[str] | None, index: int, taken: set[str]) -> str:
    """``eval.labels[index]``, else the sweep label of a sweep job (``rope · seed 0``, ``prope · seed 0``
    with a variant), else ``<variant> · seed <seed>`` for a run with a variant, else ``<pe> [<run dir
    name>]`` (a per-layer schedule: ``rope×3+nope×1 [<run dir name>]``). A variant's label another
    checkpoint already has (``taken``) gets `` [<run dir name>]``."""
    if labels and index < len(labels):
        return str(labels[index])
    run = Path(ck.path).resolve().parent.parent
    name = run_label_of(ck.model_cfg, ck.variant)  # the variant's name, else the PE or schedule
    label = run_label(run, name, ck.variant) or (
        f"{name}{SEP}seed {ck.seed}" if ck.variant else f"{name} [{run.name}]"
    )
    return f"{label} [{run.name}]" if ck.variant and label in taken else label


def _check_vocab(ck: LoadedCheckpoint, dm: Any, path: Path, overrides: dict[str, Any]) -> None:
    vocab, trained_vocab = getattr(dm, "vocab_size", None), ck.model_cfg.get("vocab_size")
    if vocab is not None and trained_vocab is not None and int(vocab) != int(trained_vocab):
        raise CheckpointError(
            f"checkpoint {str(path)!r} was trained with a vocabulary of {trained_vocab} tokens, but the "
            f"evaluation data (its data config + eval.data={overrides}) has {vocab}; drop the eval.data "
            "overrides that change the tokenizer or symbols."
        )


def build_subjects(x: ExtrapolateConfig) -> tuple[list[Subject], list[int]]:
    """Load every checkpoint and its data; returns the subjects (× rope scalings) and the lengths.

    A checkpoint gets one subject per entry of ``eval.rope_scaling`` (``null`` = unscaled) and of
    ``eval.position_map`` (``null`` = positions as they are); scaled entries apply only to PEs whose class
    declares ``capabilities.rotary_scalable`` (the others are skipped for them), each on its own copy of
    the model.
    """
    overrides, labels, scalings = x.data or {}, x.labels, x.rope_scaling
    if scalings is None or isinstance(scalings, dict):
        scalings = [scalings]
    maps = x.position_map if isinstance(x.position_map, list | tuple) else [x.position_map]
    maps = [parse_position_map(m) for m in maps]
    subjects: list[Subject] = []
    train_lens: list[int] = []
    taken: set[str] = set()
    for i, path in enumerate(checkpoint_paths(x)):
        ck = load_checkpoint(path)
        dm = build_data(ck, overrides)
        _check_vocab(ck, dm, path, overrides)
        check_same_data(ck, dm, overrides)  # an edited data file, another task: not silently scored
        task_type = getattr(dm, "task_type", "lm")
        if task_type == "translation":
            raise ConfigError(
                f"{path} is a translation model; length extrapolation covers LM and synthetic tasks. Use "
                "posformer-eval eval=translate for BLEU."
            )
        train_len = getattr(dm, "train_length", None) or ck.train_len
        if isinstance(train_len, list):
            train_len = tuple(train_len)
        tl = train_len_max(train_len)
        if tl:
            train_lens.append(tl)
        scalable = any(scalings) and get_encoding_class(ck.pe).capabilities.rotary_scalable
        label = _label(ck, labels, i, taken)
        taken.add(label)
        for sc, pm in ((sc, pm) for sc in scalings for pm in maps):
            if sc and not scalable:
                continue  # context-extension methods apply to rotary PEs only
            model = ck.model if sc is None and pm is None else copy.deepcopy(ck.model)
            if pm is not None:
                model.position_map = pm  # refused in one line where a PE of the model cannot take it
            subjects.append(
                Subject(
                    label=label,
                    model=model,
                    position_map=pm,
                    task_type=task_type,
                    data=dm,
                    train_len=train_len,
                    checkpoint=str(path),
                    pe=ck.pe,
                    scaling=sc,
                    fingerprint=file_fingerprint(path),
                    n_max=int((ck.hparams.get("positions") or {}).get("n_max") or 0) or None,
                    n_tokens=training_scored_tokens(dm) if task_type == "lm" else None,
                    variant=ck.variant,
                )
            )
    return subjects, eval_lengths(x, train_lens)


def eval_lengths(x: ExtrapolateConfig, train_lens: list[int]) -> list[int]:
    """``eval.lengths``, else ``eval.length_multiples`` x each distinct training length."""
    lengths = x.lengths
    if not lengths:
        multiples = x.length_multiples or list(DEFAULT_LENGTH_MULTIPLES)
        if not train_lens:
            raise ConfigError(
                "eval.lengths is not set and the checkpoints record no training length; set eval.lengths."
            )
        lengths = sorted({max(1, int(m * t)) for m in multiples for t in set(train_lens)})
    return list(lengths)  # eval.lengths: positive integers (read_eval)


def output_dir(x: ExtrapolateConfig) -> Path:
    """``eval.output_dir``, else the Hydra run dir, else the working directory."""
    if x.output_dir:
        return Path(x.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # not under Hydra
        return Path.cwd()


def make_fabric(device: Device, index: int | None = None) -> Any:
    """A Fabric on one device with the resolved ``trainer.accelerator/precision`` (``index``: that CUDA
    device, e.g. a context-parallel rank's own)."""
    from lightning.fabric import Fabric

    devices = [index] if index is not None and device.accelerator in CUDA_ACCELERATORS else 1
    return Fabric(accelerator=device.accelerator, devices=devices, precision=device.precision)


def eval_settings(x: ExtrapolateConfig, lengths: list[int]) -> EvalSettings:
    """The harness settings from the ``eval`` settings (``configs/eval/extrapolate.yaml``)."""
    return EvalSettings(
        lengths=lengths,
        modes=tuple(x.modes or DEFAULT_MODES),
        streaming=x.streaming,
        stride=x.stride,
        n_tokens=x.n_tokens,
        windows_at_max=x.windows_at_max,
        batch_tokens=x.batch_tokens,
        attention_chunk_mb=x.attention_chunk_mb,
        attention_backend=x.attention_backend,
        max_batches=x.max_batches,
        task_positions=tuple([x.task_positions] if isinstance(x.task_positions, str) else x.task_positions),
        positions_seed=x.positions_seed,
        progress=x.progress,
    )


def _saved_models(paths: list[Path]) -> list[dict[str, Any]]:
    """The checkpoints' saved model configs (``{}`` for an unreadable one: its own error comes when it
    loads); read only to word a refusal of :func:`~posformer.eval.limits.check_max_length`."""
    models = []
    for path in paths:
        try:
            models.append(peek_model_config(path))
        except Exception:  # noqa: BLE001
            models.append({})
    return models


def continue_command(out: Path) -> str:
    """This command line with ``eval.output_dir=<out>`` (the one that continues an interrupted run)."""
    args = [a for a in sys.argv[1:] if not a.startswith(("eval.output_dir=", "hydra.run.dir="))]
    return shlex.join(["posformer-eval", *args, f"eval.output_dir={out}"])


def interrupted_line(signum: int, out: Path) -> str:
    """What an interrupt kept (the finished rows on disk) and the command that continues from there."""
    try:
        rows = json.loads((out / RESULTS_JSON).read_text(encoding="utf-8"))["results"]
        kept = sum(1 for r in rows if r.get("status") in ("ok", "n/a"))
    except (OSError, ValueError, KeyError, TypeError):
        kept = 0
    if not kept:
        return not_started_line(signum)
    where = f"kept {kept} finished row(s) in {out / RESULTS_JSON}"
    return f"interrupted by {signal_name(signum)}: {where}; continue with: {continue_command(out)}"


def not_started_line(signum: int) -> str:
    """The line for a signal before the first row (set-up, checkpoint and data loading, translation)."""
    return f"interrupted by {signal_name(signum)} before any result was written; re-run the same command."


def run_extrapolation(s: EvalRootConfig) -> Results:
    """``eval=extrapolate``: evaluate the configured checkpoints at every length; returns the results.

    Before any checkpoint is loaded (the settings ``s`` were read and checked by
    :func:`~posformer.eval.settings.read_eval`): the device and precision resolved
    (:func:`posformer.devices.resolve_trainer`: ``trainer=gpu`` without CUDA is one error line), the
    output dir is probed, an unreadable earlier ``extrapolation.json`` there is moved aside (one line
    says where), an output dir holding the finished results of other checkpoints is refused
    (:func:`~posformer.eval.limits.check_owner`), and so are lengths above ``eval.max_length``
    (:func:`~posformer.eval.limits.check_max_length`). SIGINT/SIGTERM keep the finished rows (written
    after each) and end with one line: what was kept and the command that continues (exit 130/143). The
    first line on the console names the device and precision; ``extrapolation.json``'s ``meta`` records
    them.
    """
    x = s.eval
    with Interrupts() as interrupts:
        interrupts.describe = not_started_line
        device = resolve_trainer(s.trainer)  # trainer=gpu without CUDA: one line, now
        out = output_dir(x)
        # before any checkpoint is loaded: a read-only output dir fails in a second, not after the sweep
        check_writable_dir(
            out, "evaluation output directory", create=False, fix="eval.output_dir=/writable/dir"
        )
        set_aside_unreadable(out)
        paths = checkpoint_paths(x)
        config = dataclasses.asdict(x)  # plain values: the results' meta, the output dir's sources
        check_owner(out, sources(config), paths)
        models = functools.partial(_saved_models, paths)
        check_max_length(x.lengths or [], x.max_length, models)
        interrupts.describe = lambda signum: interrupted_line(signum, out)
        if x.context_parallel > 1:  # every window split across processes: they evaluate, this one reports
            return _run_split(s, out, paths, device, meta=_meta(x, config, device, paths))
        subjects, lengths = build_subjects(x)
        check_max_length(lengths, x.max_length, models)
        settings = eval_settings(x, lengths)
        log.info(
            "evaluating %d series at %d length(s) (%s), %s",
            len(subjects),
            len(lengths),
            ", ".join(map(str, lengths)),
            describe_device(device),
        )
        results = evaluate_subjects(
            subjects,
            settings,
            out,
            fabric=make_fabric(device),
            meta=_meta(x, config, device, paths),
            tensorboard=x.tensorboard,
        )
        print_results(results, out)  # the tables on the console and in eval.log, then the output paths
    return results


def _meta(x: ExtrapolateConfig, config: dict[str, Any], device: Device, paths: list[Path]) -> dict[str, Any]:
    """The run's metadata in ``extrapolation.json`` (command, config, device, sources, checkpoints)."""
    return {
        "command": " ".join(["posformer-eval", *sys.argv[1:]]),
        "config": config,
        "accelerator": device.accelerator,
        "precision": device.precision,
        "device": device_name(device),
        "sources": sources(config),
        "checkpoints": sorted(str(Path(p).expanduser().resolve()) for p in paths),
    }


def _check_split(x: ExtrapolateConfig, device: Device, hparams: dict[str, dict[str, Any]]) -> None:
    """:func:`~posformer.eval.parallel.check_eval_split` of ``eval.context_parallel`` over the
    checkpoints' saved ``hparams`` and the lengths: ``eval.lengths``, else those of the checkpoints'
    recorded training lengths (when every checkpoint records one)."""
    trained = [train_len_max(train_length(dict(hp.get("data") or {}))) for hp in hparams.values()]
    lengths = x.lengths or (eval_lengths(x, trained) if trained and None not in trained else [])
    check_eval_split(
        x.context_parallel,
        accelerator=device.accelerator,
        lengths=lengths,
        checkpoints=hparams,
        modes=["streaming"] if x.streaming else (x.modes or DEFAULT_MODES),
    )


def _run_split(
    s: EvalRootConfig, out: Path, paths: list[Path], device: Device, *, meta: dict[str, Any]
) -> Results:
    """``eval.context_parallel=P``: refused in one line when it cannot apply, else ``P`` processes
    evaluate every window split (:func:`_evaluate_split`); this one then reads and shows rank 0's
    results."""
    x = s.eval
    hparams = {}
    for path in paths:
        try:
            hparams[str(path)] = dict(
                safe_load_checkpoint(path, verify=False, mmap=True).get("hyper_parameters") or {}
            )
        except Exception:  # noqa: BLE001 - an unreadable checkpoint says so when it loads
            hparams[str(path)] = {}
    _check_split(x, device, hparams)
    log.info(
        "evaluating every window split across %d processes, %s", x.context_parallel, describe_device(device)
    )
    s = dataclasses.replace(s, eval=dataclasses.replace(x, output_dir=str(out)))  # not Hydra's, in them
    spawn(x.context_parallel, device.accelerator, _evaluate_split, (s, out, device, meta))
    results = Results.load(out)
    print_results(results, out)
    return results


def _evaluate_split(
    cp: ContextParallel, s: EvalRootConfig, out: Path, device: Device, meta: dict[str, Any]
) -> None:
    """One process of :func:`_run_split`: the checkpoints and data loaded, the derived lengths and the
    data's task checked, every pending row evaluated with its windows split across ``cp``; rank 0
    writes the results files."""
    x = s.eval
    subjects, lengths = build_subjects(x)
    check_max_length(lengths, x.max_length, functools.partial(_saved_models, checkpoint_paths(x)))
    check_eval_split(
        cp.size,
        accelerator=device.accelerator,
        lengths=lengths,
        checkpoints={sub.checkpoint: {"data": {"task_type": sub.task_type}} for sub in subjects},
    )
    settings = eval_settings(x, lengths)
    fabric = make_fabric(device, cp.rank)
    evaluate_subjects(
        subjects, settings, out, fabric=fabric, meta=meta, tensorboard=x.tensorboard, parallel=cp
    )


def _choice(cfg: DictConfig) -> str:
    """The selected ``eval`` config group option (Hydra's choice, else ``eval.name``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.choices.get("eval")
        if choice:
            return str(choice)
    except Exception:
        pass
    return str(cfg.eval.get("name", "extrapolate"))


def dispatch(cfg: DictConfig) -> Any:
    """Read the composed config once (:func:`~posformer.eval.settings.read_eval`), then run the job the
    ``eval`` config group selects; returns its result."""
    s = read_eval(cfg, _choice(cfg))
    configure_cpu(s.torch_threads or None, s.flush_denormal)
    if isinstance(s.eval, ExtrapolateConfig):
        return run_extrapolation(s)
    with Interrupts() as interrupts:  # SIGINT/SIGTERM: one line, exit 130/143 (no traceback)
        interrupts.describe = not_started_line
        return run_translate(s)
