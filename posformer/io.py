"""Safe file input/output: atomic writes and checkpoints that load without running code.

Atomic writes
    :func:`atomic_write_bytes` / :func:`atomic_write_text` / :func:`atomic_write_json` /
    :func:`atomic_torch_save` write to a temporary file *in the destination directory*, ``fsync`` it,
    then ``os.replace`` it over the destination (atomic on POSIX and Windows within one file system)
    and ``fsync`` the directory. A crash, a kill or an exception at any point leaves either the old
    file or the new one, never a partial file; the temporary file is removed on errors (a SIGKILL can
    leave a ``.<name>.*.tmp`` file next to the destination, never a damaged destination). New files
    get the usual ``0o666 & ~umask`` mode; an existing file keeps its mode.

Safe checkpoints
    :func:`safe_load_checkpoint` is the one place posformer reads a ``.ckpt``: ``torch.load(...,
    weights_only=True)``, so a file cannot execute code while it is read (pickle ``__reduce__``
    payloads are refused), and every failure (missing, a directory, empty, truncated, corrupted,
    unsafe, not a dict) becomes one :class:`~posformer.errors.CheckpointError` naming the file and the
    fix. :class:`SafeCheckpointIO` plugs both into Lightning (``L.Trainer(plugins=[SafeCheckpointIO()])``):
    ``ModelCheckpoint`` and ``Trainer.save_checkpoint`` write atomically, and ``Trainer.fit/test(
    ckpt_path=...)`` load with ``weights_only=True`` whatever the caller asks for.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import stat
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from posformer.errors import CheckpointError, ConfigError

__all__ = [
    "SafeCheckpointIO",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_writable_dir",
    "json_safe",
    "safe_load_checkpoint",
]


# ------------------------------------------------------------------------------------------ atomic writes
def _umask() -> int:
    """The process umask, read without changing it where possible (``os.umask`` is process-wide,
    so the set-and-restore fallback is briefly racy with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str | os.PathLike[str], write: Callable[[Any], None]) -> Path:
    """Call ``write(binary_file)`` on a temp file next to ``path``, then replace ``path`` with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + fsync + os.replace)."""
    return _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode(encoding))


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by ``None`` (strict JSON) and tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> Path:
    """Write ``obj`` as strict JSON (NaN/inf -> null) to ``path`` atomically.

    The object is serialised *before* the file is touched, so an unserialisable value leaves the
    old file as it was.
    """
    text = json.dumps(json_safe(obj), indent=indent, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (serialised in memory first, then written)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getbuffer())


def check_writable_dir(path: str | os.PathLike[str], what: str = "output directory") -> Path:
    """Create ``path`` if needed and prove it is writable (a probe file); else a ConfigError.

    Called before training starts so that a bad output directory fails in a second, not after hours.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".posformer-write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{what} {str(path)!r} is not writable ({reason}); choose a writable location, e.g. "
            "hydra.run.dir=outputs/my_run (or paths.log_dir=/writable/dir)."
        ) from None
    return path


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


def _lightning_checkpoint_io() -> type:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    return TorchCheckpointIO


class SafeCheckpointIO(_lightning_checkpoint_io()):  # type: ignore[misc]
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


# ------------------------------------------------------------------------------------------ compatibility
#: ModelConfig fields that may differ between a checkpoint and the run that loads it (regularisation
#: and memory settings); every other field defines the network and must match.
MODEL_FIELDS_FREE_TO_CHANGE = frozenset({"dropout", "attn_dropout", "attention_chunk_mb"})


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
    from posformer.model import ModelConfig

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


def load_module(
    cls: type, path: str | os.PathLike[str], expected_model: Mapping[str, Any] | None = None
) -> Any:
    """A posformer LightningModule rebuilt from a checkpoint's hyper-parameters and weights, safely.

    ``expected_model`` (ModelConfig fields of the current config): a network-defining difference is
    reported by :func:`check_checkpoint_matches` instead of being silently replaced.
    """
    ckpt = safe_load_checkpoint(path)
    hp = ckpt.get("hyper_parameters")
    if not isinstance(hp, Mapping) or "model" not in hp or "state_dict" not in ckpt:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no posformer hyper-parameters/state_dict (keys: {sorted(ckpt)}); "
            "pass a checkpoint written by posformer-train."
        )
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


# ------------------------------------------------------------------------------------------ run-dir precheck
def _static_prefix(value: str) -> str:
    """The part of a (possibly interpolated) path before its first ``${...}``."""
    value = value.strip().strip("'\"")
    return value.split("${", 1)[0] if "${" in value else value


def run_dir_from_argv(argv: list[str]) -> tuple[str, Path] | None:
    """The Hydra override that decides where a run writes, and the fixed part of its path.

    ``hydra.run.dir`` (``hydra.sweep.dir`` with ``-m``), else ``paths.log_dir``/``paths.root_dir``, else
    ``$POSFORMER_ROOT`` or the working directory + ``outputs``. Values with interpolations are cut at
    the first ``${``.
    """
    values = {}
    for arg in argv:
        if "=" in arg and not arg.startswith(("-", "~")):
            key, value = arg.split("=", 1)
            values[key.lstrip("+")] = value
    multirun = any(a in ("-m", "--multirun") for a in argv)
    for key in ("hydra.sweep.dir" if multirun else "hydra.run.dir", "paths.log_dir", "paths.root_dir"):
        if key in values and _static_prefix(values[key]):
            return key, Path(_static_prefix(values[key])).expanduser()
    if "hydra.run.dir" in values or "hydra.sweep.dir" in values:
        return None
    root = os.environ.get("POSFORMER_ROOT") or os.getcwd()
    return "paths.root_dir", Path(root) / "outputs"


def precheck_run_dir(argv: list[str]) -> None:
    """Fail before Hydra starts when the run directory cannot be created (Hydra itself would fail
    with a traceback): the nearest existing ancestor must be a writable directory. Creates nothing."""
    found = run_dir_from_argv(argv)
    if found is None:
        return
    key, path = found
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    problem = ""
    if not probe.is_dir():
        problem = f"{probe} is a file, not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{probe} is not writable"
    if problem:
        raise ConfigError(
            f"{key}={str(path)!r}: the run directory cannot be created ({problem}); choose a writable "
            "location, e.g. hydra.run.dir=outputs/my_run or paths.log_dir=/writable/dir."
        )
