"""Language modelling from a local text file (``data=text``) or an HF hub dataset (``data=hub``).

Pipeline: read the text (``datasets.load_dataset("text", ...)`` with line breaks kept, or a hub dataset's
text column) -> split off the last ``val_fraction`` of the characters as validation (hub: its
validation split when it has one) -> train the tokenizer on the training part (``char``: vocabulary of
the whole file) -> encode both parts into flat token streams -> cache them (``train.npy``,
``val.npy``, the tokenizer files, ``meta.json``) under ``<cache_dir>/text/<key>``, where ``key``
hashes everything that changes the streams: the file's absolute path, mtime and size (hub: dataset,
config, revision, splits, column), the tokenizer and its vocabulary size, ``val_fraction`` and
``encoding_errors``. Block size and evaluation lengths only change how the streams are cut, so they
are not part of the key.

Batches (decoder-only): ``input_ids``/``labels`` are a window of ``L + 1`` tokens shifted by one (every
position scored), ``attention_mask`` all True. Training: non-overlapping blocks of ``block_size``
(windows start every ``block_size`` tokens). ``eval_chunks(L, n_tokens)``: ``n_tokens // L``
non-overlapping windows from the start of the validation stream, so every length scores the same
tokens (when ``n_tokens`` is a multiple of the lengths). Non-UTF-8 input: with ``encoding_errors:
strict`` (default) a DataError reports the byte offset of the first bad byte; ``replace`` decodes it
as U+FFFD and warns.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from posformer.data.base import (
    BaseDataModule,
    check_int,
    check_model_kind,
    eval_batch_size,
    take_options,
)
from posformer.data.tokenizers import TOKENIZERS, load_tokenizer, train_tokenizer
from posformer.errors import ConfigError, DataError

CACHE_VERSION = 1

COMMON_DEFAULTS: dict[str, Any] = {
    "tokenizer": "char",  # char | byte | bpe
    "vocab_size": 4096,  # bpe only
    "block_size": 256,  # training length (tokens per training window)
    "val_fraction": 0.1,
    "eval_lengths": [64, 128, 256, 512, 1024],
    "eval_tokens": 16384,  # scored tokens per evaluation length
    "val_tokens": None,  # cap on validation tokens scored by val_dataloader (None: all)
    "batch_size": 32,
    "eval_batch_size": None,  # default batch_size, shrunk at long lengths (same tokens per batch)
    "num_workers": 0,
    "encoding_errors": "strict",  # strict | replace
    "seed": None,  # data seed; None: the run seed
    "cache_dir": None,
}
TEXT_DEFAULTS: dict[str, Any] = {**COMMON_DEFAULTS, "path": None}
HUB_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "dataset": None,
    "config": None,
    "revision": None,
    "text_column": "text",
    "train_split": "train",
    "val_split": "validation",  # None: the last val_fraction of the training split
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("POSFORMER_CACHE", Path.home() / ".cache" / "posformer"))


def resolve_user_path(path: str | os.PathLike[str]) -> Path:
    """Relative paths are relative to where the command was started (also under Hydra)."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_absolute():
        try:
            from hydra.core.hydra_config import HydraConfig
            from hydra.utils import to_absolute_path

            if HydraConfig.initialized():
                return Path(to_absolute_path(str(p)))
        except ImportError:  # pragma: no cover
            pass
    return p.resolve()


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _decode_bytes(raw: bytes, where: str, errors: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if errors == "replace":
            warnings.warn(
                f"{where}: not valid UTF-8 (first bad byte at offset {exc.start}); undecodable bytes were "
                "replaced by U+FFFD (data.encoding_errors=replace).",
                stacklevel=3,
            )
            return raw.decode("utf-8", errors="replace")
        raise DataError(
            f"{where} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} ({exc.reason}). "
            "Convert the file (e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`) or set "
            "data.encoding_errors=replace to decode bad bytes as U+FFFD."
        ) from None


# ----------------------------------------------------------------------------------------- datasets
class WindowDataset(Dataset):
    """``count`` windows of ``length + 1`` tokens from ``stream``, starting every ``length`` tokens."""

    def __init__(self, stream: np.ndarray, length: int, count: int | None = None) -> None:
        self.stream, self.length = stream, int(length)
        available = max(0, (len(stream) - 1) // self.length)
        self.count = available if count is None else min(int(count), available)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = i * self.length
        return np.asarray(self.stream[start : start + self.length + 1], dtype=np.int64)


def collate_lm(rows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Windows of ``T + 1`` tokens -> input_ids (B, T), labels (B, T) shifted by one, attention_mask."""
    x = torch.from_numpy(np.stack(rows))
    inputs = x[:, :-1].contiguous()
    return {
        "input_ids": inputs,
        "labels": x[:, 1:].contiguous(),
        "attention_mask": torch.ones_like(inputs, dtype=torch.bool),
    }


# ------------------------------------------------------------------------------------------ module
class LMDataModule(BaseDataModule):
    """Shared by ``data=text`` and ``data=hub``: token streams -> windows."""

    task_type = "lm"
    name = "lm"
    defaults: dict[str, Any] = COMMON_DEFAULTS

    def __init__(self, cfg: dict[str, Any], model_kind: str, seed: int) -> None:
        super().__init__()
        o = take_options(cfg, self.defaults, f"data={self.name}")
        check_model_kind(model_kind, ("decoder",), self.name)
        if o["tokenizer"] not in TOKENIZERS:
            raise ConfigError(
                f"data.tokenizer={o['tokenizer']!r} is unknown; valid: {', '.join(TOKENIZERS)}."
            )
        if o["encoding_errors"] not in ("strict", "replace"):
            raise ConfigError(f"data.encoding_errors={o['encoding_errors']!r}; valid: strict, replace.")
        frac = o["val_fraction"]
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
            raise ConfigError(f"data.val_fraction={frac!r} must be a number in (0, 1), e.g. 0.1.")
        self.block_size = check_int("block_size", o["block_size"])
        self.batch_size = check_int("batch_size", o["batch_size"])
        self._eval_batch = (
            check_int("eval_batch_size", o["eval_batch_size"]) if o["eval_batch_size"] else None
        )
        self.num_workers = check_int("num_workers", o["num_workers"], 0)
        self.eval_tokens = check_int("eval_tokens", o["eval_tokens"])
        self.val_tokens = check_int("val_tokens", o["val_tokens"]) if o["val_tokens"] else None
        self.eval_lengths = sorted({check_int("eval_lengths[]", v) for v in (o["eval_lengths"] or [])}) or [
            self.block_size
        ]
        if o["tokenizer"] == "bpe":
            check_int("vocab_size", o["vocab_size"])
        self.options = o
        self.shuffle_seed = int(seed)
        self.data_seed = int(o["seed"] if o["seed"] is not None else seed)
        self.cache_root = Path(o["cache_dir"]).expanduser() if o["cache_dir"] else default_cache_dir()
        self.train_length = self.block_size
        self.pad_id = 0
        self.collate = collate_lm
        self.cache_path = self.cache_root / "text" / _hash(self.cache_key())
        self._load_or_build()
        self.vocab_size = self.tokenizer.vocab_size
        n_train_blocks = (len(self.train_stream) - 1) // self.block_size
        if n_train_blocks < 1:
            raise DataError(
                f"{self.source_name()}: the training split has {len(self.train_stream)} tokens, fewer than "
                f"block_size + 1 = {self.block_size + 1}; use a longer text or a smaller data.block_size."
            )
        if (len(self.val_stream) - 1) // self.block_size < 1:
            raise DataError(
                f"{self.source_name()}: the validation split has {len(self.val_stream)} tokens, fewer than "
                f"block_size + 1 = {self.block_size + 1}; raise data.val_fraction or lower data.block_size."
            )
        self._train = WindowDataset(self.train_stream, self.block_size)

    # ---- to implement
    def source_key(self) -> dict[str, Any]:
        raise NotImplementedError

    def source_name(self) -> str:
        raise NotImplementedError

    def read_splits(self) -> tuple[str, str]:
        """(train text, val text)."""
        raise NotImplementedError

    # ---- cache
    def cache_key(self) -> dict[str, Any]:
        o = self.options
        return {
            "version": CACHE_VERSION,
            "source": self.source_key(),
            "tokenizer": o["tokenizer"],
            "vocab_size": o["vocab_size"] if o["tokenizer"] == "bpe" else None,
            "val_fraction": float(o["val_fraction"]),
            "encoding_errors": o["encoding_errors"],
        }

    def _load_or_build(self) -> None:
        path = self.cache_path
        if not (path / "meta.json").exists():
            self._build(path)
        meta = json.loads((path / "meta.json").read_text())
        self.meta = meta
        self.tokenizer = load_tokenizer(meta["tokenizer"], path)
        self.train_stream = np.load(path / "train.npy", mmap_mode="r")
        self.val_stream = np.load(path / "val.npy", mmap_mode="r")

    def _build(self, path: Path) -> None:
        start = time.time()
        train_text, val_text = self.read_splits()
        if not train_text:
            raise DataError(f"{self.source_name()}: the training split is empty.")
        if not val_text:
            raise DataError(
                f"{self.source_name()}: the validation split is empty; "
                "raise data.val_fraction or use more text."
            )
        o = self.options
        vocab_text = train_text + val_text if o["tokenizer"] == "char" else train_text
        tok = train_tokenizer(o["tokenizer"], vocab_text, int(o["vocab_size"]))
        dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
        train_ids = tok.encode(train_text).astype(dtype)
        val_ids = tok.encode(val_text).astype(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp", dir=path.parent))
        try:
            tok.save(tmp)
            np.save(tmp / "train.npy", train_ids)
            np.save(tmp / "val.npy", val_ids)
            meta = {
                "key": self.cache_key(),
                "tokenizer": tok.kind,
                "vocab_size": tok.vocab_size,
                "train_tokens": len(train_ids),
                "val_tokens": len(val_ids),
                "train_chars": len(train_text),
                "val_chars": len(val_text),
                "build_seconds": round(time.time() - start, 2),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                tmp.rename(path)
            except OSError:  # another process built it meanwhile
                if not (path / "meta.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- loaders
    def train_dataset(self) -> WindowDataset:
        return self._train

    def val_dataloader(self) -> DataLoader:
        count = None if self.val_tokens is None else max(1, self.val_tokens // self.block_size)
        return self._loader(
            WindowDataset(self.val_stream, self.block_size, count), self._eval_batch or self.batch_size
        )

    def eval_chunks(self, length: int, n_tokens: int | None = None) -> WindowDataset:
        """``n_tokens // length`` non-overlapping windows of ``length`` scored tokens from the validation
        stream (``n_tokens`` default: ``eval_tokens``, capped by the stream)."""
        length = check_int("eval length", length)
        n_tokens = self.eval_tokens if n_tokens is None else check_int("n_tokens", n_tokens)
        available = len(self.val_stream) - 1
        if available < length:
            raise DataError(
                f"evaluation length {length} needs {length + 1} validation tokens but "
                f"{self.source_name()} has "
                f"{len(self.val_stream)}; evaluate shorter lengths or raise data.val_fraction."
            )
        return WindowDataset(self.val_stream, length, max(1, min(n_tokens, available) // length))

    def eval_dataloaders(self, lengths: list[int] | None = None) -> dict[int, DataLoader]:
        """One loader per length, all scoring the same number of tokens where the stream allows it:
        ``n = min(eval_tokens, val tokens - 1)`` rounded down to a multiple of the longest length."""
        lengths = sorted(
            {check_int("eval length", v) for v in (lengths if lengths is not None else self.eval_lengths)}
        )
        available = len(self.val_stream) - 1
        n = min(self.eval_tokens, available)
        if n >= lengths[-1]:
            n -= n % lengths[-1]
        base = self._eval_batch or self.batch_size
        out = {}
        for length in lengths:
            bs = eval_batch_size(length, base * self.block_size, base)
            out[length] = self._loader(self.eval_chunks(length, n), bs)
        return out

    # ---- misc
    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(ids)

    def config_summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source_name(),
            "tokenizer": self.tokenizer.kind,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "train_length": self.train_length,
            "train_tokens": int(len(self.train_stream)),
            "val_tokens": int(len(self.val_stream)),
            "val_fraction": self.options["val_fraction"],
            "eval_lengths": self.eval_lengths,
            "eval_tokens": self.eval_tokens,
            "batch_size": self.batch_size,
            "shuffle_seed": self.shuffle_seed,
            "cache": str(self.cache_path),
        }


class TextDataModule(LMDataModule):
    """``data=text data.path=...``: a local UTF-8 text file."""

    name = "text"
    defaults = TEXT_DEFAULTS

    def __init__(self, cfg: dict[str, Any], model_kind: str, seed: int) -> None:
        raw = cfg.get("path")
        if raw in (None, "", "???"):
            raise ConfigError(
                "data=text needs a text file: pass data.path=/path/to/file.txt (e.g. "
                "data.path=../shared/data/tinyshakespeare/input.txt) or set the POSFORMER_TEXT "
                "environment variable."
            )
        path = resolve_user_path(raw)
        if not path.exists():
            raise DataError(
                f"data.path={str(raw)!r}: file not found (resolved to {path}); "
                "pass an existing UTF-8 text file, "
                "e.g. data.path=../shared/data/tinyshakespeare/input.txt, or set POSFORMER_TEXT."
            )
        if not path.is_file():
            raise DataError(f"data.path={str(raw)!r} ({path}) is not a regular file; pass a UTF-8 text file.")
        if path.stat().st_size == 0:
            raise DataError(
                f"data.path={str(raw)!r} ({path}) is empty (0 bytes); pass a non-empty text file."
            )
        self.path = path
        super().__init__(cfg, model_kind, seed)

    def source_key(self) -> dict[str, Any]:
        st = self.path.stat()
        return {"path": str(self.path), "mtime_ns": st.st_mtime_ns, "size": st.st_size}

    def source_name(self) -> str:
        return str(self.path)

    def read_splits(self) -> tuple[str, str]:
        raw = self.path.read_bytes()
        # Validate first: datasets' text reader would fail deep inside with no useful position.
        text = _decode_bytes(raw, f"data.path={str(self.path)!r}", self.options["encoding_errors"])
        if not text.strip():
            raise DataError(
                f"data.path={str(self.path)!r} contains only whitespace; pass a text file with content."
            )
        lines = _load_text_lines(self.path, self.cache_root, self.options["encoding_errors"])
        text = "".join(lines)
        cut = int(len(text) * (1.0 - float(self.options["val_fraction"])))
        return text[:cut], text[cut:]


def _load_text_lines(path: Path, cache_root: Path, errors: str) -> list[str]:
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            "text",
            data_files=str(path),
            split="train",
            keep_linebreaks=True,
            encoding_errors=errors,
            cache_dir=str(cache_root / "hf_datasets"),
        )
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    return ds["text"]


# ---------------------------------------------------------------------------------------------- hub
def hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:  # pragma: no cover
        pass
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or os.environ.get(
        "HF_DATASETS_OFFLINE", ""
    ).upper() in ("1", "ON", "YES", "TRUE")


def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except ImportError:  # pragma: no cover
        endpoint = "https://huggingface.co"
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


class HubDataModule(LMDataModule):
    """``data=hub data.dataset=wikitext data.config=wikitext-103-raw-v1``: an HF hub dataset's text column.

    Processed streams are cached like ``data=text``, so a dataset processed once loads without the hub.
    """

    name = "hub"
    defaults = HUB_DEFAULTS

    def __init__(self, cfg: dict[str, Any], model_kind: str, seed: int) -> None:
        if not cfg.get("dataset"):
            raise ConfigError(
                "data=hub needs a dataset name: e.g. data.dataset=wikitext data.config=wikitext-103-raw-v1 "
                "(or use data=text data.path=... for a local file)."
            )
        super().__init__(cfg, model_kind, seed)

    def source_key(self) -> dict[str, Any]:
        o = self.options
        keys = ("dataset", "config", "revision", "text_column", "train_split", "val_split")
        key: dict[str, Any] = {k: o[k] for k in keys}
        local = Path(str(o["dataset"])).expanduser()
        if local.exists():  # a local dataset: its files' sizes and mtimes are part of the key
            files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
            key["files"] = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files[:10_000]]
        return key

    def source_name(self) -> str:
        o = self.options
        return f"hub:{o['dataset']}" + (f"/{o['config']}" if o["config"] else "")

    def _unreachable(self, detail: str) -> DataError:
        o = self.options
        cfg = f" data.config={o['config']}" if o["config"] else ""
        return DataError(
            f"data=hub data.dataset={o['dataset']}{cfg}: the Hugging Face hub is unreachable ({detail}) "
            f"and the dataset is not in the local cache ({self.cache_root / 'hf_datasets'}). Fixes: "
            "download it once on a machine with internet (same data.cache_dir) and copy the cache here, "
            "then run with HF_HUB_OFFLINE=1; "
            "or use a local file: data=text data.path=/path/to/file.txt."
        )

    def _load_split(self, split: str) -> Any:
        import datasets

        o = self.options
        was_enabled = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            return datasets.load_dataset(
                o["dataset"],
                o["config"],
                split=split,
                revision=o["revision"],
                cache_dir=str(self.cache_root / "hf_datasets"),
            )
        except DataError:
            raise
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            if hub_offline() or isinstance(exc, (ConnectionError, TimeoutError, OSError)):
                raise self._unreachable("offline mode" if hub_offline() else msg) from None
            raise DataError(f"data=hub: loading {self.source_name()} split {split!r} failed: {msg}") from exc
        finally:
            if was_enabled:
                datasets.enable_progress_bars()

    def _text_of(self, ds: Any) -> str:
        col = self.options["text_column"]
        if col not in ds.column_names:
            raise ConfigError(
                f"data.text_column={col!r} is not a column of {self.source_name()}; "
                f"columns: {ds.column_names}."
            )
        rows = ds[col]
        sep = "" if all(r.endswith("\n") for r in rows[:1000] if r) else "\n"
        return sep.join(rows)

    def read_splits(self) -> tuple[str, str]:
        local = Path(str(self.options["dataset"])).expanduser().exists()  # a local dataset directory/script
        if not local and not hub_offline() and not hub_reachable():
            raise self._unreachable(
                "no connection to the hub endpoint; if the dataset is cached, set HF_HUB_OFFLINE=1"
            )
        o = self.options
        train = self._text_of(self._load_split(o["train_split"]))
        if o["val_split"]:
            return train, self._text_of(self._load_split(o["val_split"]))
        cut = int(len(train) * (1.0 - float(o["val_fraction"])))
        return train[:cut], train[cut:]
