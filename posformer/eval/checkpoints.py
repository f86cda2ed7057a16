"""Checkpoints for evaluation: finding them in run/sweep directories, and the one loader.

The saved layout (what ``posformer-train`` writes; :class:`posformer.lit.modules.PosformerModule`
saves its constructor arguments with ``save_hyperparameters``):

- ``hyper_parameters.model``: the ``ModelConfig`` fields (vocabulary and pad id filled in from the data);
- ``hyper_parameters.data``: facts about the training data (``task_type``, ``train_length``, ...), the
  resolved data config (``config``) and the run seed (``seed``): enough to rebuild the evaluation data
  from the checkpoint alone (a file copied out of its run dir);
- ``state_dict``: the LightningModule's weights, the network's under the ``model.`` prefix;
- ``callbacks``: Lightning's callback states (``ModelCheckpoint``'s ``best_model_path``), ``global_step``.

The training run directory holds the resolved ``config.yaml`` next to ``checkpoints/``: its ``data``
and ``seed`` are the fallback for checkpoints written before the data config was saved in them.

Every file is read with :func:`posformer.io.safe_load_checkpoint` (``weights_only=True``: loading cannot
run code; CRC-checked unless only a cheap look is needed).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posformer.data.files import default_cache_dir
from posformer.data.tokenizers import TOKENIZERS
from posformer.errors import CheckpointError, ConfigError
from posformer.io import safe_load_checkpoint
from posformer.lit.checkpoint import (
    check_data_fingerprint,
    check_pe_trusted,
    read_checkpoint,
    saved_model_config,
    tokenizer_mismatch,
)
from posformer.lit.modules import compile_options
from posformer.model import ModelConfig, build_model

log = logging.getLogger(__name__)

#: the prefix of the network's weights in a posformer checkpoint's ``state_dict``
MODEL_PREFIX = "model."
#: where a training run keeps its resolved config, relative to the run directory
RUN_CONFIG_NAMES = ("config.yaml", ".hydra/config.yaml")
#: data-config keys naming a directory the datamodule writes into (confined when read from a checkpoint)
WRITE_DIRS = ("cache_dir",)


# ---------------------------------------------------------------------------------------------- reading
def peek_model_config(path: str | Path) -> dict[str, Any]:
    """The saved model config of ``path``, cheaply (memory-mapped, no CRC check); ``{}`` if none."""
    hp = safe_load_checkpoint(path, verify=False, mmap=True).get("hyper_parameters") or {}
    return dict(hp.get("model") or {})


def checkpoint_step(path: Path) -> int:
    """Training step of a checkpoint: from its ``global_step``, else from ``step<N>`` in the file name."""
    try:
        return int(safe_load_checkpoint(path, verify=False, mmap=True).get("global_step", -1))
    except Exception:  # noqa: BLE001 - fall back to the name
        m = re.search(r"step[=_-]?(\d+)", path.name)
        return int(m.group(1)) if m else -1


# ---------------------------------------------------------------------------------------------- run config
def load_run_config(
    start: Path, *, levels: int = 1, names: Sequence[str] = RUN_CONFIG_NAMES, resolve: bool = True
) -> dict[str, Any] | None:
    """The training run's config as a plain dict: the first of ``names`` that loads, looked for in
    ``start`` and then up to ``levels - 1`` parent directories; ``None`` when there is none.

    ``resolve``: resolve interpolations (falling back to the unresolved config when they need Hydra,
    as in ``.hydra/config.yaml``); ``False``: keep them (the caller merges overrides first).
    """
    from omegaconf import OmegaConf

    for d in [start, *start.parents][:levels]:
        for name in names:
            cand = d / name
            if not cand.is_file():
                continue
            try:
                cfg = OmegaConf.load(cand)
                if resolve:
                    try:
                        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
                    except Exception:  # interpolations that need Hydra (.hydra/config.yaml)
                        pass
                return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]
            except Exception:  # an unreadable file: try the next candidate
                continue
    return None


def train_length(data_cfg: Mapping[str, Any]) -> int | tuple[int, int] | None:
    """The training length from a data config: ``train_len`` (int, or ``[min, max]`` / ``{min:, max:}``)."""
    for key in ("train_len", "train_length", "block_size", "seq_len"):
        v = data_cfg.get(key) if isinstance(data_cfg, Mapping) else None
        if v is None:
            continue
        if isinstance(v, Mapping):
            lo, hi = v.get("min", v.get("low")), v.get("max", v.get("high"))
            return (int(lo), int(hi)) if lo is not None else int(hi)
        if isinstance(v, (list, tuple)):
            return (int(v[0]), int(v[-1])) if len(v) > 1 and v[0] != v[-1] else int(v[-1])
        return int(v)
    for lo_key, hi_key in (("train_min_len", "train_max_len"), ("min_len", "max_len")):
        if isinstance(data_cfg, Mapping) and data_cfg.get(hi_key) is not None:
            return (int(data_cfg.get(lo_key) or 1), int(data_cfg[hi_key]))
    return None


# ---------------------------------------------------------------------------------------------- the loader
@dataclass
class LoadedCheckpoint:
    """A model restored from a checkpoint, with what evaluation needs to know about its training.

    Attributes:
        path: the checkpoint file.
        model: the network in eval mode (``DecoderOnlyTransformer`` or ``EncoderDecoderTransformer``).
        model_cfg: its ``ModelConfig`` fields.
        data_cfg: the training data config (``hyper_parameters.data.config``, else the run's
            ``config.yaml``, else the facts in ``hyper_parameters.data``).
        seed: the training seed.
        hparams: the checkpoint's ``hyper_parameters``.
    """

    path: str
    model: nn.Module
    model_cfg: dict[str, Any]
    data_cfg: dict[str, Any]
    seed: int
    hparams: dict[str, Any]

    @property
    def pe(self) -> str:
        return str(self.model_cfg.get("pe", ""))

    @property
    def kind(self) -> str:
        return str(self.model_cfg.get("kind", ""))

    @property
    def train_len(self) -> int | tuple[int, int] | None:
        return train_length(self.data_cfg)


def load_checkpoint(
    path: Path | str,
    map_location: str | torch.device = "cpu",
    *,
    compile: bool = False,  # noqa: A002
    trust_code: bool | None = None,
) -> LoadedCheckpoint:
    """Restore the network of a posformer checkpoint (the layout in the module docstring).

    The model is built from ``hyper_parameters.model`` and takes the ``state_dict`` entries under
    ``model.`` (every one of them: a mismatch is a :class:`CheckpointError`). The data config and seed
    come from the checkpoint (``hyper_parameters.data.config`` / ``.seed``), else (older checkpoints) from
    the run directory's ``config.yaml`` (``<run>/checkpoints/x.ckpt`` -> ``<run>/config.yaml``), else from
    the saved data facts. ``compile``: apply the checkpoint's recorded
    ``torch.compile`` settings (``hyper_parameters.compile``), as its LightningModule would.

    The checkpoint is data: a ``module:Class`` PE is imported only when trusted
    (:func:`~posformer.lit.checkpoint.check_pe_trusted`; ``trust_code=None``: when the command line
    names it or sets ``trust_checkpoint_code=true``), and a saved data ``cache_dir`` outside the run
    dir is replaced by the default cache (:func:`_confined_data_config`).
    """
    path = Path(path)
    ckpt = read_checkpoint(path, map_location)  # weights_only=True; missing/corrupt -> CheckpointError
    hp = dict(ckpt.get("hyper_parameters") or {})
    model_cfg = saved_model_config(ckpt, path)
    saved_data = dict(hp.get("data") or {})
    saved_cfg = saved_data.pop("config", None)
    saved_seed = saved_data.pop("seed", None)
    run_cfg = {} if saved_cfg else load_run_config(path.resolve().parent.parent) or {}
    data_cfg = dict(saved_cfg or run_cfg.get("data") or saved_data)
    seed = int(saved_seed if saved_seed is not None else run_cfg.get("seed") or hp.get("seed") or 0)
    if train_length(data_cfg) is None and train_length(saved_data) is not None:
        data_cfg["train_length"] = train_length(saved_data)
    data_cfg = _run_tokenizer(_confined_data_config(data_cfg, path), path)
    check_pe_trusted(model_cfg.get("pe"), path, trust_code)  # a module:Class PE: imported only if trusted
    known = set(ModelConfig.__dataclass_fields__)
    mc = ModelConfig(**{k: v for k, v in model_cfg.items() if k in known})
    model = build_model(mc)
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODEL_PREFIX)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model built from its config: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}."
        )
    if compile:
        options = compile_options(hp.get("compile"))
        if options is not None:
            model.compile(**options)
    model.eval()
    return LoadedCheckpoint(str(path), model, mc.to_dict(), data_cfg, seed, hp)


def _confined_data_config(data_cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The checkpoint's data config with every directory posformer would *write* to (``cache_dir``) kept
    only when it lies inside the checkpoint's run dir; elsewhere the default cache
    (``$POSFORMER_CACHE`` or ``~/.cache/posformer``) is used instead (``eval.data={cache_dir: ...}``
    chooses another)."""
    run_dir = path.resolve().parent.parent
    out = dict(data_cfg)
    for key in WRITE_DIRS:
        value = out.get(key)
        if value is None:
            continue
        inside = isinstance(value, str) and Path(os.path.realpath(value)).is_relative_to(run_dir)
        if not inside:
            out[key] = str(default_cache_dir())
    return out


def _run_tokenizer(data_cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """A pretrained ``data.tokenizer`` read from the run's own copy (``<run>/tokenizer``, saved at
    training) when there is one: evaluation needs neither the original file nor the hub."""
    saved = path.resolve().parent.parent / "tokenizer"
    value = data_cfg.get("tokenizer")
    if isinstance(value, str) and value not in TOKENIZERS and (saved / "pretrained.json").is_file():
        return {**data_cfg, "tokenizer": str(saved)}
    return data_cfg


def check_same_data(ck: LoadedCheckpoint, dm: Any, overrides: Mapping[str, Any] | None = None) -> None:
    """Evaluation data that is not what the checkpoint was trained on (its recorded data fingerprint,
    :func:`~posformer.lit.checkpoint.check_data_fingerprint`): refused when nothing asked for other data
    (an edited data file would be scored with shifted token ids), one warning line when ``eval.data``
    overrides chose it. Another tokenizer (:func:`~posformer.lit.checkpoint.tokenizer_mismatch`) is
    refused either way: its ids are not the ones the model learned."""
    other_tokenizer = tokenizer_mismatch(ck.hparams.get("data") or {}, dm, ck.path, doing="evaluate")
    if other_tokenizer:
        raise CheckpointError(f"{other_tokenizer} (or drop the eval.data override of data.tokenizer).")
    line = check_data_fingerprint(ck.hparams.get("data") or {}, dm, ck.path, doing="evaluate")
    if line is None:
        return
    if overrides:
        log.warning("%s; evaluating anyway, as eval.data=%s asks.", line, dict(overrides))
        return
    raise CheckpointError(
        f"{line} (restore the data file), or say that other data is meant with an eval.data override "
        "(then this is a warning)."
    )


# ---------------------------------------------------------------------------------------------- finding
def find_checkpoints(sweep_dir: Path | str, which: str = "best") -> list[Path]:
    """One checkpoint per run under ``sweep_dir`` (found by globbing ``**/checkpoints/*.ckpt``).

    ``which="last"``: each run's ``last.ckpt`` (or its newest file); ``"best"``: the best model path
    recorded by Lightning's ``ModelCheckpoint`` in the run's checkpoints, if that file exists, else the
    newest non-``last`` checkpoint, else ``last.ckpt``.
    """
    if which not in ("best", "last"):
        raise ConfigError(f"eval.which={which!r}; valid: best, last.")
    root = Path(sweep_dir)
    if not root.is_dir():
        raise CheckpointError(f"eval.sweep_dir={str(root)!r} is not a directory.")
    runs: dict[Path, list[Path]] = {}
    for path in sorted(root.glob("**/checkpoints/*.ckpt")):
        runs.setdefault(path.parent, []).append(path)
    if not runs:
        raise CheckpointError(f"no checkpoints (**/checkpoints/*.ckpt) under eval.sweep_dir={str(root)!r}.")
    chosen = []
    for files in runs.values():
        last = [f for f in files if f.name.startswith("last")]
        others = sorted((f for f in files if not f.name.startswith("last")), key=lambda f: f.stat().st_mtime)
        if which == "last":
            chosen.append(last[0] if last else max(files, key=lambda f: f.stat().st_mtime))
            continue
        best = recorded_best(last[0] if last else others[-1])
        if best is not None and best.exists():
            chosen.append(best)
        else:
            chosen.append(others[-1] if others else last[0])
    return chosen


def recorded_best(path: Path) -> Path | None:
    """The file name of the ``best_model_path`` that ``ModelCheckpoint`` recorded in checkpoint ``path``,
    in ``path``'s directory (never elsewhere); ``None`` if unreadable or absent."""
    try:
        ckpt = safe_load_checkpoint(path, verify=False)  # weights_only=True: never runs code
    except Exception:
        return None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if "ModelCheckpoint" in str(key) and isinstance(state, dict) and state.get("best_model_path"):
            # only ever a file next to `path`: a recorded path is data and may point anywhere
            return path.parent / Path(str(state["best_model_path"])).name
    return None


def pick_run_checkpoint(run_dir: Path, which: str) -> Path:
    """The checkpoint of one training run: ``last`` -> ``checkpoints/last.ckpt`` if present; else (and
    for ``best``) the lowest ``val_loss<x>`` in the file names, else the last file by name."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise CheckpointError(
            f"{str(run_dir)!r} has no checkpoints/ directory; pass eval.checkpoint=<.ckpt>."
        )
    if which == "last" and (ckpt_dir / "last.ckpt").is_file():
        return ckpt_dir / "last.ckpt"
    scored = []
    for f in ckpt_dir.glob("*.ckpt"):
        m = re.search(r"val_loss([0-9.]+?)\.ckpt$", f.name)
        if m:
            scored.append((float(m.group(1)), f))
    if scored:
        return min(scored)[1]
    files = sorted(ckpt_dir.rglob("*.ckpt"))
    if not files:
        raise CheckpointError(f"no .ckpt files under {str(ckpt_dir)!r}.")
    return files[-1]


def last_checkpoints(directory: str | Path, n: int, up_to_step: int | None = None) -> list[Path]:
    """The ``n`` checkpoints of ``directory`` (recursively) with the highest training step, oldest first.

    ``last.ckpt`` (Lightning's copy of the newest checkpoint) is skipped when other checkpoints
    exist, and so is any checkpoint whose step another one already has. ``up_to_step``: only
    checkpoints at or before that step (to compare runs at an equal number of updates).
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist.")
    if n < 1:
        raise CheckpointError(f"average the last n={n} checkpoints: n must be >= 1.")
    files = sorted(d.rglob("*.ckpt"))
    named = [f for f in files if not f.name.startswith("last")] or files
    by_step: dict[int, Path] = {}
    for f in named:
        by_step.setdefault(checkpoint_step(f), f)
    if not by_step:
        raise CheckpointError(f"no .ckpt files under {str(d)!r}.")
    steps = sorted(by_step)
    if up_to_step is not None:
        steps = [s for s in steps if s <= up_to_step]
    if len(steps) < n:
        where = f" at or before step {up_to_step}" if up_to_step is not None else ""
        raise CheckpointError(
            f"asked to average the last {n} checkpoints{where}, but {str(d)!r} holds {len(steps)} distinct "
            f"ones (steps {sorted(by_step)}); lower the count or save more often "
            "(callbacks.periodic_checkpoint)."
        )
    return [by_step[s] for s in steps[-n:]]
