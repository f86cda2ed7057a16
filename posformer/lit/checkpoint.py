"""Checkpoint compatibility: does a checkpoint's model match the config that loads it, and loading a module.

:func:`check_checkpoint_format` refuses what is not a posformer/Lightning checkpoint (a raw
``state_dict`` file) and checkpoints of a newer Lightning format than the installed one (Lightning
would only warn, and a resume could restart at step 0). :func:`check_checkpoint_matches` compares
the ``ModelConfig`` fields stored in a checkpoint's hyper-parameters with the current config (every
network-defining field must match; dropout and memory settings may differ). :func:`load_module`
rebuilds a posformer LightningModule from a checkpoint, safely
(:func:`posformer.io.safe_load_checkpoint`, ``weights_only=True``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from posformer.errors import CheckpointError
from posformer.io import safe_load_checkpoint
from posformer.model import ModelConfig

__all__ = [
    "MODEL_FIELDS_FREE_TO_CHANGE",
    "check_checkpoint_format",
    "check_checkpoint_matches",
    "load_module",
    "model_config_differences",
]


#: ModelConfig fields that may differ between a checkpoint and the run that loads it (regularisation
#: and memory settings); every other field defines the network and must match.
MODEL_FIELDS_FREE_TO_CHANGE = frozenset(
    {"dropout", "attn_dropout", "attention_chunk_mb", "attention_backend"}
)


def _normalise(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def check_checkpoint_format(checkpoint: Mapping[str, Any], path: str | os.PathLike[str] = "") -> None:
    """Raise a CheckpointError unless ``checkpoint`` is a Lightning checkpoint dict (``state_dict``,
    ``hyper_parameters``) of a Lightning version not newer than the installed one."""
    where = f" {str(path)!r}" if path else ""
    if "state_dict" not in checkpoint:
        tensors = [k for k, v in checkpoint.items() if hasattr(v, "shape")]
        what = (
            f"a raw state_dict ({len(tensors)} tensors, e.g. {tensors[0]!r})"
            if tensors and len(tensors) == len(checkpoint)
            else f"a dict with keys {sorted(map(str, checkpoint))[:6]}"
        )
        raise CheckpointError(
            f"checkpoint{where} is {what}, not a Lightning checkpoint: it has no 'state_dict' and no "
            "'hyper_parameters' (the model config), so posformer cannot rebuild the model from it. Pass a "
            ".ckpt written by posformer-train (e.g. <run>/checkpoints/last.ckpt)."
        )
    saved = checkpoint.get("pytorch-lightning_version")
    if saved is None:
        return
    import lightning
    from packaging.version import InvalidVersion, Version

    try:
        newer = Version(str(saved)) > Version(lightning.__version__)
    except InvalidVersion:
        newer = True
    if newer:
        raise CheckpointError(
            f"checkpoint{where} was written by Lightning {saved}, newer than the installed Lightning "
            f"{lightning.__version__} (limit: a checkpoint format up to {lightning.__version__}); its loop "
            "state may not be understood and a resume could silently restart at step 0. Upgrade Lightning "
            f"(pip install -U 'lightning>={saved}') or use a checkpoint written with this version."
        )


def model_config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: checkpoint=X, config=Y`` for every network-defining ``ModelConfig`` field that differs.

    Fields missing on one side are compared with the ``ModelConfig`` default.
    """
    defaults = ModelConfig().to_dict()
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in MODEL_FIELDS_FREE_TO_CHANGE:
            continue
        a = _normalise(saved.get(key, defaults.get(key)))
        b = _normalise(current.get(key, defaults.get(key)))
        if key == "pe_options":  # options at their default on one side and absent on the other
            a, b = dict(a or {}), dict(b or {})
        if a != b:
            out.append(f"model.{key}: checkpoint={a!r}, config={b!r}")
    return out


def check_checkpoint_matches(
    checkpoint: Mapping[str, Any], current_model: Mapping[str, Any], *, path: str | os.PathLike[str] = ""
) -> None:
    """Raise a CheckpointError when the checkpoint's model (``hyper_parameters.model``) differs from
    ``current_model`` (ModelConfig fields) in anything but dropout/memory settings.

    Called when a checkpoint is loaded into an existing module (resume, ``train=false`` evaluation):
    a different PE, size or vocabulary would otherwise surface as a long ``load_state_dict`` error, or
    (for parameter-free PEs such as ALiBi vs RoPE, or same-size vocabularies) not at all.
    """
    check_checkpoint_format(checkpoint, path)
    saved = ((checkpoint.get("hyper_parameters") or {}).get("model")) or {}
    if not isinstance(saved, Mapping) or not saved:
        return  # not a posformer checkpoint: the state dict load decides
    diffs = model_config_differences(saved, current_model)
    if diffs:
        where = f" {str(path)!r}" if path else ""
        raise CheckpointError(
            f"checkpoint{where} was trained with a different model than this config: "
            + "; ".join(diffs)
            + ". Use the checkpoint's settings (e.g. pe=<its pe>, the same data and tokenizer) "
            "or a checkpoint trained with this config."
        )


def read_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, verify: bool = True, mmap: bool = False
) -> dict[str, Any]:
    """The checkpoint dict at ``path`` (``safe_load_checkpoint``: weights only, CRC-checked); it must be a
    Lightning checkpoint of a version not newer than the installed one (:func:`check_checkpoint_format`).
    The one reader of training's ``load_module`` and evaluation's ``load_checkpoint``."""
    ckpt = safe_load_checkpoint(path, map_location, verify=verify, mmap=mmap)
    check_checkpoint_format(ckpt, path)  # a raw state_dict, a newer Lightning format: CheckpointError
    return ckpt


def saved_model_config(ckpt: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """``hyper_parameters.model`` of a checkpoint dict (the ``ModelConfig`` fields it was trained with)."""
    hp = ckpt.get("hyper_parameters") or {}
    model_cfg = hp.get("model") if isinstance(hp, Mapping) else None
    if not isinstance(model_cfg, Mapping):
        raise CheckpointError(
            f"checkpoint {str(path)!r} records no model config in its hyper_parameters (looked for model); "
            f"keys present: {sorted(hp)}. Pass a checkpoint written by posformer-train."
        )
    return dict(model_cfg)


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
