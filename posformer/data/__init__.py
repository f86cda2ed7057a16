"""Datasets and datamodules (see docs/design.md, "Data → training contract").

``build_datamodule(data_cfg, model_kind, seed)`` picks a builder from :data:`DATASETS` by
``data_cfg["name"]``; builders have the signature ``(cfg: dict, model_kind: str, seed: int) ->
LightningDataModule``. Add one with :func:`register_dataset`.

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

from collections.abc import Callable
from typing import Any

import lightning as L

from posformer.data.base import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    PAD_ID,
    SEP_ID,
    BaseDataModule,
    ResumableSampler,
    env_hint,
    to_plain_dict,
)
from posformer.data.tokenizers import load_tokenizer_dir
from posformer.errors import ConfigError, PosformerError

Builder = Callable[[dict[str, Any], str, int], L.LightningDataModule]


def _synthetic(cfg: dict[str, Any], model_kind: str, seed: int) -> L.LightningDataModule:
    from posformer.data.synthetic import SyntheticDataModule

    return SyntheticDataModule(cfg, model_kind, seed)


def _text(cfg: dict[str, Any], model_kind: str, seed: int) -> L.LightningDataModule:
    from posformer.data.text import TextDataModule

    return TextDataModule(cfg, model_kind, seed)


def _hub(cfg: dict[str, Any], model_kind: str, seed: int) -> L.LightningDataModule:
    from posformer.data.hub import HubDataModule

    return HubDataModule(cfg, model_kind, seed)


def _corpus(cfg: dict[str, Any], model_kind: str, seed: int) -> L.LightningDataModule:
    from posformer.data.corpus import CorpusDataModule

    return CorpusDataModule(cfg, model_kind, seed)


DATASETS: dict[str, Builder] = {"synthetic": _synthetic, "text": _text, "hub": _hub, "corpus": _corpus}


def register_dataset(name: str, builder: Builder, overwrite: bool = False) -> None:
    """Make ``data.name=<name>`` build with ``builder(cfg, model_kind, seed)``."""
    if name in DATASETS and not overwrite and DATASETS[name] is not builder:
        raise ConfigError(f"dataset {name!r} is already registered; pass overwrite=True to replace it.")
    DATASETS[name] = builder


def _ensure_plugins() -> None:
    """Import optional dataset modules that register themselves (posformer/data/translation.py)."""
    try:
        import posformer.data.translation  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "posformer.data.translation":
            raise


def build_datamodule(data_cfg: Any, model_kind: str, seed: int) -> L.LightningDataModule:
    """Build the datamodule named by ``data_cfg["name"]`` (a dict or DictConfig from configs/data)."""
    cfg = to_plain_dict(data_cfg)
    name = cfg.get("name", "synthetic")
    if name not in DATASETS:
        _ensure_plugins()
    if name not in DATASETS:
        raise ConfigError(f"data.name={name!r} is unknown; valid: {', '.join(sorted(DATASETS))}.")
    try:
        return DATASETS[name](cfg, model_kind, int(seed))
    except PosformerError as exc:  # about a value the config may read from the environment: say which
        hint = env_hint(data_cfg, exc.data_key) if getattr(exc, "data_key", None) else ""
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
