"""Language modelling from a local text file (``data=text data.path=...``).

The file is UTF-8 text, plain or gzip-compressed (detected by its magic bytes, whatever its name;
read transparently). It is checked before any work: it must exist, be a regular file and be non-empty;
when its store is built it is read once in chunks first (:func:`~posformer.data.sources.scan_text_file`),
so that bad UTF-8 (``encoding_errors: strict``, the default, reports the byte offset of the first bad
byte; ``replace`` decodes it as U+FFFD and warns) or only whitespace is one error before anything is
written. The text (universal newlines, line breaks kept) is one document: its last ``val_fraction`` of
characters is the validation split (:class:`~posformer.data.sources.TextSource`). Tokenising, the store
and batching are :class:`~posformer.data.lm.LMDataModule`'s; the cache key holds the file's absolute
path, mtime and size. Memory does not grow with the file: it is read in chunks.

Errors about ``data.path`` are tagged with the key, so ``build_datamodule`` can name the environment
variable the composed config reads it from (``POSFORMER_TEXT`` for ``data=text``, ``POSFORMER_DATA``
for ``experiment=lm_shakespeare``).

The names of the former single module stay importable from here (``LMDataModule``,
``WindowDataset``, ``collate_lm``, ``HubDataModule``, ``hub_offline``, ``hub_reachable``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posformer.data.base import tag_key
from posformer.data.files import default_cache_dir, human_size, is_gzip, meant, resolve_user_path
from posformer.data.hub import HubDataModule, hub_offline, hub_reachable
from posformer.data.lm import CACHE_VERSION, LMDataModule, WindowDataset, collate_lm
from posformer.data.options import TextOptions, read_options
from posformer.data.sources import TextSource, read_text_chunks, scan_text_file
from posformer.errors import ConfigError, DataError

EXAMPLE = "data.path=../shared/data/tinyshakespeare/input.txt"


class TextDataModule(LMDataModule):
    """``data=text data.path=...``: a local UTF-8 text file (plain or gzip)."""

    name = "text"
    Options = TextOptions

    def __init__(self, cfg: TextOptions | Mapping[str, Any], model_kind: str, seed: int) -> None:
        o = read_options(TextOptions, cfg, model_kind)  # the path is checked here (its hint: its variable)
        raw = o.path
        if raw in (None, "", "???"):
            raise tag_key(
                ConfigError(
                    f"data=text needs a text file: pass data.path=/path/to/file.txt (e.g. {EXAMPLE})."
                ),
                "path",
            )
        path = resolve_user_path(raw)
        if not path.exists():
            fix = meant(str(raw), path) or f"pass an existing UTF-8 text file (plain or gzip), e.g. {EXAMPLE}"
            fix += "" if fix.endswith("?") else "."
            raise tag_key(
                DataError(f"data.path={str(raw)!r}: file not found (resolved to {path}); {fix}"),
                "path",
            )
        if path.is_dir() or path.suffix.lower() in (".jsonl", ".json", ".csv", ".parquet"):
            raise DataError(
                f"data.path={str(raw)!r}: data=text reads one plain text file; for a "
                f"{'folder' if path.is_dir() else path.suffix} use data=hub data.dataset={raw} "
                "data.text_column=<column> (docs/training.md, 'Your own data')."
            )
        if not path.is_file():
            raise DataError(f"data.path={str(raw)!r} ({path}) is not a regular file; pass a UTF-8 text file.")
        if path.stat().st_size == 0:
            raise DataError(
                f"data.path={str(raw)!r} ({path}) is empty (0 bytes); pass a non-empty text file."
            )
        self.path = path
        self.compressed = is_gzip(path)
        super().__init__(o, model_kind, seed)

    def source_key(self) -> dict[str, Any]:
        st = self.path.stat()
        return {"path": str(self.path), "mtime_ns": st.st_mtime_ns, "size": st.st_size}

    def source_name(self) -> str:
        return str(self.path)

    def source_size(self) -> str:
        return human_size(self.path.stat().st_size) + (", gzip-compressed" if self.compressed else "")

    def make_source(self) -> TextSource:
        """The file as one document, read once now to check it (UTF-8, not only whitespace)."""
        where = f"data.path={str(self.path)!r}"
        errors = self.options.encoding_errors
        n_chars = scan_text_file(self.path, where + (" (decompressed)" if self.compressed else ""), errors)
        if not n_chars:
            raise DataError(f"{where} is gzip-compressed text of 0 bytes; pass a non-empty text file.")
        separator = self.options.doc_separator if self.pack else None
        chunks = lambda: read_text_chunks(self.path, where, errors)  # noqa: E731 - read once per pass
        return TextSource(chunks, n_chars, self.options.val_fraction, separator)


__all__ = [
    "CACHE_VERSION",
    "HubDataModule",
    "LMDataModule",
    "TextDataModule",
    "WindowDataset",
    "collate_lm",
    "default_cache_dir",
    "hub_offline",
    "hub_reachable",
    "resolve_user_path",
]
