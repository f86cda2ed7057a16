"""Reading input files: paths, compression, UTF-8 decoding, plain and parallel text, digests.

- :func:`resolve_user_path`: relative paths are relative to where the command was started (also
  under Hydra); :func:`default_cache_dir`: ``$POSFORMER_CACHE`` or ``~/.cache/posformer``.
- :func:`read_raw`: a file's bytes, gzip-compressed files decompressed transparently (detected by
  their magic bytes, whatever the file name); other archives (bz2, xz, zstd, zip) are named in a
  :class:`~posformer.errors.DataError` with the command that unpacks them.
- :func:`decode_bytes`: UTF-8 with the byte offset of the first bad byte in the error
  (``errors="replace"``: U+FFFD and a warning).
- :func:`load_text_lines`: a text file's lines, line breaks kept, through ``datasets``' text reader
  (universal newlines; it decompresses gzip itself).
- :func:`read_lines` / :func:`find_file` / :func:`read_parallel`: one sentence per line, for
  parallel corpora ``{dir}/{split}.{lang}[.gz]``.
- :func:`content_hash` (cache keys of options) and :func:`file_digest` (of file contents).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

from posformer.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"
#: archives posformer does not unpack itself: magic bytes -> (name, unpack command)
OTHER_ARCHIVES: dict[bytes, tuple[str, str]] = {
    b"BZh": ("bzip2", "bunzip2 -k"),
    b"\xfd7zXZ\x00": ("xz", "unxz -k"),
    b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
    b"PK\x03\x04": ("zip", "unzip"),
}


# --------------------------------------------------------------------------------------------- paths
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


def content_hash(obj: Any) -> str:
    """20 hex digits of the SHA-256 of ``obj`` as sorted JSON (a cache key)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (as stored: compressed files are not decompressed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def human_size(n_bytes: int) -> str:
    """``1234`` -> ``"1,234 bytes"``; the exact count, so a message can be compared with ``ls -l``."""
    return f"{n_bytes:,} byte" + ("" if n_bytes == 1 else "s")


# --------------------------------------------------------------------------------------- raw bytes
def is_gzip(path: Path) -> bool:
    """True when the file starts with the gzip magic bytes (no UTF-8 text does: 0x8b is a
    continuation byte)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def read_raw(path: Path, where: str) -> bytes:
    """The bytes of ``path``; gzip files are decompressed (a damaged one -> :class:`DataError`)."""
    raw = path.read_bytes()
    if not raw.startswith(GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{where} is gzip-compressed but cannot be decompressed ({type(exc).__name__}: {exc}); "
            f"check it with `gzip -t {path}` or pass the uncompressed text file."
        ) from None


def archive_hint(raw: bytes) -> str:
    """``"it is a bzip2-compressed file: ..."`` when ``raw`` starts with a known archive's magic bytes
    (checked only once the bytes failed to decode: text may start with ``BZh``)."""
    for magic, (name, command) in OTHER_ARCHIVES.items():
        if raw.startswith(magic):
            return (
                f"it is a {name}-compressed file, which posformer does not unpack: unpack it first "
                f"(`{command} <file>`) or gzip it (gzip files are read directly)."
            )
    return ""


#: byte-order marks of the Unicode encodings that are not UTF-8 (UTF-32's first: it starts like UTF-16's)
BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32-LE",
    b"\x00\x00\xfe\xff": "UTF-32-BE",
    b"\xff\xfe": "UTF-16-LE",
    b"\xfe\xff": "UTF-16-BE",
}


def wide_encoding(raw: bytes) -> str | None:
    """``"UTF-16-LE"`` etc. when ``raw`` starts with that byte-order mark, or, without one, when every
    other byte of its start is NUL (ASCII text in UTF-16); ``None`` otherwise."""
    for bom, name in BOMS.items():
        if raw.startswith(bom):
            return name
    head = raw[:4096]
    if len(head) >= 8:
        even, odd = head[0::2], head[1::2]
        if odd.count(0) > 0.9 * len(odd) and even.count(0) < 0.1 * len(even):
            return "UTF-16-LE"
        if even.count(0) > 0.9 * len(even) and odd.count(0) < 0.1 * len(odd):
            return "UTF-16-BE"
    return None


def not_utf8_hint(raw: bytes) -> str:
    """Why bytes that failed to decode as UTF-8 are not text posformer reads, with the fix: a known
    archive (:func:`archive_hint`) or a UTF-16/UTF-32 file; ``""`` when neither."""
    wide = wide_encoding(raw)
    if wide:
        return (
            f"it is {wide} text, not UTF-8: convert it with `iconv -f {wide} -t UTF-8 in.txt > out.txt` "
            "(or save it as UTF-8 from your editor)."
        )
    return archive_hint(raw)


def decode_bytes(raw: bytes, where: str, errors: str) -> str:
    """UTF-8 ``raw`` -> text; bad bytes -> :class:`DataError` with the byte offset, or (``errors=
    "replace"``) U+FFFD and a warning. UTF-16/32 text is refused even where its bytes happen to be valid
    UTF-8 (ASCII in UTF-16 without a byte-order mark: every other byte NUL)."""
    if wide_encoding(raw):
        raise DataError(f"{where} is not UTF-8 text: {not_utf8_hint(raw)}")
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
        archive = not_utf8_hint(raw)
        if archive:
            raise DataError(f"{where} is not UTF-8 text: {archive}") from None
        raise DataError(
            f"{where} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} ({exc.reason}). "
            "Convert the file (e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`) or set "
            "data.encoding_errors=replace to decode bad bytes as U+FFFD."
        ) from None


def load_text_lines(path: Path, cache_root: Path, errors: str) -> list[str]:
    """Lines of a text file with their line breaks (``datasets``' text reader: universal newlines,
    gzip decompressed by its magic bytes)."""
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


# ----------------------------------------------------------------------------------- parallel text
def read_lines(path: str | os.PathLike) -> list[str]:
    """Lines of a plain or gzip text file (trailing newline stripped); gzip is detected by its magic
    bytes, so ``train.de`` may be compressed and ``train.de.gz`` may be plain."""
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"translation data file {str(p)!r} does not exist; check data.path and the split/language "
            "names (files are {path}/{split}.{lang} or {path}/{split}.{lang}.gz)."
        )
    raw = read_raw(p, f"translation data file {str(p)!r}")
    if wide_encoding(raw):
        raise DataError(f"translation data file {str(p)!r} is not UTF-8 text: {not_utf8_hint(raw)}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        archive = not_utf8_hint(raw)
        if archive:
            raise DataError(f"translation data file {str(p)!r} is not UTF-8 text: {archive}") from None
        where = " of the decompressed text" if is_gzip(p) else ""
        raise DataError(
            f"translation data file {str(p)!r} is not valid UTF-8: first bad byte at offset {exc.start}"
            f"{where}; convert it, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`."
        ) from None
    with io.StringIO(text, newline=None) as f:  # universal newlines, as a text-mode open() reads
        return [line.rstrip("\n").rstrip("\r") for line in f]


def find_file(directory: str | os.PathLike, split: str, lang: str) -> Path:
    """``{directory}/{split}.{lang}`` or its ``.gz``; a clear :class:`DataError` when neither exists."""
    base = Path(directory) / f"{split}.{lang}"
    for cand in (base, base.with_name(base.name + ".gz")):
        if cand.is_file():
            return cand
    if not Path(directory).is_dir():
        raise DataError(
            f"data.path={str(directory)!r} is not a directory; point it at the folder holding "
            f"{split}.{lang}[.gz] (e.g. ../shared/data/multi30k)."
        )
    present = sorted(p.name for p in Path(directory).iterdir())[:20]
    raise DataError(
        f"no file {base.name} or {base.name}.gz in {str(directory)!r} (split {split!r}, language "
        f"{lang!r}); it holds: {', '.join(present) or 'nothing'}. Fix data.splits or data.src_lang/"
        "tgt_lang."
    )


def read_parallel(src_path: str | os.PathLike, tgt_path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Aligned source/target sentences; different line counts or no sentence at all raise a
    :class:`DataError` naming both files (with their sizes)."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"parallel files are not aligned: {str(src_path)!r} has {len(src)} lines but "
            f"{str(tgt_path)!r} has {len(tgt)}; both sides need one sentence per line, in order."
        )
    if not any(s.strip() and t.strip() for s, t in zip(src, tgt, strict=True)):
        sizes = ", ".join(
            f"{str(p)!r} {len(lines)} lines / {human_size(Path(p).stat().st_size)}"
            for p, lines in ((src_path, src), (tgt_path, tgt))
        )
        raise DataError(
            f"parallel files hold no sentence pair ({sizes}); a split needs at least 1 line with text on "
            "both sides: fill the files or map the split to other files with data.splits."
        )
    return src, tgt
