"""Shared pieces of every datamodule: config checking, resumable sampling, the base class.

Hints that name the right environment variable
----------------------------------------------
A data value may come from the environment through the composed config (``data=text``: ``path:
${oc.env:POSFORMER_TEXT,null}``; ``experiment=lm_shakespeare``: ``${paths.data_dir}/...`` with
``paths.data_dir: ${oc.env:POSFORMER_DATA,...}``). A datamodule raises its error tagged with the key
(:func:`tag_key`); :func:`env_hint` follows that key's interpolations in the *unresolved* config and
``posformer.data.build_datamodule`` appends the variable that actually sets it, so a hint never names
a variable the composed config does not read.

Exact resume
------------
The training order is a pure function of ``(shuffle_seed, epoch)``: the train loader's sampler is a
:class:`ResumableSampler`, and Lightning calls its ``set_epoch`` at every epoch start (it looks at
``loader.sampler``, also through ``posformer.lit.data.ResumableLoader``, which forwards attributes).
The mid-epoch position (batches consumed) is restored by the training layer's
``posformer.lit.data.ResumableLoader`` wrapper (Lightning's stateful-loader protocol), which skips the
consumed batches of the restored epoch. The datamodule therefore keeps *no* position of its own in
checkpoints (two mechanisms would skip twice). Without Lightning, call ``set_position(epoch, batch)``
before ``train_dataloader()``: the loader then starts at that epoch and skips ``batch`` batches in the
sampler (no data is loaded for them).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from posformer.data.tokenizers import (  # the ids every tokenizer reserves
    PAD_ID,
    save_tokenizer_dir,
)
from posformer.errors import ConfigError


# --------------------------------------------------------------------------------------------- config
def to_plain_dict(data_cfg: Any) -> dict[str, Any]:
    """A DictConfig (resolved) or mapping -> a plain dict; a missing ``???`` value -> ConfigError."""
    if data_cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import MissingMandatoryValue

        if isinstance(data_cfg, DictConfig):
            try:
                return dict(OmegaConf.to_container(data_cfg, resolve=True, throw_on_missing=True))  # type: ignore[arg-type]
            except MissingMandatoryValue as exc:
                key = getattr(exc, "full_key", None) or str(exc)
                raise ConfigError(
                    f"data config value {key!r} is required but missing ('???'); set it on the command line, "
                    f"e.g. data.{str(key).split('.')[-1]}=..."
                ) from None
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(data_cfg, Mapping):
        raise ConfigError(f"data config must be a mapping, got {type(data_cfg).__name__}.")
    return dict(data_cfg)


_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")
_NODE_REF = re.compile(r"\$\{([A-Za-z_][\w.]*)\}/?(.*)")


def tag_key(exc: Exception, key: str) -> Exception:
    """Mark ``exc`` as being about ``data.<key>`` (for :func:`env_hint`); returns ``exc``."""
    exc.data_key = key  # type: ignore[attr-defined]
    return exc


def _raw(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree


def env_source(data_cfg: Any, key: str) -> tuple[str, str] | None:
    """``(VARIABLE, rest)`` when ``data.<key>`` of a composed DictConfig is read from an environment
    variable, directly or through other config nodes; ``rest`` is the part of the value appended to
    the variable (``"tinyshakespeare/input.txt"``; ``""`` when the variable is the whole value)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(data_cfg, DictConfig):
            return None
        root = data_cfg._get_root()
        tree = OmegaConf.to_container(root, resolve=False)
        prefix = data_cfg._get_full_key(None)  # "data" for cfg.data
        raw = _raw(tree, f"{prefix}.{key}" if prefix else key)
    except Exception:  # noqa: BLE001 - a hint is optional; never fail the run over it
        return None
    rest = ""
    for _ in range(8):  # follow ${a.b}/rest chains: ${paths.data_dir}/x -> ${oc.env:POSFORMER_DATA,...}
        if not isinstance(raw, str):
            return None
        env = _ENV_REF.match(raw)
        if env:
            return env.group(1), rest
        ref = _NODE_REF.fullmatch(raw)
        if not ref:
            return None
        rest = "/".join(p for p in (ref.group(2), rest) if p)
        raw = _raw(tree, ref.group(1))
    return None


def env_hint(data_cfg: Any, key: str) -> str:
    """The sentence to append to an error about ``data.<key>`` naming the variable that sets it."""
    source = env_source(data_cfg, key)
    if source is None:
        return ""
    var, rest = source
    target = f"the folder that holds {rest}" if rest else "the file"
    value = os.environ.get(var)
    if value:
        return f" This value comes from {var}={value}: point {var} at {target}, or override data.{key}."
    return f" Or set the {var} environment variable to {target} (this config reads data.{key} from it)."


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """A value that arrives at call time (an evaluation length, a resume position) as an integer
    ``>= minimum``; the config's options are checked by :mod:`posformer.data.options`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"data.{name}={value!r} must be an integer >= {minimum}.")
    return int(value)


def eval_batch_size(length: int, token_budget: int, max_batch: int) -> int:
    """Batch size for evaluation at ``length`` tokens: keeps ``B * length`` near ``token_budget``."""
    return max(1, min(max_batch, token_budget // max(1, length)))


# ------------------------------------------------------------------------------------------- sampling
#: up to this many samples an epoch's order is one ``torch.randperm`` (8 bytes a sample); above it, a
#: keyed permutation computed in blocks (:func:`feistel_order`), so memory does not grow with the corpus
RANDPERM_LIMIT = 1 << 24
#: indices handed out per block when iterating an order
ORDER_BLOCK = 1 << 16


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    """A bijection of ``[0, 2 ** (2 * half))`` (uint64 ``x``): four rounds of a keyed Feistel network."""
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        mixed = (right * np.uint64(0x9E3779B97F4A7C15) + key) & np.uint64(0xFFFFFFFFFFFFFFFF)
        mixed ^= mixed >> np.uint64(29)
        left, right = right, left ^ (mixed & mask)
    return (left << np.uint64(half)) | right


def feistel_order(n: int, state: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Positions ``start..stop`` of a random permutation of ``range(n)`` keyed by ``state`` (uint32s),
    computed without the rest of it (cycle walking over a Feistel bijection of the next power of 4)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    keys = np.array([int(state[i % len(state)]) * 0x100000001 + i for i in range(4)], dtype=np.uint64)
    out = _feistel(np.arange(start, stop, dtype=np.uint64), keys, half)
    while (over := out >= np.uint64(n)).any():
        out[over] = _feistel(out[over], keys, half)
    return out.astype(np.int64)


class ResumableSampler(Sampler[int]):
    """Index order that is a pure function of ``(seed, epoch)``, with an optional one-shot skip.

    Lightning calls ``set_epoch`` at every epoch start (it looks at ``dataloader.sampler``).
    ``skip`` (in samples) applies to the next iteration only. ``len`` is always the full epoch, so
    Lightning's batch accounting stays right on resume. Up to :data:`RANDPERM_LIMIT` samples the order
    is ``torch.randperm``; above, :func:`feistel_order` (a token store of billions of tokens has
    millions of windows: their order is computed a block at a time).
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True, epoch: int = 0, skip: int = 0) -> None:
        self.n = int(n)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = int(epoch)
        self.skip = int(skip)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _state(self, epoch: int) -> np.ndarray:
        return np.random.SeedSequence([self.seed & 0xFFFFFFFF, int(epoch), 0x5EED]).generate_state(2)

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The whole epoch's order ``(n,)`` (for inspection and tests; iteration computes it in blocks
        above :data:`RANDPERM_LIMIT`)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.n)
        state = self._state(epoch)
        if self.n > RANDPERM_LIMIT:
            return torch.from_numpy(feistel_order(self.n, state, 0, self.n))
        g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        if self.shuffle and self.n > RANDPERM_LIMIT:
            state = self._state(self.epoch)
            for start in range(skip, self.n, ORDER_BLOCK):
                yield from feistel_order(self.n, state, start, min(self.n, start + ORDER_BLOCK)).tolist()
            return
        order = self.order()
        for start in range(skip, self.n, ORDER_BLOCK):
            yield from order[start : start + ORDER_BLOCK].tolist()

    def __len__(self) -> int:
        return self.n


# ------------------------------------------------------------------------------------------ the module
class BaseDataModule(L.LightningDataModule):
    """Common API of posformer datamodules (see docs/design.md, "Data → training contract").

    Subclasses set ``vocab_size``, ``pad_id``, ``task_type``, ``train_length``, ``batch_size``,
    ``num_workers``, ``shuffle_seed`` and implement ``train_dataset()``, ``collate``,
    ``val_dataloader``, ``eval_dataloaders``, ``decode`` and ``config_summary``.
    """

    task_type: str = "task"
    pad_id: int = PAD_ID
    vocab_size: int
    train_length: int
    batch_size: int
    num_workers: int = 0
    shuffle_seed: int = 0
    drop_last: bool = False
    #: packed training rows (``data.pack=true``): ``train_dataset()`` yields dicts of (T,) tensors
    pack: bool = False

    def __init__(self) -> None:
        super().__init__()
        self._resume_epoch = 0
        self._resume_batch = 0

    # ---- to implement
    def train_dataset(self) -> Any:
        raise NotImplementedError

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode(self, ids: Any) -> str:
        raise NotImplementedError

    def config_summary(self) -> dict[str, Any]:
        raise NotImplementedError

    def eval_dataloaders(self, lengths: list[int] | None = None) -> dict[int, DataLoader]:
        raise NotImplementedError

    # ---- shared
    def _loader(
        self, dataset: Any, batch_size: int, sampler: Sampler[int] | None = None, collate: Any = None
    ) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            shuffle=False,
            drop_last=self.drop_last if sampler is not None else False,
            collate_fn=collate or self.collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pins_memory(),
        )

    def pins_memory(self) -> bool:
        """Whether batches are put in page-locked memory: when the attached trainer runs on CUDA, so
        that Lightning's non-blocking copy to the GPU is asynchronous (from pageable memory the host
        copies the batch itself first)."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def num_train_batches(self) -> int:
        n = len(self.train_dataset())
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def train_dataloader(self) -> DataLoader:
        """Shuffled, resumable: order = f(shuffle_seed, epoch); starts at the restored position."""
        dataset = self.train_dataset()
        sampler = ResumableSampler(
            len(dataset),
            seed=self.shuffle_seed,
            shuffle=True,
            epoch=self._resume_epoch,
            skip=self._resume_batch * self.batch_size,
        )
        self._resume_batch = 0  # one-shot
        # packed rows (posformer.data.packing) are dicts of equal-length tensors: stacked as they are
        return self._loader(dataset, self.batch_size, sampler, default_collate if self.pack else None)

    def run_tokenizer(self) -> Any:
        """The tokenizer a run needs to be reused (``posformer.data.tokenizers``); None: no tokenizer
        (e.g. synthetic tasks, whose symbols follow from the config)."""
        return None

    def tokenizer_info(self) -> dict[str, Any]:
        """Extra fields of ``tokenizer/meta.json`` (where the tokenizer was trained)."""
        return {}

    def save_tokenizer(self, run_dir: str | os.PathLike[str]) -> Path | None:
        """Write the run's tokenizer into ``<run_dir>/tokenizer/`` (its files + ``meta.json``, each
        atomically), so the run is reusable without the data cache; returns that folder, or None
        when the data has no tokenizer. Read it back with ``posformer.data.load_tokenizer_dir``."""
        tok = self.run_tokenizer()
        if tok is None:
            return None
        return save_tokenizer_dir(tok, Path(run_dir) / "tokenizer", **self.tokenizer_info())

    def set_position(self, epoch: int, batch: int = 0) -> None:
        """Make the next ``train_dataloader()`` start at ``epoch``, skipping its first ``batch`` batches."""
        self._resume_epoch = check_int("resume epoch", epoch, 0)
        self._resume_batch = check_int("resume batch", batch, 0)
