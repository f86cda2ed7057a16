"""``posformer-train``'s config read once (:func:`read_train`): the composed config -> the run's frozen
settings, every problem one line of one :class:`~posformer.errors.ConfigError`, before anything is built
or written."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from posformer.configs import checks
from posformer.configs.composition import valid_keys
from posformer.configs.schema import TRAINER_RULES, TrainConfig
from posformer.configs.variants import apply_variant
from posformer.conform import conform
from posformer.data.options import DATASETS, option_problems
from posformer.errors import ConfigError
from posformer.model import ModelConfig
from posformer.rules import raise_problems, rule_problems, unknown_key_message

__all__ = ["read_train"]

#: posformer.checkpoints.TRUST_FLAG (not imported: checkpoints sits above configs)
TRUST_FLAG = "trust_checkpoint_code"


def _leaves(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:  # (dotted key, value); items: key[i]
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, node


def _sections(node: DictConfig) -> dict[str, Any]:
    out = {}
    for key in [k for k in node if k not in ("model", "data")]:
        try:
            value = node[key]
            out[str(key)] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
        except Exception:  # noqa: BLE001 - missing: its line is conform's
            continue
    return out


def _trainer_problems(trainer: Mapping[str, Any]) -> list[str]:
    valid = valid_keys("trainer", None)
    out = [
        unknown_key_message("trainer", k, valid, drop=f"+trainer.{k}=...")
        for k in sorted(set(trainer) - valid)
    ]
    rules = TRAINER_RULES.items()
    return out + [
        r.message(f"trainer.{k}", trainer[k])
        for k, r in rules
        if trainer.get(k) is not None and not r.holds(trainer[k])
    ]


def _finite(given: Mapping[str, Any], reported: list[str]) -> list[str]:
    """NaN or inf in any value (``model.pe_options`` too) that no line of ``reported`` names already."""
    return [
        f"{key}={value} is not a finite number (limit: every numeric setting is finite; NaN or inf would "
        f"poison training or slip past its checks); give {key} a number, e.g. its default."
        for key, value in _leaves(given)
        if isinstance(value, float) and not math.isfinite(value)
        if not any(line.startswith(f"{key}=") for line in reported)
    ]


def read_train(cfg: DictConfig | Mapping[str, Any]) -> TrainConfig:
    """The composed training config (or a plain mapping of the same) as the run's settings; raise one
    :class:`ConfigError` listing every problem."""
    try:
        given = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    except Exception as exc:  # interpolation errors
        raise ConfigError(f"the configuration cannot be resolved: {exc}") from None
    given.pop("hydra", None)
    given.pop(TRUST_FLAG, None)  # +trust_checkpoint_code=true: read from the command line (check_pe_trusted)
    given = apply_variant(given)  # +variant=<name>: its pe, pe_options and model settings over the model
    unset = [  # the fields (and sections) with no default that a plain mapping leaves out
        f.name
        for f in dataclasses.fields(TrainConfig)
        if f.name not in given and (f.default == MISSING or dataclasses.is_dataclass(f.default_factory))
    ]
    raise_problems(  # every value not given, at once and first: a field left out, a ??? anywhere
        [f"{k} has no value; set it, e.g. {k}=..." for k in unset]
        + [
            f"{k} has no value ('???'); set it on the command line, e.g. {k}=..."
            for k, v in _leaves(given)
            if v == MISSING
        ]
    )
    model, data = given.get("model") or {}, given.get("data") or {}
    node, problems = conform(TrainConfig, {k: v for k, v in given.items() if k not in ("model", "data")}, "")
    model_node, model_lines = conform(ModelConfig, model, "model.")
    dataset = DATASETS.get(str(data.get("name", "synthetic")))
    options, data_lines = (
        option_problems(dataset.options, data) if dataset and dataset.options else (data, [])
    )
    if data.get("seed") == given.get("seed"):  # the run seed's own line says what is wrong with it
        data_lines = [line for line in data_lines if not line.startswith("data.seed=")]
    sections, fields = _sections(node), OmegaConf.to_container(model_node)
    problems += model_lines + rule_problems(TrainConfig, "", sections)
    if len(sections) < len(dataclasses.fields(TrainConfig)) - 2:  # a value refused: no settings to check
        raise_problems(problems + data_lines)
    s = TrainConfig(**sections, model=fields, data=data if options is None else options)
    pe, model_problem = checks.model_pe(s.model)
    problems += _trainer_problems(s.trainer) + checks.run_problems(s)
    problems += checks.trainer_problems(s) + checks.pe_problems(s, pe)
    problems += ([model_problem] if model_problem else []) + checks.data_problems(s) + data_lines
    raise_problems(problems + _finite(given, problems))
    return s


def config_yaml(s: TrainConfig) -> str:
    """The run's ``config.yaml``: its settings, every value resolved."""
    settings = dataclasses.asdict(s)
    if settings.get("variant") is None:  # no variant: the file as it was before variants existed
        settings.pop("variant", None)
    return OmegaConf.to_yaml(settings)
