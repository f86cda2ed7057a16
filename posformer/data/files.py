"""Input files: paths, compression, what is not UTF-8, digests.

- :func:`resolve_user_path`: relative paths are relative to where the command was started (also
  under Hydra); :func:`default_cache_dir`: ``$POSFORMER_CACHE`` or ``~/.cache/posformer``.
- :func:`is_gzip`; :func:`not_utf8_hint`: other archives (bz2, xz, zstd, zip) and UTF-16/32 text named
  with the command that converts them (the text itself is read in chunks by
  :func:`posformer.data.sources.read_text_chunks`).
- :func:`first_bad_utf8`: where a file stops being UTF-8 (line and byte offset).
- :func:`closest_sibling`: the existing file a misspelled path most likely meant.
- :func:`find_file`: ``{dir}/{split}.{lang}[.gz]`` of a parallel corpus.
- :func:`content_hash` (cache keys of options) and :func:`file_digest` (of file contents).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
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


def closest_sibling(path: Path) -> Path | None:
    """The entry of ``path``'s folder whose name is closest to ``path``'s (a typo's likely target), or
    ``None`` (no folder, or nothing close)."""
    try:
        names = sorted(p.name for p in path.parent.iterdir())
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return path.parent / close[0] if close else None


def meant(raw: str, path: Path) -> str:
    """``did you mean <sibling>?`` for the missing ``path`` (given as ``raw``), spelled the way ``raw``
    was (relative stays relative); ``""`` when no sibling is close."""
    sibling = closest_sibling(path)
    if sibling is None:
        return ""
    head = os.path.dirname(raw)
    return f"did you mean {os.path.join(head, sibling.name) if head else sibling.name}?"


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


def first_bad_utf8(path: Path) -> tuple[int, int, int] | None:
    """``(line, byte offset, byte)`` of the first byte of ``path`` that is not UTF-8 (lines from 1; a
    gzip file decompressed), or ``None`` when the whole file decodes. Read in chunks."""
    import codecs
    import gzip

    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    opener = gzip.open if is_gzip(path) else open
    consumed, lines = 0, 1
    with opener(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                held = len(exc.object) - len(chunk)  # bytes held back from the chunk before
                start = exc.start - held
                offset = consumed + start
                before = exc.object[:start] if start >= 0 else b""
                return lines + before.count(b"\n"), offset, exc.object[exc.start]
            lines += chunk.count(b"\n")
            consumed += len(chunk)
    return None


# ----------------------------------------------------------------------------------- parallel text
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
