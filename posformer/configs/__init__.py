"""Hydra configs shipped with posformer (``configs/`` in the repository is a symlink here).

Importing this package (Hydra does, to read the files) registers the schema nodes the YAML files start
with (:func:`register_schemas`) and the config resolvers:

- ``${posformer_cwd:}``: the working directory; unlike ``${hydra:runtime.cwd}`` it also resolves
  where Hydra's runtime config is not set yet, e.g. in the multirun sweep dir.
- ``${posformer_job_dirname:num,job_overrides,sweep_dir}``: the sweep subdir of one job,
  :func:`job_dirname` (``3_pe-rope_seed-1``).
- ``${posformer_tensorboard_dir:output_dir,ckpt_path}``: where the TensorBoard logger writes; a run
  resumed from ``<run>/checkpoints/x.ckpt`` continues ``<run>/tensorboard`` (:func:`tensorboard_dir`).

Sweep names come from the *swept* keys only (those with several values in the multirun's
``multirun.yaml``: command-line sweeps and ``hydra.sweeper.params``), never from the fixed overrides.
:func:`job_items` gives ``(short key, value)`` pairs that name the job directory and, in
:mod:`posformer.eval.sweep`, its label (``rope · seed 1``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from posformer.configs import eval_schema
from posformer.configs.schema import TrainConfig
from posformer.conform import schema_node
from posformer.data.options import DATASETS
from posformer.model.config import ModelConfig

#: characters a job-dir part keeps: safe in file names and unquoted in any Hydra override value
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")
#: hard cap on a job-dir name (file systems allow 255 bytes)
_NAME_MAX = 200


def safe_name(text: str) -> str:
    """``text`` with every run of characters outside ``[A-Za-z0-9._+-]`` replaced by one ``-``.

    The result has no ``=``, ``,``, ``/``, brackets, quotes or spaces: it is a valid file name and can
    be pasted unquoted into a Hydra override (``ckpt_path=…/<name>/…``, ``eval.checkpoints=[…]``).
    """
    return _UNSAFE.sub("-", str(text)).strip("-") or "x"


@functools.lru_cache(maxsize=32)
def _swept_keys_cached(path: str, mtime: float) -> tuple[str, ...]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = OmegaConf.load(path)
    raw = [str(o) for o in OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or []]
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    raw += [f"{k}={v}" for k, v in params.items()]  # sweeper params: Hydra's and Optuna's syntax
    keys: list[str] = []
    for text in raw:
        key, _, value = text.partition("=")
        try:
            [override] = OverridesParser.create().parse_overrides([text])
            swept = override.is_sweep_override()
            key = override.get_key_element()
        except Exception:  # noqa: BLE001 - a sweeper's own syntax (e.g. Optuna's interval(0.1, 1))
            swept = "(" in value or "," in value
        key = key.lstrip("+~")
        if swept and key not in keys:
            keys.append(key)
    return tuple(keys)


def swept_keys(sweep_dir: str | os.PathLike[str] | None) -> tuple[str, ...] | None:
    """The keys the multirun in ``sweep_dir`` sweeps over, in command-line order; ``None`` when
    ``sweep_dir/multirun.yaml`` is missing or unreadable (then every job override counts)."""
    path = Path(str(sweep_dir)) / "multirun.yaml" if sweep_dir else None
    if path is None or not path.is_file():
        return None
    try:
        return _swept_keys_cached(str(path), path.stat().st_mtime)
    except Exception:  # noqa: BLE001 - an unreadable file: fall back to all overrides
        return None


def job_items(overrides: Iterable[str], swept: Sequence[str] | None) -> list[tuple[str, str]]:
    """``(short key, value)`` of the job ``overrides`` whose key is swept (all when ``swept`` is
    ``None``); ``seed`` last. Short key: the last dotted component, unless two swept keys share it."""
    pairs = []
    for item in overrides:
        key, _, value = str(item).partition("=")
        key = key.lstrip("+~")
        if swept is None or key in swept:
            pairs.append((key, value))
    pairs.sort(key=lambda kv: kv[0] == "seed")  # stable: command-line order, the seed last
    tails = [k.rsplit(".", 1)[-1] for k, _ in pairs]
    return [(t if tails.count(t) == 1 else k, v) for (k, v), t in zip(pairs, tails, strict=True)]


def job_dirname(num: Any, overrides: Any, sweep_dir: Any = None, max_len: int = 80) -> str:
    """Sweep subdir of one job: ``<num>_<key>-<value>_…`` from its swept overrides (``3_pe-rope_seed-1``).

    Every swept key stays in the name; when the name would exceed ``max_len`` the longest values are
    cut and given a hash (``model.pe_options-type-yarn-fa-1a2b3c``). The job number keeps names unique.
    ``overrides``: the job's overrides (``hydra.overrides.task``, a list, or a ``k=v,k=v`` string).
    """
    if isinstance(overrides, str):  # an override_dirname: commas inside values stay
        overrides = re.split(r",(?=[+~]?[\w./]+=)", overrides) if overrides else []
    items = [(safe_name(k), safe_name(v)) for k, v in job_items(list(overrides or []), swept_keys(sweep_dir))]
    excess = len(str(num)) + sum(len(k) + len(v) + 2 for k, v in items) - max_len
    while excess > 0:  # cut the longest value (keeping 1+ characters and a hash) until the name fits
        i = max(range(len(items)), key=lambda j: len(items[j][1]))
        k, v = items[i]
        if len(v) <= 14:
            break
        short = f"{v[: max(1, len(v) - 7 - excess)].rstrip('-.')}-{hashlib.sha1(v.encode()).hexdigest()[:6]}"
        excess -= len(v) - len(short)
        items[i] = (k, short)
    name = "_".join([str(num), *(f"{k}-{v}" for k, v in items)])
    if len(name) > _NAME_MAX:  # many short items (e.g. an Optuna job, which names no swept keys)
        name = f"{name[: _NAME_MAX - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def tensorboard_dir(output_dir: Any, ckpt_path: Any = None) -> str:
    """``<run>/tensorboard`` of the run a checkpoint ``<run>/checkpoints/x.ckpt`` belongs to, when it
    exists (a resumed run continues its curves there); else ``output_dir/tensorboard``."""
    if ckpt_path:
        previous = Path(str(ckpt_path)).expanduser().parent.parent / "tensorboard"
        if previous.is_dir():
            return str(previous)
    return str(Path(str(output_dir)) / "tensorboard")


def register_resolvers() -> None:
    for name, fn in (
        ("posformer_cwd", os.getcwd),
        ("posformer_job_dirname", job_dirname),
        ("posformer_tensorboard_dir", tensorboard_dir),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def register_schemas() -> None:
    """Hydra's ConfigStore entries the YAML files list first in their defaults: ``train_schema``
    (``train.yaml``), ``/schema/model`` (each ``model`` option), ``/schema/data/<name>`` (each built-in
    dataset's options), ``eval_schema`` (``eval.yaml``) and ``eval/<option>_schema``."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema_node(TrainConfig))
    model = schema_node(ModelConfig)
    model.pe = MISSING  # set by the pe group's option (pe=custom's ??? stays missing: a merge keeps values)
    store.store(group="schema", name="model", node=model)
    for name, dataset in DATASETS.items():
        store.store(group="schema/data", name=name, node=schema_node(dataset.options))
    store.store(name="eval_schema", node=schema_node(eval_schema.EvalRootConfig))
    for option, cls in eval_schema.OPTIONS.items():
        store.store(group="eval", name=f"{option}_schema", node=schema_node(cls))


register_resolvers()
register_schemas()
