"""Loading a checkpoint: the network for evaluation, a new run's weights, the data it was trained on.

:func:`load_checkpoint` restores the network of a posformer checkpoint (the layout in
:mod:`posformer.checkpoints`) with what evaluation needs to know of its training
(:class:`LoadedCheckpoint`); :func:`load_weights` initialises a new run's module from one
(``init_from``). The data checks: :func:`data_fingerprint` (recorded at training) and
:func:`check_data_fingerprint` / :func:`tokenizer_mismatch` / :func:`check_same_data` (the data about to
be used is the data the checkpoint was trained on).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posformer.checkpoints.read import (
    check_pe_trusted,
    model_config_differences,
    read_checkpoint,
    saved_model_config,
)
from posformer.data.files import default_cache_dir
from posformer.data.tokenizers import TOKENIZERS
from posformer.errors import CheckpointError
from posformer.model import ModelConfig, build_model
from posformer.model.size import check_model_fits

log = logging.getLogger(__name__)

__all__ = [
    "LoadedCheckpoint",
    "check_data_fingerprint",
    "check_same_data",
    "compile_options",
    "data_fingerprint",
    "load_checkpoint",
    "load_run_config",
    "load_weights",
    "tokenizer_mismatch",
    "train_length",
]

#: the prefix of the network's weights in a posformer checkpoint's ``state_dict``
MODEL_PREFIX = "model."

#: where a training run keeps its resolved config, relative to the run directory
RUN_CONFIG_NAMES = ("config.yaml", ".hydra/config.yaml")

#: data-config keys naming a directory the datamodule writes into (confined when read from a checkpoint)
WRITE_DIRS = ("cache_dir",)


# ---------------------------------------------------------------------------------------------- run config
def load_run_config(
    start: Path, *, levels: int = 1, names: Sequence[str] = RUN_CONFIG_NAMES, resolve: bool = True
) -> dict[str, Any] | None:
    """The training run's config as a plain dict: the first of ``names`` that loads, looked for in
    ``start`` and then up to ``levels - 1`` parent directories; ``None`` when there is none.

    ``resolve``: resolve interpolations (falling back to the unresolved config when they need Hydra,
    as in ``.hydra/config.yaml``); ``False``: keep them (the caller merges overrides first).
    """
    from omegaconf import OmegaConf

    for d in [start, *start.parents][:levels]:
        for name in names:
            cand = d / name
            if not cand.is_file():
                continue
            try:
                cfg = OmegaConf.load(cand)
                if resolve:
                    try:
                        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
                    except Exception:  # interpolations that need Hydra (.hydra/config.yaml)
                        pass
                return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]
            except Exception:  # an unreadable file: try the next candidate
                continue
    return None


def train_length(data_cfg: Mapping[str, Any]) -> int | tuple[int, int] | None:
    """The training length from a data config: ``train_len`` (int, or ``[min, max]`` / ``{min:, max:}``)."""
    for key in ("train_len", "train_length", "block_size", "seq_len"):
        v = data_cfg.get(key) if isinstance(data_cfg, Mapping) else None
        if v is None:
            continue
        if isinstance(v, Mapping):
            lo, hi = v.get("min", v.get("low")), v.get("max", v.get("high"))
            return (int(lo), int(hi)) if lo is not None else int(hi)
        if isinstance(v, (list, tuple)):
            return (int(v[0]), int(v[-1])) if len(v) > 1 and v[0] != v[-1] else int(v[-1])
        return int(v)
    for lo_key, hi_key in (("train_min_len", "train_max_len"), ("min_len", "max_len")):
        if isinstance(data_cfg, Mapping) and data_cfg.get(hi_key) is not None:
            return (int(data_cfg.get(lo_key) or 1), int(data_cfg[hi_key]))
    return None


# ---------------------------------------------------------------------------------------------- the loaders
@dataclass
class LoadedCheckpoint:
    """A model restored from a checkpoint, with what evaluation needs to know about its training.

    Attributes:
        path: the checkpoint file.
        model: the network in eval mode (``DecoderOnlyTransformer`` or ``EncoderDecoderTransformer``).
        model_cfg: its ``ModelConfig`` fields.
        data_cfg: the training data config (``hyper_parameters.data.config``, else the run's
            ``config.yaml``, else the facts in ``hyper_parameters.data``).
        seed: the training seed.
        hparams: the checkpoint's ``hyper_parameters``.
    """

    path: str
    model: nn.Module
    model_cfg: dict[str, Any]
    data_cfg: dict[str, Any]
    seed: int
    hparams: dict[str, Any]

    @property
    def pe(self) -> str:
        return str(self.model_cfg.get("pe", ""))

    @property
    def kind(self) -> str:
        return str(self.model_cfg.get("kind", ""))

    @property
    def variant(self) -> str | None:
        """The name of the run's variant (``+variant=prope``), ``None`` without one."""
        name = self.hparams.get("variant")
        return str(name) if name else None

    @property
    def train_len(self) -> int | tuple[int, int] | None:
        return train_length(self.data_cfg)


def load_checkpoint(
    path: Path | str,
    map_location: str | torch.device = "cpu",
    *,
    compile: bool = False,  # noqa: A002
    trust_code: bool | None = None,
) -> LoadedCheckpoint:
    """Restore the network of a posformer checkpoint (the layout in the module docstring).

    The model is built from ``hyper_parameters.model`` and takes the ``state_dict`` entries under
    ``model.`` (every one of them: a mismatch is a :class:`CheckpointError`). The data config and seed
    come from the checkpoint (``hyper_parameters.data.config`` / ``.seed``), else (older checkpoints) from
    the run directory's ``config.yaml`` (``<run>/checkpoints/x.ckpt`` -> ``<run>/config.yaml``), else from
    the saved data facts. ``compile``: apply the checkpoint's recorded
    ``torch.compile`` settings (``hyper_parameters.compile``), as its LightningModule would.

    The checkpoint is data: a ``module:Class`` PE is imported only when trusted
    (:func:`~posformer.checkpoints.read.check_pe_trusted`; ``trust_code=None``: when the command line
    names it or sets ``trust_checkpoint_code=true``), and a saved data ``cache_dir`` outside the run
    dir is replaced by the default cache (:func:`_confined_data_config`).
    """
    path = Path(path)
    ckpt = read_checkpoint(path, map_location)  # weights_only=True; missing/corrupt -> CheckpointError
    hp = dict(ckpt.get("hyper_parameters") or {})
    model_cfg = saved_model_config(ckpt, path)
    saved_data = dict(hp.get("data") or {})
    saved_cfg = saved_data.pop("config", None)
    saved_seed = saved_data.pop("seed", None)
    run_cfg = {} if saved_cfg else load_run_config(path.resolve().parent.parent) or {}
    data_cfg = dict(saved_cfg or run_cfg.get("data") or saved_data)
    seed = int(saved_seed if saved_seed is not None else run_cfg.get("seed") or hp.get("seed") or 0)
    if train_length(data_cfg) is None and train_length(saved_data) is not None:
        data_cfg["train_length"] = train_length(saved_data)
    data_cfg = _run_tokenizer(_confined_data_config(data_cfg, path), path)
    check_pe_trusted(model_cfg.get("pe"), path, trust_code)  # a module:Class PE: imported only if trusted
    known = set(ModelConfig.__dataclass_fields__)
    mc = ModelConfig(**{k: v for k, v in model_cfg.items() if k in known})
    check_model_fits(mc, f"checkpoint {str(path)!r}")  # an absurd size: refused before any allocation
    model = build_model(mc)
    max_steps = int(hp.get("max_steps") or -1)  # the PEs of the checkpoint's step (layer kinds' switches)
    model.apply_switches(int(ckpt.get("global_step") or 0), max_steps if max_steps > 0 else None)
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODEL_PREFIX)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model built from its config: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}."
        )
    if compile:
        options = compile_options(hp.get("compile"))
        if options is not None:
            model.compile(**options)
    model.eval()
    return LoadedCheckpoint(str(path), model, mc.to_dict(), data_cfg, seed, hp)


def compile_options(cfg: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments from the ``compile`` config, or ``None`` when it is off.

    ``{enabled: true, backend: inductor, mode: null, dynamic: null, fullgraph: false}``; null entries
    take torch's defaults.
    """
    if not cfg or not cfg.get("enabled", False):
        return None
    keys = ("backend", "mode", "dynamic", "fullgraph")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


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


def _confined_data_config(data_cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The checkpoint's data config with every directory posformer would *write* to (``cache_dir``) kept
    only when it lies inside the checkpoint's run dir; elsewhere the default cache
    (``$POSFORMER_CACHE`` or ``~/.cache/posformer``) is used instead (``eval.data={cache_dir: ...}``
    chooses another)."""
    run_dir = path.resolve().parent.parent
    out = dict(data_cfg)
    for key in WRITE_DIRS:
        value = out.get(key)
        if value is None:
            continue
        inside = isinstance(value, str) and Path(os.path.realpath(value)).is_relative_to(run_dir)
        if not inside:
            out[key] = str(default_cache_dir())
    return out


def _run_tokenizer(data_cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """A pretrained ``data.tokenizer`` read from the run's own copy (``<run>/tokenizer``, saved at
    training) when there is one: evaluation needs neither the original file nor the hub."""
    saved = path.resolve().parent.parent / "tokenizer"
    value = data_cfg.get("tokenizer")
    if isinstance(value, str) and value not in TOKENIZERS and (saved / "pretrained.json").is_file():
        return {**data_cfg, "tokenizer": str(saved)}
    return data_cfg


# ---------------------------------------------------------------------------------------------- the data
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
    given = getattr(getattr(dm, "options", None), "tokenizer", tok.kind)  # the datamodule's typed options
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


def check_same_data(ck: LoadedCheckpoint, dm: Any, overrides: Mapping[str, Any] | None = None) -> None:
    """Evaluation data that is not what the checkpoint was trained on (its recorded data fingerprint,
    :func:`check_data_fingerprint`): refused when nothing asked for other data
    (an edited data file would be scored with shifted token ids), one warning line when ``eval.data``
    overrides chose it. Another tokenizer (:func:`tokenizer_mismatch`) is
    refused either way: its ids are not the ones the model learned."""
    other_tokenizer = tokenizer_mismatch(ck.hparams.get("data") or {}, dm, ck.path, doing="evaluate")
    if other_tokenizer:
        raise CheckpointError(f"{other_tokenizer} (or drop the eval.data override of data.tokenizer).")
    line = check_data_fingerprint(ck.hparams.get("data") or {}, dm, ck.path, doing="evaluate")
    if line is None:
        return
    if overrides:
        log.warning("%s; evaluating anyway, as eval.data=%s asks.", line, dict(overrides))
        return
    raise CheckpointError(
        f"{line} (restore the data file), or say that other data is meant with an eval.data override "
        "(then this is a warning)."
    )
