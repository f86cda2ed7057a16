"""Lightning's side of checkpoints: rebuilding a module, the ``CheckpointIO`` plugin, resumed callback state.

:func:`load_module` rebuilds a posformer LightningModule from a checkpoint, safely
(:func:`posformer.checkpoints.read_checkpoint`, ``weights_only=True``). :class:`SafeCheckpointIO` plugs
the safe reader and atomic writes into Lightning (``L.Trainer(plugins=[SafeCheckpointIO()])``):
``ModelCheckpoint`` and ``Trainer.save_checkpoint`` write atomically, and ``Trainer.fit/test(
ckpt_path=...)`` load with ``weights_only=True`` whatever the caller asks for. A checkpoint is data an
attacker may control, so the paths in its callback state are confined before Lightning uses them
(:func:`confine_checkpoint_paths`, :class:`ConfinedCheckpointState`). Everything about checkpoints
that does not need Lightning is in :mod:`posformer.checkpoints`.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from posformer.checkpoints import (
    check_checkpoint_matches,
    check_pe_trusted,
    read_checkpoint,
    safe_load_checkpoint,
    saved_model_config,
)
from posformer.errors import CheckpointError
from posformer.io import atomic_torch_save

log = logging.getLogger(__name__)

__all__ = ["ConfinedCheckpointState", "SafeCheckpointIO", "confine_checkpoint_paths", "load_module"]


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO``: atomic, fsynced saves and ``weights_only=True`` loads.

    ``L.Trainer(..., plugins=[SafeCheckpointIO()])``. Loading ignores a caller's ``weights_only=False``
    on purpose: a checkpoint must never be able to run code. Errors are :class:`CheckpointError`.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support storage_options.")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        del weights_only  # always True
        return safe_load_checkpoint(path, map_location if map_location is not None else "cpu")


def load_module(
    cls: type, path: str | os.PathLike[str], expected_model: Mapping[str, Any] | None = None
) -> Any:
    """A posformer LightningModule rebuilt from a checkpoint's hyper-parameters and weights, safely.

    ``expected_model`` (ModelConfig fields of the current config): a network-defining difference is
    reported by :func:`check_checkpoint_matches` instead of being silently replaced.
    """
    ckpt = read_checkpoint(path)
    saved_model_config(ckpt, path)  # no model config: one clear line
    hp = ckpt["hyper_parameters"]
    if expected_model is not None:
        check_checkpoint_matches(ckpt, expected_model, path=path)
    accepted = set(inspect.signature(cls).parameters)
    unknown = sorted(str(k) for k in hp if k not in accepted) if isinstance(hp, Mapping) else ["<not a dict>"]
    if unknown:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has hyper_parameters {unknown} that {cls.__name__} does not take "
            f"(allowed: {sorted(accepted)}); the file was edited or written by another program. Pass a "
            "checkpoint written by posformer-train."
        )
    check_pe_trusted(saved_model_config(ckpt, path).get("pe"), path)
    module = cls(**hp)
    try:
        module.load_state_dict(ckpt["state_dict"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the model its own hyper-parameters describe "
            f"({' '.join(first[:2])[:300]}); the file was edited or written by another version."
        ) from None
    return module


# ------------------------------------------------------------------------------------------ checkpoint data
#: ``ModelCheckpoint`` state fields that hold one file path; ``best_k_models`` maps paths to scores
PATH_FIELDS = ("best_model_path", "last_model_path", "kth_best_model_path")


def _inside(path: str, directory: Path) -> bool:
    """Whether ``path`` (symlinks and ``..`` resolved) lies inside ``directory`` (resolved)."""
    return Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(directory)))


def _confined(value: Any, saved_dir: str, dirpath: Path) -> str:
    """``value`` rebased from ``saved_dir`` onto ``dirpath`` when it was under it; ``""`` when the result
    is not a path inside ``dirpath`` (or, once rebased, not an existing file)."""
    if not isinstance(value, str) or not value:
        return ""
    moved = os.path.normpath(saved_dir) != os.path.normpath(dirpath)
    if moved:
        rel = os.path.relpath(os.path.normpath(value), os.path.normpath(saved_dir)) if saved_dir else ""
        if not rel or rel.startswith(".."):
            return ""
        value = str(dirpath / rel)
        if not os.path.isfile(value):
            return ""
    return value if _inside(value, dirpath) else ""


def confine_checkpoint_paths(state: dict[str, Any], dirpath: str | os.PathLike[str]) -> list[str]:
    """Make a saved ``ModelCheckpoint`` state safe for a checkpoint callback writing to ``dirpath``.

    Lightning deletes the previous best/last file named in this state when it saves the next one, and
    tests "inside the checkpoint dir" without resolving ``..``: a crafted ``<dir>/../../victim.txt``
    would be deleted. Every path field is kept only when it resolves inside ``dirpath``; when the run
    dir was moved (the saved ``dirpath`` differs), paths under the saved one are rebased onto
    ``dirpath`` (files that exist there) and ``dirpath`` is updated, so Lightning keeps its
    ``last.ckpt`` instead of writing ``last-v1.ckpt`` beside a stale one. Mutates ``state``; returns
    the paths dropped.
    """
    dirpath = Path(dirpath)
    saved_dir = state.get("dirpath")
    saved_dir = saved_dir if isinstance(saved_dir, str) else ""
    dropped: list[str] = []
    for field in PATH_FIELDS:
        value = state.get(field)
        if value:
            state[field] = _confined(value, saved_dir, dirpath)
            if not state[field]:
                dropped.append(str(value))
    best_k = state.get("best_k_models")
    if isinstance(best_k, Mapping):
        kept = {}
        for path, score in best_k.items():
            new = _confined(path, saved_dir, dirpath)
            if new:
                kept[new] = score
            else:
                dropped.append(str(path))
        state["best_k_models"] = kept
    elif best_k is not None:
        state["best_k_models"] = {}
    state["dirpath"] = str(dirpath)
    return dropped


class ConfinedCheckpointState(Callback):
    """On resume, confines every ``ModelCheckpoint`` state of the checkpoint to that callback's own
    directory (:func:`confine_checkpoint_paths`) before Lightning restores it; one warning line per
    dropped path."""

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict):
            checkpoint["callbacks"] = {}
            return
        for cb in trainer.checkpoint_callbacks:
            state = states.get(cb.state_key)
            if not isinstance(state, dict) or not getattr(cb, "dirpath", None):
                continue
            for path in confine_checkpoint_paths(state, cb.dirpath):
                log.warning(
                    "the resumed checkpoint names %r, outside its checkpoint directory %s: ignored "
                    "(it is neither read nor deleted)",
                    path,
                    cb.dirpath,
                )


# ------------------------------------------------------------------------------------------ data fingerprint
