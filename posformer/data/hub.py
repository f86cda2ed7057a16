"""Hugging Face hub loading: ``data=hub`` (a dataset's text column) and hub translation splits.

- :func:`hub_offline` / :func:`hub_reachable`: offline mode is set, or the hub endpoint does not
  answer within a few seconds; either way an uncached dataset is a :class:`~posformer.errors.DataError`
  saying how to get it (copy the cache, ``HF_HUB_OFFLINE=1``, or a local file), not a long hang.
- :class:`HubDataModule`: language modelling on a hub dataset's text column, through
  :class:`~posformer.data.lm.LMDataModule` (its validation split when it has one, else the last
  ``val_fraction`` of the training split); the processed streams are cached like ``data=text``.
- :func:`load_hub_split`: ``(source, target, fingerprint)`` of a translation split (``translation``
  column), for :mod:`posformer.data.translation`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from posformer.data.lm import COMMON_DEFAULTS, LMDataModule
from posformer.errors import ConfigError, DataError

HUB_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "dataset": None,
    "config": None,
    "revision": None,
    "text_column": "text",
    "train_split": "train",
    "val_split": "validation",  # None: the last val_fraction of the training split
}


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


# ------------------------------------------------------------------------------------ data=hub (LM)
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


# ------------------------------------------------------------------------------ translation splits
def load_hub_split(
    name: str, config: str | None, split: str, src_lang: str, tgt_lang: str, revision: str | None = None
) -> tuple[list[str], list[str], str]:
    """(source, target, fingerprint) of a hub translation dataset split (``translation`` column)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, revision=revision)
    except Exception as exc:  # noqa: BLE001 - network, missing dataset, missing split: all one message
        raise DataError(
            f"could not load the Hugging Face dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(exc).__name__}: {str(exc)[:300]}. The hub is needed the first time (it is then cached in "
            "HF_DATASETS_CACHE); offline, use data.source=local with data.path pointing at parallel text "
            "files."
        ) from None
    if "translation" not in ds.column_names:
        raise DataError(f"hub dataset {name!r} has columns {ds.column_names}, not a 'translation' column.")
    pairs = ds["translation"]
    try:
        src = [p[src_lang] for p in pairs]
        tgt = [p[tgt_lang] for p in pairs]
    except KeyError as exc:
        raise DataError(
            f"hub dataset {name!r}/{config!r} has no language {exc}; languages: "
            f"{sorted(pairs[0]) if pairs else []}. Fix data.src_lang/tgt_lang."
        ) from None
    return src, tgt, str(getattr(ds, "_fingerprint", ""))
