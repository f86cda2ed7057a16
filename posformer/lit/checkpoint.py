"""Checkpoint compatibility: does a checkpoint's model match the config that loads it, and loading a module.

:func:`check_checkpoint_format` refuses what is not a posformer/Lightning checkpoint (a raw
``state_dict`` file) and checkpoints of a newer Lightning format than the installed one (Lightning
would only warn, and a resume could restart at step 0). :func:`check_checkpoint_matches` compares
the ``ModelConfig`` fields stored in a checkpoint's hyper-parameters with the current config (every
network-defining field must match; dropout and memory settings may differ). :func:`load_module`
rebuilds a posformer LightningModule from a checkpoint, safely
(:func:`posformer.io.safe_load_checkpoint`, ``weights_only=True``).

A checkpoint is data an attacker may control (``weights_only=True`` stops code, not values), so what
is read from one is checked before use: :func:`confine_checkpoint_paths` (the ``ModelCheckpoint``
paths in its callback state: never followed outside the checkpoint directory, rebased when the run dir
was moved; :class:`ConfinedCheckpointState` applies it on resume), :func:`check_pe_trusted` (a PE
named by import path is imported only when the user named it too or trusts the checkpoint's code).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from posformer.errors import CheckpointError
from posformer.io import safe_load_checkpoint
from posformer.model import ModelConfig

log = logging.getLogger(__name__)

__all__ = [
    "MODEL_FIELDS_FREE_TO_CHANGE",
    "TRUST_FLAG",
    "ConfinedCheckpointState",
    "check_data_fingerprint",
    "check_pe_trusted",
    "confine_checkpoint_paths",
    "data_fingerprint",
    "check_checkpoint_format",
    "check_checkpoint_matches",
    "load_module",
    "load_weights",
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


def load_weights(module: torch.nn.Module, path: str | os.PathLike[str]) -> list[str]:
    """Initialise ``module`` (a new run's LightningModule) from the weights of the checkpoint at ``path``
    (``init_from``: fine-tuning starts from them, with a new optimizer, schedule and step 0).

    Every parameter and buffer of the checkpoint's ``state_dict`` must have its counterpart of the same
    shape in ``module`` and the other way round; a mismatch is one :class:`CheckpointError` naming the
    first keys. Returns the network-defining model settings that differ from the checkpoint's (options
    without parameters, such as a rotary scaling): what the caller reports.
    """
    ckpt = read_checkpoint(path)
    state = ckpt["state_dict"]
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} in the checkpoint, {tuple(own[k].shape)} here"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        parts = [f"missing {missing[:4]}"] if missing else []
        parts += [f"unexpected {unexpected[:4]}"] if unexpected else []
        raise CheckpointError(
            f"init_from={str(path)!r} does not fit the configured model ({'; '.join(parts + shapes[:3])}); "
            "give the model and PE settings the checkpoint was trained with (its run's config.yaml), and the "
            "same tokenizer."
        )
    module.load_state_dict(state)
    saved = (ckpt.get("hyper_parameters") or {}).get("model") or {}
    current = module.hparams.get("model") or {}  # a PosformerModule's ModelConfig fields
    return model_config_differences(saved, current) if saved and current else []


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
                    "(it is neither read nor deleted)", path, cb.dirpath,
                )  # fmt: skip


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


# ------------------------------------------------------------------------------------------ data fingerprint
#: validation examples hashed into a data fingerprint (token ids after the tokenizer: the task, the data
#: file and the tokenizer all show in them)
FINGERPRINT_ROWS = 8


def data_fingerprint(dm: Any) -> str | None:
    """A short hash of the first :data:`FINGERPRINT_ROWS` validation examples as collated token tensors,
    or ``None`` when the datamodule cannot give them cheaply. Recorded in the checkpoint at training
    (``hyper_parameters.data.fingerprint``); another task with the same vocabulary, an edited data file
    or another tokenizer give another fingerprint. Leaves every RNG as it was."""
    try:
        with torch.random.fork_rng(devices=[]):
            loader = dm.val_dataloader()
            ds = loader.dataset
            rows = [ds[i] for i in range(min(FINGERPRINT_ROWS, len(ds)))]
            batch = loader.collate_fn(rows) if rows else {}
    except Exception:  # noqa: BLE001 - a datamodule without an indexable validation split: no fingerprint
        return None
    digest = hashlib.sha256()
    for key in sorted(batch) if isinstance(batch, Mapping) else []:
        value = batch[key]
        if isinstance(value, torch.Tensor):
            digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16] if rows else None


def tokenizer_mismatch(
    saved: Mapping[str, Any], dm: Any, path: str | os.PathLike[str], *, doing: str
) -> str | None:
    """The line saying that ``dm``'s pretrained tokenizer is not the one the checkpoint at ``path`` was
    trained with (the recorded ``tokenizer_identity`` differs: another tokenizer.json, another hub
    tokenizer), or ``None``. A tokenizer trained on the data (``char``, ``bpe``) changes with the data:
    :func:`check_data_fingerprint` names that. ``doing``: what is about to happen (``resume``,
    ``evaluate``)."""
    recorded = saved.get("tokenizer_identity") if isinstance(saved, Mapping) else None
    tok = dm.run_tokenizer() if hasattr(dm, "run_tokenizer") else None
    if not isinstance(recorded, str) or tok is None or not hasattr(tok, "identity"):
        return None
    if "pretrained" not in (saved.get("tokenizer"), tok.kind):
        return None
    current = tok.identity()
    if current == recorded:
        return None
    run = Path(path).resolve().parent.parent / "tokenizer"
    given = (getattr(dm, "options", None) or {}).get("tokenizer", tok.kind)
    return (
        f"checkpoint {str(path)!r} was trained with another tokenizer than data.tokenizer={given!r} gives "
        f"now ({saved.get('tokenizer')} tokenizer {recorded} at training, {tok.kind} {current} now), so "
        f"its token ids would mean other text; {doing} with the run's own: data.tokenizer={run}"
    )


def check_data_fingerprint(
    saved: Mapping[str, Any], dm: Any, path: str | os.PathLike[str], *, doing: str
) -> str | None:
    """The line saying that ``dm`` is not the data the checkpoint at ``path`` was trained on (its recorded
    fingerprint differs), or ``None`` (same data, or nothing recorded). ``saved``: the checkpoint's
    ``hyper_parameters.data``; ``doing``: what is about to happen (``resume``, ``evaluate``)."""
    recorded = saved.get("fingerprint") if isinstance(saved, Mapping) else None
    if not isinstance(recorded, str) or not recorded:
        return None
    current = data_fingerprint(dm)
    if current is None or current == recorded:
        return None
    return (
        f"checkpoint {str(path)!r} was trained on other data than the data this would {doing} with: the "
        f"token ids of the first validation examples differ (fingerprint {recorded} at training, {current} "
        "now), so the task, the data file or the tokenizer changed since (the vocabulary size may still "
        "match, which is why nothing else noticed). Use the data it was trained on"
    )
