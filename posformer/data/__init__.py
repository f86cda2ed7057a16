"""Datasets and datamodules (see docs/design.md, "Data → training contract").

``build_datamodule(data_cfg, model_kind, seed)`` builds the datamodule :data:`DATASETS` (the one table
of datasets, :mod:`posformer.data.options`) names for ``data_cfg`` (its options, or a mapping with
``name``). Add one with :func:`register_dataset`: a builder ``(cfg, model_kind, seed) ->
LightningDataModule`` that checks its own options.

Seeds: ``data_cfg["seed"]`` (default ``${seed}``) fixes the generated/split data; the ``seed`` argument
(the run seed) fixes the training order. Set ``data.seed`` explicitly to keep the data fixed while
varying the run seed.

Modules: ``base`` (config checks, resumable sampler, the base class), ``files`` (reading, gzip,
UTF-8, parallel text), ``tokenizers`` (char/byte/BPE, a run's ``tokenizer/`` folder), ``synthetic``,
``lm`` (token streams -> windows, the stream cache), ``text`` (``data=text``), ``hub`` (``data=hub``
and hub translation splits), ``parallel`` (tokenised sentence pairs, token-based batching),
``translation`` (``data.name=translation``).

A run's tokenizer: the training flow calls ``dm.save_tokenizer(run_dir)`` (writes
``<run_dir>/tokenizer/``); :func:`load_tokenizer_dir` reads it back.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import lightning as L

from posformer.data.base import BaseDataModule, ResumableSampler, env_hint, to_plain_dict
from posformer.data.options import DATASETS, Dataset
from posformer.data.tokenizers import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, SEP_ID, load_tokenizer_dir
from posformer.errors import ConfigError, PosformerError

Builder = Callable[[Any, str, int], L.LightningDataModule]


def register_dataset(name: str, builder: Builder, overwrite: bool = False) -> None:
    """Make ``data.name=<name>`` build with ``builder(cfg, model_kind, seed)``."""
    known = DATASETS.get(name)
    if known is not None and not overwrite and known.datamodule is not builder:
        raise ConfigError(f"dataset {name!r} is already registered; pass overwrite=True to replace it.")
    DATASETS[name] = Dataset(None, builder)


def build_datamodule(data_cfg: Any, model_kind: str, seed: int, source: Any = None) -> L.LightningDataModule:
    """The datamodule of ``data_cfg``: a dataset's options (:mod:`posformer.data.options`), or a mapping
    (a dict or DictConfig from configs/data) with its ``name``. ``source``: the composed ``data`` node the
    options were read from (its error about a value read from the environment names the variable)."""
    cfg = data_cfg if dataclasses.is_dataclass(data_cfg) else to_plain_dict(data_cfg)
    name = cfg.name if dataclasses.is_dataclass(cfg) else cfg.get("name", "synthetic")
    if name not in DATASETS:
        raise ConfigError(f"data.name={name!r} is unknown; valid: {', '.join(sorted(DATASETS))}.")
    builder = DATASETS[name].datamodule
    if isinstance(builder, str):
        module, _, cls = builder.partition(":")
        builder = getattr(importlib.import_module(module), cls)
    try:
        return builder(cfg, model_kind, int(seed))
    except PosformerError as exc:  # about a value the config may read from the environment: say which
        where = data_cfg if source is None else source
        hint = env_hint(where, exc.data_key) if getattr(exc, "data_key", None) else ""
        if not hint:
            raise
        raise type(exc)(f"{exc}{hint}") from None


def batch_width(batch: Any) -> int:
    """Longest position count a batch needs (decoder input, or max of source and target)."""
    widths = [batch[k].shape[1] for k in ("input_ids", "src_ids", "tgt_ids") if k in batch]
    return max(widths) if widths else 0


__all__ = [
    "BOS_ID",
    "DATASETS",
    "EOS_ID",
    "IGNORE_INDEX",
    "PAD_ID",
    "SEP_ID",
    "BaseDataModule",
    "ResumableSampler",
    "batch_width",
    "build_datamodule",
    "load_tokenizer_dir",
    "register_dataset",
]
