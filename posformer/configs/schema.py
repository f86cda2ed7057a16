"""The typed schema of ``posformer-train``'s config: Hydra structured configs, one home for types,
value sets and ranges.

``configs/train.yaml`` lists ``train_schema`` (:class:`TrainConfig`, registered in Hydra's ConfigStore by
:func:`register`) first in its defaults, so Hydra merges every YAML file and override onto these
dataclasses. A value of the wrong type (``seed=abc``) or a key the schema does not declare
(``optim.weight_decy=0.1``) fails at composition, before any posformer code runs;
:mod:`posformer.cli.composition` turns that failure into one line. The values themselves live in the
YAML files (every field here is ``MISSING``), so each default has one place.

Beyond its type a field may carry a :class:`~posformer.rules.Rule` (a set of choices, a range or a
test, with the words that say so). :func:`check` applies types, rules and the declared keys to a
composed config or a plain dict and returns one line per problem;
:func:`posformer.config.validate_config` adds the checks that combine fields or need the data, the
device or torch.

Open sections stay untyped here, because other code owns their keys: ``model`` (the fields of
:class:`posformer.model.ModelConfig`, which checks itself; ``model.pe_options`` are the PE's keyword
options), ``data`` (each dataset's defaults; its datamodule checks them), ``trainer`` (any
``lightning.Trainer`` argument), ``logger``, ``callbacks`` and ``paths``. :data:`OPEN_RULES` declares
the rules of the keys posformer itself reads in ``trainer`` and ``data``.

OmegaConf's ``Enum`` fields are not used for the value sets: the composed config would then hold
``Enum`` members, which ``OmegaConf.to_container`` keeps and which the checkpoints' hyper-parameters
could then not be loaded with ``weights_only=True``. A value set is a ``Rule`` with ``choices``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from posformer.rules import (
    Rule,
    at_least,
    between,
    is_int,
    is_number,
    nested_key_message,
    one_of,
    unknown_key_message,
)

__all__ = [
    "OPEN_RULES",
    "OPTIMIZERS",
    "PRECISIONS",
    "SCHEDULES",
    "SEED_LIMIT",
    "TrainConfig",
    "check",
    "declared_keys",
    "register",
    "unknown_key_message",
    "value_problem",
]

# ------------------------------------------------------------------------------------------ value sets
#: ``optim.name`` (posformer.lit.optim builds these and imports this tuple)
OPTIMIZERS = ("adamw", "adam")
#: ``schedule.name`` (posformer.lit.optim)
SCHEDULES = ("inverse_sqrt", "cosine", "constant")
#: ``compile.mode`` (torch.compile's modes; null: torch's default)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Lightning's ``trainer.precision`` values; ``auto`` (:func:`posformer.devices.resolve_device`) too
PRECISIONS = (
    "32-true",
    "32",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "64",
    "transformer-engine",
    "transformer-engine-float16",
)
#: numpy's RNG (seeded by Lightning's seed_everything and the data) takes seeds in [0, 2**32)
SEED_LIMIT = 2**32


def spec(rule: Rule | None = None) -> Any:
    """A schema field whose value comes from the YAML files (``MISSING`` here), checked by ``rule``."""
    return field(default=MISSING, metadata={"rule": rule} if rule else {})


# ------------------------------------------------------------------------------------------ the schema
SEED_RULE = Rule(
    limit=f"a non-negative integer below 2**32 = {SEED_LIMIT} (the range numpy's RNG accepts); e.g. seed=0",
    test=lambda v: is_int(v) and 0 <= v < SEED_LIMIT,
)


@dataclass
class CompileConfig:
    """``compile``: ``torch.compile`` of the model (``Module.compile``); ``backend`` is checked against
    ``torch._dynamo.list_backends()`` when ``enabled`` (posformer.config)."""

    enabled: bool = spec()
    backend: str | None = spec()
    mode: str | None = spec(one_of(*COMPILE_MODES))
    dynamic: bool | None = spec()
    fullgraph: bool = spec()


@dataclass
class NoDecayConfig:
    """``optim.no_decay``: parameter kinds excluded from weight decay."""

    biases: bool = spec()
    norms: bool = spec()
    embeddings: bool = spec()
    pe: bool = spec()


@dataclass
class OptimConfig:
    """``optim``: the optimiser (posformer.lit.optim.build_optimizer)."""

    name: str = spec(one_of(*OPTIMIZERS, test=lambda v: str(v).lower() in OPTIMIZERS))
    # null only with schedule.name=inverse_sqrt, whose formula is the learning rate (posformer.config)
    lr: float | None = spec(
        Rule(limit="a positive number (e.g. optim.lr=1e-3)", test=lambda v: is_number(v) and v > 0)
    )
    betas: list[float] = spec(
        Rule(
            limit="two numbers in [0, 1), e.g. [0.9, 0.98]",
            test=lambda v: len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v),
        )
    )
    eps: float = spec(between(0.0, 1.0, lo_open=True))
    weight_decay: float = spec(between(0.0, 10.0, then="0 disables weight decay"))
    # torch's fused kernel (one launch for every parameter; a NaN step skipped in it): null on CUDA
    fused: bool | None = spec()
    no_decay: NoDecayConfig = field(default_factory=NoDecayConfig)


def is_warmup(value: Any) -> bool:
    """``schedule.warmup_steps``: steps (an int >= 0) or a fraction of the run (a float in (0, 1))."""
    return (is_int(value) and value >= 0) or (isinstance(value, float) and 0.0 < value < 1.0)


@dataclass
class ScheduleConfig:
    """``schedule``: the learning-rate schedule (posformer.lit.optim.build_schedule)."""

    name: str = spec(one_of(*SCHEDULES))
    # an int (steps) or a float (a fraction of the run): OmegaConf has no int-or-float type
    warmup_steps: Any = spec(
        Rule(limit="an integer >= 0; or give a fraction of the run in (0, 1), e.g. 0.05", test=is_warmup)
    )
    multiplier: float = spec(Rule(limit="a positive number", test=lambda v: is_number(v) and v > 0))
    min_lr_ratio: float = spec(between(0.0, 1.0, hi_open=False))
    total_steps: int | None = spec(at_least(1, "null decays over trainer.max_steps"))


@dataclass
class LossConfig:
    """``loss``."""

    label_smoothing: float = spec(between(0.0, 1.0, then="0.1 is the paper's value, 0 disables it"))


@dataclass
class PositionsConfig:
    """``positions``: randomized positions in training steps (Ruoss et al. 2023)."""

    randomized: bool = spec()
    n_max: int | None = spec(at_least(1, "set it well above the longest evaluation sequence"))


@dataclass
class TrainConfig:
    """The root of ``configs/train.yaml`` (ConfigStore name ``train_schema``), in the order it prints."""

    task_name: str = spec()
    seed: int = spec(SEED_RULE)
    train: bool = spec()
    evaluate: bool = spec()
    ckpt_path: str | None = spec()
    init_from: str | None = spec()
    eval_ckpt: str = spec(one_of("best", "last"))
    torch_threads: int | None = spec(at_least(1, limit="a positive integer or null (torch's default)"))
    flush_denormal: bool = spec(
        Rule(
            limit="true or false (true: treat float32 values below 1.2e-38 as 0 on the CPU, the fast setting)"
        )
    )
    float32_matmul_precision: str | None = spec(one_of(None, "highest", "high", "medium"))
    tags: list[str] = spec()
    compile: CompileConfig = field(default_factory=CompileConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    positions: PositionsConfig = field(default_factory=PositionsConfig)
    # open sections: their keys belong to other code (the module docstring)
    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    logger: Any = None
    callbacks: Any = None
    paths: dict[str, Any] = field(default_factory=dict)


def _positive_int_or_null(v: Any) -> bool:
    return v is None or (is_int(v) and v >= 1)


def _lengths_at_least_one(v: Any) -> bool:
    return v is None or all(is_int(x) and x >= 1 for x in (v if isinstance(v, list | tuple) else [v]))


#: the keys posformer reads in the open sections, with their rules (the values are never typed at
#: composition: a dataset or the Trainer may take other types for keys posformer does not read)
OPEN_RULES: dict[str, dict[str, Rule]] = {
    "trainer": {
        "precision": one_of(
            "auto",
            *PRECISIONS[:6],
            test=lambda v: str(v) in ("auto", *PRECISIONS),
            note="(auto: bf16-mixed/16-mixed on CUDA, 32-true on the CPU; 32-true is full precision)",
        ),
        "max_steps": Rule(
            limit="a positive integer (or -1 with trainer.max_epochs > 0)",
            test=lambda v: is_int(v) and (v >= 1 or v == -1),
        ),
        "val_check_interval": Rule(
            limit="a positive number of steps (int) or an epoch fraction",
            test=lambda v: v is None or (is_number(v) and v > 0),
        ),
        "gradient_clip_val": Rule(
            limit=">= 0 (0 or null disables clipping)", test=lambda v: v is None or (is_number(v) and v >= 0)
        ),
        "accumulate_grad_batches": at_least(1),
        "log_every_n_steps": at_least(1),
        "num_nodes": at_least(1),
        "devices": Rule(
            limit="a positive integer, -1, 'auto' or a list of device ids",
            test=lambda v: v == "auto" or isinstance(v, list) or (is_int(v) and (v >= 1 or v == -1)),
        ),
    },
    "data": {
        "batch_size": Rule(limit="a positive integer", test=_positive_int_or_null),
        "eval_batch_size": Rule(limit="a positive integer", test=_positive_int_or_null),
        "train_len": Rule(limit="an integer >= 1 or [min, max] of integers >= 1", test=_lengths_at_least_one),
        "eval_len": Rule(limit="an integer >= 1 or [min, max] of integers >= 1", test=_lengths_at_least_one),
        "pack": Rule(
            limit="true or false (true: packed training rows with segment ids)",
            test=lambda v: isinstance(v, bool),
        ),
    },
}


def register() -> None:
    """Store :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema`` (train.yaml's first default)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


# ------------------------------------------------------------------------------------------ checking
def _optional(hint: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(hint, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` (plain Python) has the type ``hint`` (as OmegaConf would accept it)."""
    hint, optional = _optional(hint)
    if value is None:
        return optional
    origin = typing.get_origin(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_int(value) or isinstance(value, float)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list | tuple) and all(_conforms(v, item) for v in value)
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, Mapping)
    return True


def _words(hint: Any) -> str:
    """The type ``hint`` in words: ``an integer or null``, ``a list of numbers``, ..."""
    hint, optional = _optional(hint)
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        text = f"a mapping of {', '.join(f.name for f in dataclasses.fields(hint))}"
    elif origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        plural = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
        text = f"a list of {plural.get(item, 'values')}"
    else:
        text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
            hint, "a mapping" if origin is dict else "a value"
        )
    return text + (" or null" if optional else "")


def _hints(schema: Any) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _field(path: str) -> tuple[Any, Rule | None] | None:
    """``(type hint, rule)`` of the schema field at the dotted ``path`` (``optim.betas``); the hint is
    ``Any`` for a key of an open section with a rule; ``None``: the schema does not know the key."""
    parts = path.split(".")
    if parts[0] in OPEN_RULES:
        rule = OPEN_RULES[parts[0]].get(".".join(parts[1:]))
        return (Any, rule) if rule is not None else None
    node: Any = TrainConfig
    for part in parts[:-1]:
        node = _hints(node).get(part) if dataclasses.is_dataclass(node) else None
    if not dataclasses.is_dataclass(node):
        return None
    found = {f.name: f for f in dataclasses.fields(node)}.get(parts[-1])
    return None if found is None else (_hints(node)[parts[-1]], found.metadata.get("rule"))


def declared_keys(path: str) -> list[str] | None:
    """The keys the schema declares under the dotted ``path`` (``""``: the root; ``optim.no_decay``);
    ``None`` when the schema leaves that node open or does not know it."""
    node: Any = TrainConfig
    for part in [p for p in path.split(".") if p]:
        node = _hints(node).get(part) if dataclasses.is_dataclass(node) else None
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else None


def value_problem(key: str, value: Any) -> str | None:
    """The one line for ``key=value`` when the value breaks the schema's type or rule for ``key``
    (which may name a list item, ``optim.betas[1]``); ``None``: no problem, or a key the schema does
    not check."""
    base = re.sub(r"\[\d+\]$", "", key)
    found = _field(base)
    if found is None:
        return None
    hint, rule = found
    if base != key:  # one item of a list: its type, then what the whole list must be
        item = (typing.get_args(_optional(hint)[0]) or (Any,))[0]
        whole = rule.limit if rule and rule.limit else _words(hint)
        return f"{key}={value!r} is not {_words(item)}; {base} must be {whole}."
    return _problem(key, value, hint, rule)


def _problem(key: str, value: Any, hint: Any, rule: Rule | None) -> str | None:
    """``hint`` ``Any``: untyped (an open section's key, ``schedule.warmup_steps``), the rule is all."""
    if isinstance(value, str) and value == MISSING:
        return f"{key} has no value ('???'); set it on the command line, e.g. {key}=..."
    if hint is not Any:
        if not _conforms(value, hint):
            if rule is not None and rule.choices:
                return rule.message(key, value)
            return f"{key}={value!r} must be {rule.limit if rule and rule.limit else _words(hint)}."
        if value is None:
            return None
    if rule is None or rule.holds(value):
        return None
    return rule.message(key, value)


def _keys(node: Any) -> list[str]:
    return [str(k) for k in node] if isinstance(node, Mapping) else []


def _check_node(schema: Any, node: Mapping[str, Any], prefix: str, problems: list[str]) -> None:
    hints = _hints(schema)
    names = [f.name for f in dataclasses.fields(schema)]
    for f in dataclasses.fields(schema):
        if f.name not in node:
            continue  # a plain dict without the key: nothing to check (the YAML files give every key)
        key, value, hint = prefix + f.name, node[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            _check_node(hint, value, key + ".", problems)
        elif typing.get_origin(hint) is not dict and not (hint is Any and f.metadata.get("rule") is None):
            line = _problem(key, value, hint, f.metadata.get("rule"))
            if line:
                problems.append(line)
    section = prefix.rstrip(".")
    for extra in sorted(set(node) - set(names) - ({"hydra"} if not prefix else set())):
        value = node[extra]
        nested = None
        if not prefix and isinstance(value, Mapping):  # +optimizer.lr=0.1 meant optim.lr: name that key
            sections = {n: [*(declared_keys(n) or ()), *_keys(node.get(n))] for n in names}
            nested = nested_key_message(extra, value, sections)
        problems.append(nested or unknown_key_message(section, extra, names, drop=f"+{prefix}{extra}=..."))


def check(cfg: Mapping[str, Any]) -> list[str]:
    """One line per problem of a composed config (plain containers) or a plain dict: a value of the
    wrong type, a value that breaks its field's :class:`Rule` (:data:`OPEN_RULES` too), a key no typed
    section declares (added with ``+``). Keys a plain dict leaves out are not checked."""
    problems: list[str] = []
    _check_node(TrainConfig, cfg, "", problems)
    for section, rules in OPEN_RULES.items():
        node = cfg.get(section)
        for key, rule in rules.items():
            if isinstance(node, Mapping) and key in node:
                line = _problem(f"{section}.{key}", node[key], Any, rule)
                if line:
                    problems.append(line)
    return problems
