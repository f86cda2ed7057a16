"""Where a language model's text comes from, read in batches of pieces (never the whole corpus at once).

A source yields ``(pass, [(split, index, text, doc_end), ...])`` batches (:meth:`TextSource.batches`,
:meth:`RowSource.batches`); a *piece* is a run of text of one split, ``index`` its place in the pass
(the same on every read: a resumed build skips the pieces its complete shards hold), ``doc_end`` when a
document ends with it. The token store (:mod:`posformer.data.building`) tokenises the pieces in order
and writes them into the split's shards. ``full(split)`` says when a split's token budget is spent: a
source stops reading what only that split would take.

- :class:`TextSource`: one text as one document (a text file, read and decoded in chunks by
  :func:`read_text_chunks`; the generated corpus of ``data=corpus``). Its last ``val_fraction`` of
  characters is the validation split, as before the store; pieces end at line ends (so a per-line
  tokenizer such as ``bpe`` sees the lines it saw on the whole text). With ``separator`` (packing) the
  training text is cut into documents there, empty ones dropped, the separators removed.
- :class:`RowSource`: the rows of HF ``datasets`` (a ``Dataset``, or an ``IterableDataset`` streamed
  from files or the hub), one document each. Without a validation split, document ``i`` is validation
  when ``floor((i + 1) f) > floor(i f)`` (``f = val_fraction``: every tenth at 0.1), which needs no
  count of the documents and holds for any prefix of a stream.
"""

from __future__ import annotations

import codecs
import gzip
import io
import itertools
import math
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from posformer.data.files import GZIP_MAGIC, first_bad_utf8, not_utf8_hint, wide_encoding
from posformer.errors import ConfigError, DataError

Piece = tuple[str, int, str, bool]  # (split, index in the pass, text, doc_end)
Batch = tuple[int, list[Piece]]  # (pass, pieces)
Full = Callable[[str], bool]
#: characters per piece batch (one task of a tokenising worker)
BATCH_CHARS = 1 << 20
#: a text's pieces end at the first line end past this many characters
PIECE_CHARS = 1 << 18
#: a piece without a line end is cut here (a document of one enormous line)
MAX_PIECE_CHARS = 1 << 24
#: rows per batch read from a dataset
BATCH_ROWS = 1000


def is_validation(i: int, fraction: float) -> bool:
    """Document ``i`` goes to the validation split (evenly spread: a fraction ``fraction`` of any prefix)."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


# ----------------------------------------------------------------------------------------- text files
def _raw_chunks(path: Path, where: str, size: int = 1 << 22) -> Iterator[bytes]:
    """The bytes of ``path`` in chunks, gzip decompressed (detected by its magic bytes)."""
    with open(path, "rb") as f:
        gz = f.read(2) == GZIP_MAGIC
    opener = gzip.open if gz else open
    try:
        with opener(path, "rb") as f:
            yield from iter(lambda: f.read(size), b"")
    except (OSError, EOFError, zlib.error) as exc:
        if not gz:
            raise
        raise DataError(
            f"{where} is gzip-compressed but cannot be decompressed ({type(exc).__name__}: {exc}); "
            f"check it with `gzip -t {path}` or pass the uncompressed text file."
        ) from None


def read_text_chunks(
    path: Path, where: str, errors: str = "strict", replace_option: bool = True
) -> Iterator[str]:
    """``path`` decoded as UTF-8 in chunks, with universal newlines (``\\r\\n`` and ``\\r`` read as
    ``\\n``, as a text-mode ``open`` does). A bad byte under ``errors="strict"`` is a :class:`DataError`
    naming its offset (and ``data.encoding_errors=replace`` where the dataset has it:
    ``replace_option``); UTF-16/32 text and other archives are named with their fix."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(errors), translate=True)
    consumed, head = 0, None
    for chunk in _raw_chunks(path, where):
        if head is None:
            head = chunk[:4096]
            if wide_encoding(head):
                raise DataError(f"{where} is not UTF-8 text: {not_utf8_hint(head)}")
        try:
            text = decoder.decode(chunk)
        except UnicodeDecodeError as exc:
            pending = len(exc.object) - len(chunk)  # bytes held back from the chunk before
            offset = consumed - pending + exc.start
            raise _decode_error(where, exc, offset, head or b"", replace_option) from None
        consumed += len(chunk)
        if text:
            yield text
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def _decode_error(where: str, exc: UnicodeDecodeError, offset: int, head: bytes, replace: bool) -> DataError:
    hint = not_utf8_hint(head)
    if hint:
        return DataError(f"{where} is not UTF-8 text: {hint}")
    option = " or set data.encoding_errors=replace to decode bad bytes as U+FFFD" if replace else ""
    return DataError(
        f"{where} is not valid UTF-8: byte 0x{exc.object[exc.start]:02x} at offset {offset} ({exc.reason}). "
        f"Convert the file (e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`){option}."
    )


def scan_text_file(path: Path, where: str, errors: str) -> int:
    """Read the whole file once before anything is written: its characters (after newline translation),
    or one :class:`DataError` (bad UTF-8, a damaged gzip, only whitespace)."""
    try:
        n, content = _count(read_text_chunks(path, where, "strict"))
    except DataError as exc:
        if errors != "replace" or "not valid UTF-8" not in str(exc):
            raise
        offset = str(exc).split(" at offset ", 1)[1].split(" ", 1)[0]
        warnings.warn(
            f"{where}: not valid UTF-8 (first bad byte at offset {offset}); undecodable bytes were replaced "
            "by U+FFFD (data.encoding_errors=replace).",
            stacklevel=3,
        )
        n, content = _count(read_text_chunks(path, where, "replace"))
    if n and not content:
        raise DataError(f"{where} contains only whitespace; pass a text file with content.")
    return n


def _count(chunks: Iterator[str]) -> tuple[int, bool]:
    n, content = 0, False
    for text in chunks:
        n += len(text)
        content = content or not text.isspace()
    return n, content


# ------------------------------------------------------------------------------------------ one text
class TextSource:
    """One text as one document: the last ``val_fraction`` of its ``n_chars`` characters is validation.

    ``chunks()`` yields the text in chunks (any sizes); ``separator`` (packing) cuts the training text
    into documents there.
    """

    rows = False

    def __init__(
        self,
        chunks: Callable[[], Iterator[str]],
        n_chars: int,
        val_fraction: float,
        separator: str | None = None,
    ) -> None:
        self.chunks, self.n_chars = chunks, int(n_chars)
        self.cut = int(self.n_chars * (1.0 - float(val_fraction)))
        self.separator = separator
        self.read = 0

    def progress(self) -> float | None:
        return self.read / self.n_chars if self.n_chars else None

    def pieces(self) -> Iterator[tuple[str, str]]:
        """``(split, text)`` runs of about :data:`PIECE_CHARS` characters that end at line ends (a line
        longer than :data:`MAX_PIECE_CHARS` is cut there), cut at the split point."""
        buf, pos = "", 0  # pos: characters before buf
        for chunk in itertools.chain(self.chunks(), [None]):
            buf = buf + chunk if chunk is not None else buf
            i = 0
            while k := self._end(buf, i, pos, final=chunk is None):
                yield ("train" if pos < self.cut else "val"), buf[i : i + k]
                i, pos = i + k, pos + k
                self.read = pos
            buf = buf[i:]
        self.read = self.n_chars

    def _end(self, buf: str, i: int, pos: int, final: bool) -> int:
        """The length of the next piece of ``buf[i:]`` (0: wait for more text; ``pos``: the characters
        before it; ``final``: no more text comes)."""
        rest = len(buf) - i
        cut = self.cut - pos if pos < self.cut < pos + rest or (final and pos < self.cut == pos + rest) else 0
        line_end = buf.find("\n", i + PIECE_CHARS, i + MAX_PIECE_CHARS) + 1 - i
        if line_end > 0 and (not cut or line_end < cut):
            return line_end
        if cut:
            return cut
        if rest >= MAX_PIECE_CHARS:
            return MAX_PIECE_CHARS
        return rest if final else 0

    def batches(self, full: Full) -> Iterator[Batch]:
        batch: list[Piece] = []
        size = 0
        docs = self._documents(self.pieces()) if self.separator else self._whole(self.pieces())
        for index, (split, text, doc_end) in enumerate(docs):
            if full(split):
                if split == "val" or full("val"):
                    break
                continue  # the rest of the training text: read, not tokenised
            batch.append((split, index, text, doc_end))
            size += len(text)
            if size >= BATCH_CHARS:
                yield 0, batch
                batch, size = [], 0
        if batch:
            yield 0, batch

    def _whole(self, pieces: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str, bool]]:
        """One document per split: it ends with the split's last piece."""
        last: tuple[str, str] | None = None
        for piece in pieces:
            if last is not None:
                yield last[0], last[1], last[0] != piece[0]
            last = piece
        if last is not None:
            yield last[0], last[1], True

    def _documents(self, pieces: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str, bool]]:
        """Training documents cut at ``separator`` (empty ones dropped; a document longer than
        :data:`MAX_PIECE_CHARS` comes in pieces); validation pieces as they are."""
        sep, buf = str(self.separator), ""
        for split, text in pieces:
            if split == "val":
                if buf.strip():
                    yield "train", buf, True
                buf = ""
                yield split, text, True
                continue
            parts = (buf + text).split(sep)
            buf = parts.pop()
            for doc in parts:
                if doc.strip():
                    yield "train", doc, True
            if len(buf) > MAX_PIECE_CHARS:
                k = max(buf.rfind("\n", 0, len(buf) - len(sep)) + 1, len(buf) - len(sep) + 1)
                yield "train", buf[:k], False
                buf = buf[k:]
        if buf.strip():
            yield "train", buf, True


# ------------------------------------------------------------------------------------------ datasets
class RowSource:
    """Rows of HF ``datasets`` splits, one document each (``text_column``); ``val`` None: documents
    spread into validation by :func:`is_validation`. ``join``: a newline after each row that does not
    end with one (decided on a split's first :data:`BATCH_ROWS` rows, as ``"\\n".join`` did)."""

    rows = True

    def __init__(
        self,
        train: Any,
        val: Any | None,
        column: str,
        name: str,
        val_fraction: float,
        join: bool = True,
        files: list[Path] | tuple[Path, ...] = (),
    ) -> None:
        self.splits, self.column, self.name = (train, val), column, name
        self.fraction, self.join = float(val_fraction), join
        self.files = list(files)  # local files read: where a byte that is not UTF-8 is looked for
        self.read = 0
        self.total = sum(_length(ds) or 0 for ds in (train, val) if ds is not None) or None

    def progress(self) -> float | None:
        return self.read / self.total if self.total else None

    def check_column(self) -> None:
        """The text column, on the first rows of each split, before anything is written; a split without
        rows is a :class:`DataError` (the validation split's names the fix ``data.val_split=null``)."""
        for which, ds in zip(("training", "validation"), self.splits, strict=True):
            if ds is None:
                continue
            first = None if _length(ds) == 0 else next(self._rows(ds, 1), None)
            if not first or not next(iter(first.values()), None):
                fix = (
                    "fill it, or set data.val_split=null to validate on the last data.val_fraction of the "
                    "training split"
                    if which == "validation"
                    else "pass data with rows (data.train_split names the split)"
                )
                raise DataError(f"the {which} split of {self.name} has no rows; {fix}.")
            self._column_of(first)

    def _rows(self, ds: Any, size: int) -> Iterator[dict[str, list[Any]]]:
        """:func:`_row_batches`, with a byte that is not UTF-8 (pyarrow's ``UnicodeDecodeError``, which
        names neither file nor line) a :class:`DataError` naming both where the local files show it."""
        try:
            yield from _row_batches(ds, size)
        except UnicodeDecodeError as exc:
            raise DataError(self._not_utf8(exc)) from None

    def _not_utf8(self, exc: UnicodeDecodeError) -> str:
        fix = "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl` for Latin-1 text)"
        for path in self.files:
            found = first_bad_utf8(path)
            if found:
                line, offset, byte = found
                return (
                    f"{self.name}: {str(path)!r} is not valid UTF-8: byte 0x{byte:02x} on line {line} (byte "
                    f"offset {offset}, {exc.reason}); {fix}, or fix that line."
                )
        bad = exc.object[exc.start : exc.start + 1].hex() if isinstance(exc.object, bytes) else "?"
        return f"{self.name} holds text that is not valid UTF-8 (byte 0x{bad}, {exc.reason}); {fix}."

    def _texts(self, values: list[Any], split: str, first: int) -> list[str]:
        """The text column's values, every one a string: a number, a null or a list is a
        :class:`DataError` naming the row (``first``: the split's row of ``values[0]``) and the fix."""
        for i, value in enumerate(values):
            if not isinstance(value, str):
                shown = repr(value)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise DataError(
                    f"data.text_column={self.column!r} of {self.name} holds {shown} "
                    f"({type(value).__name__}) in row {first + i} (counting from 0) of the {split} split; "
                    "every value must be text (a string). Fix or drop those rows (e.g. "
                    f"`jq -c 'select(.{self.column}|type==\"string\")' in.jsonl > out.jsonl`), "
                    "or choose the text column with data.text_column=<column>."
                )
        return values

    def _column_of(self, batch: dict[str, list[Any]]) -> list[Any]:
        if self.column not in batch:
            raise ConfigError(
                f"data.text_column={self.column!r} is not a column of {self.name}; columns: "
                f"{sorted(batch)}; set data.text_column=<one of them>."
            )
        return batch[self.column]

    def batches(self, full: Full) -> Iterator[Batch]:
        train, val = self.splits
        passes = [(train, None)] if val is None else [(train, "train"), (val, "val")]
        for p, (ds, split) in enumerate(passes):
            index, sep = 0, None
            for rows in self._rows(ds, BATCH_ROWS):
                texts = self._texts(self._column_of(rows), split or "train", index)
                self.read += len(texts)
                if sep is None:
                    sep = "" if not self.join or all(t.endswith("\n") for t in texts if t) else "\n"
                pieces = []
                for t in texts:
                    where = split or ("val" if is_validation(index, self.fraction) else "train")
                    if not full(where):
                        pieces.append((where, index, t + sep, True))
                    index += 1
                if pieces:
                    yield p, pieces
                if (split and full(split)) or (split is None and full("train") and full("val")):
                    break


def _length(ds: Any) -> int | None:
    try:
        return len(ds)
    except TypeError:  # an IterableDataset
        return None


def _row_batches(ds: Any, size: int) -> Iterator[dict[str, list[Any]]]:
    """``{column: values}`` batches of a ``Dataset`` or ``IterableDataset`` (arrow memory maps or a
    stream: a batch at a time)."""
    yield from ds.iter(batch_size=size)
