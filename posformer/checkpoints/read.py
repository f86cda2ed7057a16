"""Reading a checkpoint safely, and what it says about the model: the *trust* and *read* steps.

:func:`safe_load_checkpoint` is the one place posformer reads a ``.ckpt``: ``torch.load(...,
weights_only=True)``, so a file cannot execute code while it is read (pickle ``__reduce__`` payloads
are refused), and every failure (missing, a directory, empty, truncated, corrupted, unsafe, not a
dict) becomes one :class:`~posformer.errors.CheckpointError` naming the file and the fix; the CRC-32
of every archive member is checked first. :func:`read_checkpoint` adds the format check (a Lightning
checkpoint, of a Lightning version not newer than the installed one). :func:`check_checkpoint_matches`
compares the ``ModelConfig`` fields stored in a checkpoint with a config (every network-defining field
must match; dropout and memory settings may differ). A checkpoint is data an attacker may control
(``weights_only=True`` stops code, not values): :func:`check_pe_trusted` imports a PE named by import
path only when the user named it too or trusts the checkpoint's code.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from posformer.errors import CheckpointError
from posformer.model import ModelConfig

__all__ = [
    "MODEL_FIELDS_FREE_TO_CHANGE",
    "TRUST_FLAG",
    "check_checkpoint_format",
    "check_checkpoint_matches",
    "check_pe_trusted",
    "checkpoint_step",
    "model_config_differences",
    "peek_model_config",
    "read_checkpoint",
    "safe_load_checkpoint",
    "saved_model_config",
]


# ------------------------------------------------------------------------------------------ safe loading
_FIX_CORRUPT = (
    "it was probably truncated by an interrupted copy or write, or is not a PyTorch checkpoint; "
    "use another checkpoint (e.g. last.ckpt or an earlier step) or copy it again."
)


def _verify_zip(p: Path, size: int, what: str) -> None:
    """Check every member's CRC-32 (torch's zip writer records them): catches flipped/zeroed bytes."""
    try:
        with zipfile.ZipFile(p) as zf:
            bad = zf.testzip()
    except Exception as exc:  # noqa: BLE001 - damaged headers raise BadZipFile/UnicodeDecodeError/zlib.error/...
        raise CheckpointError(
            f"{what} {str(p)!r} ({size} bytes) is a damaged zip archive ({exc}); {_FIX_CORRUPT}"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"{what} {str(p)!r} ({size} bytes) is corrupted: the checksum (CRC-32) of its member {bad!r} "
            f"does not match; {_FIX_CORRUPT}"
        )


def safe_load_checkpoint(
    path: str | os.PathLike[str],
    map_location: Any = "cpu",
    *,
    what: str = "checkpoint",
    verify: bool = True,
    mmap: bool = False,
) -> dict[str, Any]:
    """Read a checkpoint file with ``torch.load(weights_only=True)``; every failure is a CheckpointError.

    Only tensors, primitive types and containers (plus the few classes torch allow-lists) can be
    unpickled, so loading a file cannot run code. Posformer's own checkpoints contain nothing else.

    ``mmap``: map tensor storages instead of reading them (cheap look at the hyper-parameters).
    ``verify``: check the CRC-32 of every archive member first (reads the file once more; detects
    bytes changed on disk that would otherwise load as silently wrong weights).

    Raises:
        CheckpointError: the file is missing, a directory, empty, truncated/corrupted, contains
            objects that would need arbitrary code to rebuild, or is not a checkpoint dict.
    """
    p = Path(path)
    if not p.exists():
        hint = ""
        if p.parent.is_dir():
            near = sorted(q.name for q in p.parent.glob("*.ckpt"))[:8]
            hint = f" {p.parent} holds: {', '.join(near)}." if near else f" {p.parent} holds no .ckpt files."
        raise CheckpointError(
            f"{what} {str(p)!r} does not exist.{hint} Pass an existing file, e.g. "
            "ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt."
        )
    if p.is_dir():
        raise CheckpointError(f"{what} {str(p)!r} is a directory; pass the .ckpt file inside it.")
    size = p.stat().st_size
    if size == 0:
        raise CheckpointError(f"{what} {str(p)!r} is empty (0 bytes); {_FIX_CORRUPT}")
    if verify and zipfile.is_zipfile(p):
        _verify_zip(p, size, what)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            ckpt = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "weights only" in text.lower() or "weights_only" in text:
            lines = [ln.strip() for ln in text.splitlines()]
            detail = next(
                (ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln), "unsupported content"
            )
            raise CheckpointError(
                f"{what} {str(p)!r} was refused: it contains objects that only arbitrary code could rebuild "
                f"({detail}), and posformer loads checkpoints with weights_only=True so that a file cannot "
                "run code. Use a checkpoint written by posformer-train; if you trust this file, re-save its "
                "state dict with plain tensors."
            ) from None
        raise CheckpointError(
            f"{what} {str(p)!r} ({size} bytes) cannot be unpickled: {exc}; {_FIX_CORRUPT}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/EOFError/KeyError/... on bad files
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        kind = "is not a complete PyTorch zip archive" if not zipfile.is_zipfile(p) else "is unreadable"
        raise CheckpointError(
            f"{what} {str(p)!r} ({size} bytes) {kind} ({type(exc).__name__}: {msg}); {_FIX_CORRUPT}"
        ) from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(
            f"{what} {str(p)!r} holds a {type(ckpt).__name__}, not a checkpoint dict; pass a Lightning .ckpt "
            "written by posformer-train."
        )
    return ckpt


# ------------------------------------------------------------------------------------------ format, model
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


def peek_model_config(path: str | Path) -> dict[str, Any]:
    """The saved model config of ``path``, cheaply (memory-mapped, no CRC check); ``{}`` if none."""
    hp = safe_load_checkpoint(path, verify=False, mmap=True).get("hyper_parameters") or {}
    return dict(hp.get("model") or {})


def checkpoint_step(path: Path) -> int:
    """Training step of a checkpoint: from its ``global_step``, else from ``step<N>`` in the file name."""
    try:
        return int(safe_load_checkpoint(path, verify=False, mmap=True).get("global_step", -1))
    except Exception:  # noqa: BLE001 - fall back to the name
        m = re.search(r"step[=_-]?(\d+)", path.name)
        return int(m.group(1)) if m else -1


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


# ------------------------------------------------------------------------------------------ trust
#: the override that lets a checkpoint's ``module:Class`` PE be imported without naming it
TRUST_FLAG = "trust_checkpoint_code"


def command_line_overrides() -> list[str]:
    """The overrides of the running Hydra job (``[]`` outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    except Exception:  # noqa: BLE001 - not under Hydra
        return []


def check_pe_trusted(pe: Any, path: str | os.PathLike[str], trusted: bool | None = None) -> None:
    """Refuse a checkpoint whose PE is an import path ``module:Class`` (importing runs that module's
    code) unless ``trusted``; ``None``: trusted when the command line names that import path too (any
    override's value) or sets ``...trust_checkpoint_code=true``. Registry names always pass."""
    if not isinstance(pe, str):
        raise CheckpointError(f"checkpoint {str(path)!r} names model.pe={pe!r}, which is not a PE name.")
    if ":" not in pe or trusted:
        return
    if trusted is None:
        for override in command_line_overrides():
            key, _, value = override.lstrip("+~").partition("=")
            if value.strip("'\"") == pe or (
                key.rsplit(".", 1)[-1] == TRUST_FLAG and value.lower() in ("true", "1", "yes")
            ):
                return
    raise CheckpointError(
        f"checkpoint {str(path)!r} names its PE by import path model.pe={pe!r}; importing it would run that "
        f"module's code, and a checkpoint is only data. If you trust it, add +{TRUST_FLAG}=true (when "
        f"resuming training, naming it as model.pe={pe} is enough)."
    )
