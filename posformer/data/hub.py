"""Hugging Face ``datasets`` loading: ``data=hub`` (a dataset's text column: hub or local data).

- :func:`hub_offline` / :func:`hub_reachable`: offline mode is set, or the hub endpoint does not
  answer within a few seconds; either way an uncached dataset is a :class:`~posformer.errors.DataError`
  saying how to get it (copy the cache, ``HF_HUB_OFFLINE=1``, or a local file), not a long hang.
- :class:`HubDataModule`: language modelling on a dataset's text column, through
  :class:`~posformer.data.lm.LMDataModule`: one document per row, read in batches
  (:class:`~posformer.data.sources.RowSource`); its validation split when it has one, else every
  ``1 / val_fraction``-th document. Local data never touches the hub (:func:`local_source`): a
  ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` folder (detected by its ``state.json`` /
  ``dataset_dict.json``; memory-mapped arrow), one ``.jsonl``/``.json``/``.csv``/``.parquet``/``.txt``
  file, a folder of such files, or HF's ``data_files`` idiom (a path, a list, or a ``{split: paths}``
  dict; ``data.dataset`` is then the builder, ``json``/``csv``/``parquet``/``text``, or null to infer it
  from the files' extension): files are streamed (``streaming=True``: no arrow copy). A hub dataset is
  downloaded into ``<cache_dir>/hf_datasets``, or streamed with ``data.streaming=true`` (nothing but the
  rows read; ``data.max_tokens`` stops the reading). ``data.sample_by`` (text files: ``line``,
  ``paragraph``, ``document``) is ``datasets``' text reader's: ``document`` makes each file one
  document (a folder of books).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from posformer.data.files import meant
from posformer.data.lm import LMDataModule
from posformer.data.options import HubOptions, read_options
from posformer.data.pretrained import hub_offline
from posformer.data.sources import RowSource
from posformer.errors import ConfigError, DataError

log = logging.getLogger("posformer.data")

#: file extensions read by one of ``datasets``' packaged builders (no hub involved)
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
#: the files ``save_to_disk`` writes: a DatasetDict's folder, a Dataset's folder
SAVED_MARKERS = ("dataset_dict.json", "state.json")


def _files_of(data_files: Any) -> list[str]:
    """Every path of a ``data_files`` value (str, list, or ``{split: str | list}``)."""
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _files_of(v)]
    if isinstance(data_files, list | tuple):
        return [f for v in data_files for f in _files_of(v)]
    raise ConfigError(
        f"data.data_files={data_files!r} must be a path, a list of paths or a {{split: paths}} mapping, e.g. "
        "data.data_files={train: a.jsonl, validation: b.jsonl}."
    )


def _kind_of(file: str) -> str | None:
    """The packaged builder of one file by its extension (``.gz`` looked through), or None."""
    return LOCAL_BUILDERS.get(Path(file[:-3] if file.endswith(".gz") else file).suffix.lower())


def _builder_of(files: list[str], where: str) -> str:
    """The packaged builder that reads ``files`` (one extension for all; ``.gz`` looked through)."""
    kinds = {_kind_of(f) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError(
            f"{where}: cannot tell the format of {files[:3]}; use files ending in "
            f"{', '.join(LOCAL_BUILDERS)} (one kind), or name the builder: "
            "data.dataset=json|csv|parquet|text."
        )
    return kinds.pop()  # type: ignore[return-value]


def local_source(dataset: Any, data_files: Any) -> tuple[str, Any] | None:
    """How to read local data without the hub, or ``None`` (a hub dataset):

    ``("disk", path)`` a ``save_to_disk`` folder; ``("files", (builder, data_files))`` a single file, or
    ``data_files`` with ``dataset`` naming the builder (or null: inferred from the extension).
    A folder of files is ``datasets``' own folder loader (``("folder", path)``).
    """
    if data_files is not None:
        files = _files_of(data_files)
        builder = str(dataset) if dataset else _builder_of(files, "data.data_files")
        if builder not in set(LOCAL_BUILDERS.values()):
            raise ConfigError(
                f"data.dataset={dataset!r} with data.data_files: the dataset is the files' builder; valid: "
                "json, csv, parquet, text (or null: inferred from the file extension)."
            )
        missing = [f for f in files if not any(ch in f for ch in "*?[") and not Path(f).expanduser().exists()]
        if missing:
            raise DataError(
                f"data.data_files: {missing[0]!r} does not exist; pass existing files (globs allowed)."
            )
        local_files(data_files)  # every pattern matches, no file is empty
        return "files", (builder, data_files)
    if not dataset:
        return None
    path = Path(str(dataset)).expanduser()
    if path.is_dir():
        saved = any((path / m).is_file() for m in SAVED_MARKERS)
        return ("disk", path) if saved else ("folder", path)
    if path.is_file():
        builder = _builder_of([str(path)], f"data.dataset={str(dataset)!r}")
        _check_not_empty(path, f"data.dataset={str(dataset)!r}")
        return "files", (builder, str(path))
    if _looks_local(str(dataset)):  # a misspelled local file, not a hub name: no hub error for it
        where = path.absolute()
        hint = meant(str(dataset), where) or "pass an existing file or save_to_disk folder."
        raise DataError(f"data.dataset={str(dataset)!r}: no such file (resolved to {where}); {hint}")
    return None


def _looks_local(dataset: str) -> bool:
    """``dataset`` spelled as a local path (``./``, ``../``, ``/``, ``~`` or a data file's extension),
    never a hub name (``org/name``)."""
    return dataset.startswith(("./", "../", "/", "~")) or Path(dataset).suffix.lower() in LOCAL_BUILDERS


def _check_not_empty(path: Path, where: str) -> None:
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"{where}: {str(path)!r} is empty (0 bytes); pass a file with rows, or leave it out.")


def local_files(data_files: Any) -> list[Path]:
    """The files a ``data_files`` value names, its glob patterns expanded (relative to the working
    directory, as ``datasets`` reads them): a pattern that matches no file, or an empty file, is a
    :class:`~posformer.errors.DataError` naming it (``datasets`` raised a bare ``StopIteration`` or
    ``FileNotFoundError`` traceback)."""
    out: list[Path] = []
    for pattern in _files_of(data_files):
        expanded = os.path.expanduser(pattern)
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(expanded, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(
                    f"data.data_files: the pattern {pattern!r} matches no file (looked from {os.getcwd()}); "
                    "fix the pattern or the working directory, or name the files."
                )
        else:
            matches = [Path(expanded)]
        for m in matches:
            _check_not_empty(m, "data.data_files")
        out += matches
    return out


def _load_saved(path: Path) -> Any:
    """``datasets.load_from_disk(path)``, a DatasetDict one split at a time: a split saved without rows
    (0 shards, on which ``datasets`` fails with an ``IndexError``) is an empty ``Dataset``, which
    :meth:`~posformer.data.sources.RowSource.check_column` names if it is read."""
    import datasets

    index = path / "dataset_dict.json"
    if not index.is_file():
        return datasets.load_from_disk(str(path))
    splits = json.loads(index.read_text(encoding="utf-8")).get("splits", [])
    out = {}
    for split in splits:
        try:
            out[split] = datasets.load_from_disk(str(path / split))
        except IndexError:  # no shard: a split without rows
            out[split] = datasets.Dataset.from_list([])
    return datasets.DatasetDict(out)


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


# ------------------------------------------------------------------------------------ data=hub (LM)
class HubDataModule(LMDataModule):
    """``data=hub data.dataset=wikitext data.config=wikitext-103-raw-v1``: an HF hub dataset's text column.

    Processed streams are cached like ``data=text``, so a dataset processed once loads without the hub.
    """

    name = "hub"
    Options = HubOptions

    def __init__(self, cfg: HubOptions | Mapping[str, Any], model_kind: str, seed: int) -> None:
        o = read_options(HubOptions, cfg, model_kind)
        if not o.dataset and not o.data_files:  # a value to supply, not a rule
            raise ConfigError(
                "data=hub needs a dataset: a hub name (data.dataset=wikitext "
                "data.config=wikitext-103-raw-v1), a local file or save_to_disk folder "
                "(data.dataset=/path/to/data.jsonl), or "
                "data.data_files=... (docs/training.md, 'Your own data')."
            )
        self.local = local_source(o.dataset, o.data_files)
        super().__init__(o, model_kind, seed)

    def source_key(self) -> dict[str, Any]:
        o = self.options
        keys = ("dataset", "config", "revision", "text_column", "train_split", "val_split")
        key: dict[str, Any] = {k: getattr(o, k) for k in keys}
        if o.sample_by != "line":
            key["sample_by"] = o.sample_by
        if o.data_files is not None:
            key["data_files"] = o.data_files
        paths = [Path(f).expanduser() for f in _files_of(o.data_files)] if o.data_files else []
        paths += [Path(str(o.dataset)).expanduser()] if o.dataset else []
        files = [f for p in paths if p.exists() for f in ([p] if p.is_file() else sorted(p.rglob("*")))]
        if files:  # local data: its files' sizes and mtimes are part of the key
            key["files"] = [
                (str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files[:10_000] if p.is_file()
            ]
        return key

    def source_name(self) -> str:
        o = self.options
        if self.local is not None:
            kind, what = self.local
            return f"{kind}:{what[1] if kind == 'files' else what}"
        return f"hub:{o.dataset}" + (f"/{o.config}" if o.config else "")

    def _unreachable(self, detail: str) -> DataError:
        o = self.options
        cfg = f" data.config={o.config}" if o.config else ""
        return DataError(
            f"data=hub data.dataset={o.dataset}{cfg}: the Hugging Face hub is unreachable ({detail}) "
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
                o.dataset,
                o.config,
                split=split,
                revision=o.revision,
                cache_dir=str(self.cache_root / "hf_datasets"),
                streaming=bool(o.streaming),
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

    def _local_splits(self) -> dict[str, Any]:
        """``{split: Dataset}`` of local data (:func:`local_source`), read without the hub."""
        import datasets

        kind, what = self.local  # type: ignore[misc]
        was_enabled = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            cache = str(self.cache_root / "hf_datasets")
            text = {"sample_by": self.options.sample_by}
            if kind == "disk":
                loaded = _load_saved(Path(what))
            elif kind == "folder":
                kinds = {_kind_of(str(p)) for p in Path(what).rglob("*") if p.is_file()}
                extra = text if kinds == {"text"} else {}
                loaded = datasets.load_dataset(str(what), cache_dir=cache, streaming=True, **extra)
            else:
                builder, data_files = what
                extra = text if builder == "text" else {}
                loaded = datasets.load_dataset(
                    builder, data_files=data_files, cache_dir=cache, streaming=True, **extra
                )
        except StopIteration:  # a builder that found no row in the files (e.g. only blank lines)
            raise DataError(
                f"{self.source_name()}: the local data holds no rows; pass files with rows."
            ) from None
        except (ValueError, OSError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise DataError(f"{self.source_name()}: could not read the local data ({first}).") from None
        finally:
            if was_enabled:
                datasets.enable_progress_bars()
        single = isinstance(loaded, datasets.Dataset | datasets.IterableDataset)
        return {"train": loaded} if single else dict(loaded)

    def _splits(self) -> tuple[Any, Any | None]:
        """(training rows, validation rows or None: cut from the training text)."""
        o = self.options
        if self.local is None:
            if not hub_offline() and not hub_reachable():
                raise self._unreachable(
                    "no connection to the hub endpoint; if the dataset is cached, set HF_HUB_OFFLINE=1"
                )
            train = self._load_split(o.train_split)
            return train, self._load_split(o.val_split) if o.val_split else None
        splits = self._local_splits()
        if o.train_split not in splits:
            raise ConfigError(
                f"data.train_split={o.train_split!r} is not a split of {self.source_name()}; its splits: "
                f"{sorted(splits)}; set data.train_split=<one of them>."
            )
        val = splits.get(o.val_split) if o.val_split else None
        if o.val_split and val is None:
            log.info(
                "%s has no %r split (splits: %s): validating on the last data.val_fraction=%s of %r",
                self.source_name(),
                o.val_split,
                sorted(splits),
                o.val_fraction,
                o.train_split,
            )
        return splits[o.train_split], val

    def make_source(self) -> RowSource:
        """The rows of the splits, their text column checked on the first rows before anything is
        written."""
        train, val = self._splits()
        o = self.options
        files: list[Path] = []
        if self.local is not None and self.local[0] == "files":
            files = local_files(self.local[1][1])
        elif self.local is not None and self.local[0] == "folder":
            files = sorted(p for p in Path(self.local[1]).rglob("*") if p.is_file())
        source = RowSource(train, val, o.text_column, self.source_name(), o.val_fraction, files=files)
        source.check_column()
        return source
