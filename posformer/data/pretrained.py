"""Pretrained tokenizers: ``data.tokenizer=<tokenizer.json | HF tokenizer folder | hub id>``.

A value of ``data.tokenizer`` other than ``char``, ``byte`` or ``bpe`` names an existing model family's
tokenizer, read through HF ``tokenizers`` (:func:`resolve_pretrained`):

- a ``tokenizer.json`` file (any name: the file HF's fast tokenizers save);
- a folder holding ``tokenizer.json`` (an HF tokenizer or model folder; its ``tokenizer_config.json``
  names the special tokens), or, without one, a folder ``transformers.AutoTokenizer`` converts to a fast
  tokenizer (SentencePiece models; needs ``pip install transformers``);
- a hub id (``gpt2``, ``Qwen/Qwen2.5-0.5B``): its ``tokenizer.json`` and ``tokenizer_config.json`` are
  downloaded once into ``<cache_dir>/hf_tokenizers`` (offline: from there).

Special tokens (stated, recorded in the store's and the run's ``meta.json``): every document is
encoded without the tokenizer's own special tokens (``add_special_tokens=False``) and followed by its
end-of-text token where it has one (``eos_token`` of ``tokenizer_config.json``, else the first of
:data:`EOS_NAMES` in its vocabulary: GPT-2's ``<|endoftext|>``, Llama 3's ``<|end_of_text|>``, ``</s>``,
``<eos>``), which is where generation stops. No BOS is added. Decoding skips special tokens. The
model's vocabulary is the tokenizer's, added tokens included; above 65,535 ids the token store keeps
uint32 tokens. posformer's own ids PAD=0 … SEP=3 do not apply: ids 0-3 are the tokenizer's tokens.

A file that ``tokenizers`` cannot read is one :class:`~posformer.errors.DataError` line naming the
value and what to pass instead, before any data is read.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from posformer.errors import ConfigError, DataError
from posformer.io import atomic_write_json, atomic_write_text

#: end-of-text tokens looked for (in this order) when no tokenizer_config.json names one
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
#: posformer's own tokenizers (a value close to one of them is a typo, not a hub id)
BUILT_IN = ("char", "byte", "bpe")
#: the files of an HF tokenizer folder that posformer reads
FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json")
FIX = (
    "pass a tokenizer.json file, a folder holding one (an HF tokenizer or model folder), a hub id such as "
    "gpt2, or one of char, byte, bpe"
)


class PretrainedTokenizer:
    """An HF ``tokenizers.Tokenizer`` with its end-of-text id: ``encode(text) -> (n,) int64`` (no special
    tokens), ``encode_document(text)`` (+ EOS), ``decode(ids)`` (special tokens skipped)."""

    kind = "pretrained"

    def __init__(self, tokenizer: Any, source: str, eos_token: str | None = None) -> None:
        self.tok = tokenizer
        self.source = source
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        if eos_token is None:
            eos_token = next((t for t in EOS_NAMES if tokenizer.token_to_id(t) is not None), None)
        self.eos_token = eos_token
        self.eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.pad_id = 0  # LM windows are never padded; ModelConfig wants an id in the vocabulary

    @property
    def document_end(self) -> tuple[int, ...]:
        """The ids that end every document in the token store: the end-of-text token, if any."""
        return () if self.eos_id is None else (int(self.eos_id),)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tok.decode([int(i) for i in ids if int(i) >= 0], skip_special_tokens=True)

    def identity(self) -> str:
        """16 hex digits of the SHA-256 of the tokenizer's JSON and its end-of-text token: equal for the
        same tokenizer wherever its file lives."""
        digest = hashlib.sha256(self.tok.to_str().encode())
        digest.update(f"eos={self.eos_token}".encode())
        return digest.hexdigest()[:16]

    def info(self) -> dict[str, Any]:
        return {"tokenizer_source": self.source, "eos_token": self.eos_token, "eos_id": self.eos_id}

    def save(self, directory: Path) -> None:
        atomic_write_text(Path(directory) / "tokenizer.json", self.tok.to_str())
        atomic_write_json(Path(directory) / "pretrained.json", self.info())

    @classmethod
    def load(cls, directory: Path) -> PretrainedTokenizer:
        from tokenizers import Tokenizer

        info = json.loads((Path(directory) / "pretrained.json").read_text(encoding="utf-8"))
        tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
        return cls(tok, str(info.get("tokenizer_source", directory)), info.get("eos_token"))

    def __getstate__(self) -> dict[str, Any]:  # worker processes: the JSON, not the Rust object
        return {"json": self.tok.to_str(), "source": self.source, "eos": self.eos_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.__init__(Tokenizer.from_str(state["json"]), state["source"], state["eos"])


# ------------------------------------------------------------------------------------------ resolving
def first_line(exc: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (its type's name when it has none), cut at ``limit``."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


def _config_eos(folder: Path) -> str | None:
    """``eos_token`` of a folder's ``tokenizer_config.json`` (a string or ``{"content": ...}``)."""
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, OSError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def _from_file(file: Path, value: str, eos: str | None = None) -> PretrainedTokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise DataError(
            f"data.tokenizer={value!r}: {str(file)!r} is not a tokenizer ({first_line(exc)}); {FIX}."
        ) from None
    if eos is not None and tok.token_to_id(eos) is None:
        eos = None
    return PretrainedTokenizer(tok, value, eos)


def _saved(folder: Path, value: str) -> PretrainedTokenizer:
    """The copy posformer saved (a run's ``tokenizer/``): ``tokenizer.json`` + ``pretrained.json``."""
    try:
        return PretrainedTokenizer.load(folder)
    except Exception as exc:  # noqa: BLE001 - a damaged copy: one line
        raise DataError(
            f"data.tokenizer={value!r}: {str(folder)!r} holds a damaged tokenizer ({first_line(exc)}); {FIX}."
        ) from None


def _from_transformers(folder: Path, value: str) -> PretrainedTokenizer:
    """A folder without ``tokenizer.json``: ``transformers`` converts it to a fast tokenizer."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            f"data.tokenizer={value!r}: the folder has no tokenizer.json; converting it needs transformers "
            f"(pip install transformers), or {FIX}."
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    except Exception as exc:  # noqa: BLE001 - any failure: not a tokenizer folder
        raise DataError(
            f"data.tokenizer={value!r}: {str(folder)!r} is not a tokenizer folder ({first_line(exc)}); {FIX}."
        ) from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"data.tokenizer={value!r}: transformers has no fast tokenizer for it; {FIX}.")
    return PretrainedTokenizer(backend, value, auto.eos_token)


def _from_hub(repo: str, cache_root: Path) -> Path:
    """The hub tokenizer's files in ``<cache_root>/hf_tokenizers`` (downloaded once; offline: cached)."""
    from huggingface_hub import snapshot_download  # a dependency of datasets

    try:
        return Path(
            snapshot_download(
                repo,
                allow_patterns=[*FOLDER_FILES, "*.model", "special_tokens_map.json"],
                cache_dir=str(cache_root / "hf_tokenizers"),
            )
        )
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, network: one line
        why = "offline, and not cached" if hub_offline() else first_line(exc, 120)
        raise DataError(
            f"data.tokenizer={repo!r} is not char, byte or bpe, nor a tokenizer file or folder here, and no "
            f"hub tokenizer of that name could be read ({type(exc).__name__}: {why}); {FIX} (a hub "
            f"tokenizer is downloaded once into {cache_root / 'hf_tokenizers'})."
        ) from None


def resolve_pretrained(value: str, cache_root: Path) -> PretrainedTokenizer:
    """The tokenizer ``data.tokenizer=value`` names (a file, a folder or a hub id); one line otherwise."""
    path = Path(os.path.expanduser(value))
    if path.is_file():
        return _from_file(path, value)
    if path.is_dir():
        if (path / "pretrained.json").is_file() and (path / "tokenizer.json").is_file():  # a run's copy
            return _saved(path, value)
        if (path / "tokenizer.json").is_file():
            return _from_file(path / "tokenizer.json", value, _config_eos(path))
        return _from_transformers(path, value)
    if value.endswith(".json") or value.startswith((".", "/", "~")) or value.count("/") > 1:
        raise DataError(f"data.tokenizer={value!r}: no such file or folder; {FIX}.")
    close = difflib.get_close_matches(value.lower(), BUILT_IN, n=1, cutoff=0.6)
    if close:
        raise ConfigError(
            f"data.tokenizer={value!r} is unknown; did you mean {close[0]}? (valid: char, byte, bpe, or a "
            "pretrained tokenizer: a tokenizer.json, an HF tokenizer folder or a hub id)."
        )
    folder = _from_hub(value, cache_root)
    if (folder / "tokenizer.json").is_file():
        return _from_file(folder / "tokenizer.json", value, _config_eos(folder))
    return _from_transformers(folder, value)


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
