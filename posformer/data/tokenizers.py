"""Built-in tokenizers for language modelling: ``char``, ``byte`` and ``bpe``; the pretrained ones of
:mod:`posformer.data.pretrained` load through :func:`load_tokenizer` too.

All built-ins reserve the ids PAD=0, BOS=1, EOS=2, SEP=3 (``posformer.data.base.SPECIAL_TOKENS``) and add
none of them to the text (``document_end`` is empty); ``identity()`` is a short hash that is equal for
equal tokenizers (a run records it; resume and evaluation compare it).

- ``char``: one id per character of the training file (vocabulary saved as ``vocab.json``), plus
  ``<unk>`` (id 4) for characters outside it.
- ``byte``: UTF-8 bytes, id = byte + 4 (vocabulary 260).
- ``bpe``: HF ``tokenizers`` byte-level BPE trained on the training split (``tokenizer.json``).
  :func:`train_joint_bpe` trains the translation datamodule's joint source-target BPE (GPT-2 style
  ``ByteLevel`` pre-tokeniser with a prefix space); it loads as a ``bpe`` tokenizer too.

A run keeps its tokenizer: :func:`save_tokenizer_dir` writes the tokenizer's files atomically plus a
``meta.json`` (kind, vocabulary size, special tokens, where it came from) into ``<run_dir>/tokenizer/``
(``BaseDataModule.save_tokenizer``); :func:`load_tokenizer_dir` reads it back without the data or
its cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posformer.data.files import content_hash
from posformer.data.pretrained import PretrainedTokenizer
from posformer.errors import ConfigError, DataError
from posformer.io import atomic_write_json, atomic_write_text

PAD_ID, BOS_ID, EOS_ID, SEP_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")
IGNORE_INDEX = -100
N_SPECIAL = len(SPECIAL_TOKENS)
TOKENIZERS = ("char", "byte", "bpe")
#: every kind a run's tokenizer/ folder may hold
KINDS = (*TOKENIZERS, "pretrained")


def _as_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids if int(i) not in (PAD_ID, IGNORE_INDEX)]


class ByteTokenizer:
    kind = "byte"
    vocab_size = 256 + N_SPECIAL
    eos_id = EOS_ID
    document_end: tuple[int, ...] = ()

    def identity(self) -> str:
        return "byte"

    def encode(self, text: str) -> np.ndarray:
        """``(n,)`` uint16: the UTF-8 bytes shifted past the special ids (4..259)."""
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        ids += N_SPECIAL
        return ids

    def decode(self, ids: Any) -> str:
        out, buf = [], bytearray()
        for i in _as_list(ids):
            if i >= N_SPECIAL:
                buf.append(i - N_SPECIAL)
            else:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(SPECIAL_TOKENS[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / "tokenizer_byte.json", json.dumps({"kind": "byte"}))

    @classmethod
    def load(cls, directory: Path) -> ByteTokenizer:
        return cls()


class CharTokenizer:
    kind = "char"
    UNK = "<unk>"
    eos_id = EOS_ID
    document_end: tuple[int, ...] = ()

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        self.itos = [*SPECIAL_TOKENS, self.UNK, *self.chars]
        self.vocab_size = len(self.itos)
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        self._unk = N_SPECIAL

    @classmethod
    def train(cls, text: str | Iterable[str]) -> CharTokenizer:
        """The characters of ``text`` (a string, or an iterable of strings read one at a time)."""
        chars: set[str] = set()
        for piece in [text] if isinstance(text, str) else text:
            chars.update(piece)
        return cls(chars)

    def identity(self) -> str:
        return content_hash({"char": self.chars})[:16]

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        if not len(self._codes):
            return np.full(len(codes), self._unk, dtype=np.int32)
        idx = np.searchsorted(self._codes, codes)
        idx_c = np.minimum(idx, len(self._codes) - 1)
        known = self._codes[idx_c] == codes
        return np.where(known, idx_c + N_SPECIAL + 1, self._unk).astype(np.int32)

    def decode(self, ids: Any) -> str:
        return "".join(self.itos[i] if 0 <= i < self.vocab_size else self.UNK for i in _as_list(ids))

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / "vocab.json", json.dumps({"kind": "char", "chars": self.chars}))

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        return cls(json.loads((directory / "vocab.json").read_text())["chars"])


class BPETokenizer:
    kind = "bpe"
    eos_id = EOS_ID
    document_end: tuple[int, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        for i, name in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(name) != i:
                raise DataError(
                    f"BPE tokenizer: special token {name} must have id {i}; delete the cached tokenizer."
                )

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import ByteLevelBPETokenizer

        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(
            texts,
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            show_progress=False,
        )
        return cls(tok._tokenizer)

    def identity(self) -> str:
        return content_hash({"bpe": self.tok.to_str()})[:16]

    def encode(self, text: str) -> np.ndarray:
        lines = text.splitlines(keepends=True)
        out: list[np.ndarray] = []
        for start in range(0, len(lines), 10_000):
            for enc in self.tok.encode_batch(lines[start : start + 10_000], add_special_tokens=False):
                out.append(np.asarray(enc.ids, dtype=np.int32))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)

    def decode(self, ids: Any) -> str:
        return self.tok.decode(_as_list(ids), skip_special_tokens=False)

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / "tokenizer.json", self.tok.to_str(pretty=True))

    @classmethod
    def load(cls, directory: Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")))


Tokenizer = ByteTokenizer | CharTokenizer | BPETokenizer | PretrainedTokenizer


def check_bpe_vocab(vocab_size: int) -> None:
    if vocab_size <= 256 + N_SPECIAL:
        raise ConfigError(
            f"data.vocab_size={vocab_size} is too small for byte-level BPE; it needs > {256 + N_SPECIAL} "
            "(256 byte symbols + specials); e.g. data.vocab_size=4096."
        )


def train_tokenizer(kind: str, text: str | Iterable[str], vocab_size: int) -> Tokenizer:
    """A built-in tokenizer trained on ``text`` (a string, or pieces of text read one at a time:
    ``char`` takes their characters, ``bpe`` their lines)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        check_bpe_vocab(vocab_size)
        pieces = [text] if isinstance(text, str) else text
        lines = (line for piece in pieces for line in piece.splitlines(keepends=True))
        return BPETokenizer.train(lines, vocab_size)
    raise ConfigError(f"data.tokenizer={kind!r} is unknown; valid: {', '.join(TOKENIZERS)}.")


def load_tokenizer(kind: str, directory: Path) -> Tokenizer:
    classes = {"byte": ByteTokenizer, "char": CharTokenizer, "bpe": BPETokenizer}
    return classes.get(kind, PretrainedTokenizer).load(directory)  # type: ignore[attr-defined]


def train_joint_bpe(texts: Iterator[str] | Sequence[str], vocab_size: int, min_frequency: int = 2) -> Any:
    """A joint byte-level BPE (HF ``tokenizers.Tokenizer``) with the four special tokens at ids 0-3
    (translation: trained on both sides of the training split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:  # pragma: no cover - tokenizers puts specials first
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


# ------------------------------------------------------------------------------------ run directory


def save_tokenizer_dir(tok: Tokenizer, directory: Path, **info: Any) -> Path:
    """Write ``tok``'s files and ``meta.json`` (kind, vocab_size, special_tokens, ``info``) into
    ``directory``, each file atomically (an earlier copy is replaced whole, never damaged)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(directory)
    meta = {
        "kind": tok.kind,
        "vocab_size": int(tok.vocab_size),
        "identity": tok.identity(),
        "special_tokens": list(SPECIAL_TOKENS) if tok.kind in TOKENIZERS else [],
        **(tok.info() if hasattr(tok, "info") else {}),
        **info,
    }
    atomic_write_json(directory / "meta.json", meta)
    return directory


def load_tokenizer_dir(directory: str | Path) -> Tokenizer:
    """The tokenizer :func:`save_tokenizer_dir` wrote (e.g. ``<run_dir>/tokenizer``)."""
    directory = Path(directory)
    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        raise DataError(
            f"{str(directory)!r} holds no saved tokenizer (no meta.json); pass the tokenizer/ folder of a "
            "run trained on text or translation data."
        )
    kind = json.loads(meta_file.read_text(encoding="utf-8")).get("kind")
    if kind not in KINDS:
        raise DataError(f"{str(meta_file)!r}: tokenizer kind {kind!r} is unknown; valid: {', '.join(KINDS)}.")
    return load_tokenizer(kind, directory)
