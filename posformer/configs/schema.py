"""The typed schema of ``posformer-train``'s config, and how a value is merged onto a schema node.

Every section is a frozen dataclass: Hydra merges the YAML files and the overrides onto it (a wrong type
or an undeclared key fails at composition, worded by :mod:`posformer.configs.composition`), and
:func:`posformer.configs.settings.read_train` turns the composed config into instances of the same
classes, the run's settings. ``configs/train.yaml`` lists ``train_schema`` (:class:`TrainConfig`)
first; each ``model`` option starts with ``/schema/model`` (:class:`~posformer.model.ModelConfig`) and
each ``data`` option with its dataset's options (:mod:`posformer.configs.data`). The values live in the
YAML files (every field here is ``MISSING``), so each default has one place.

Beyond its type a field may carry a :class:`~posformer.rules.Rule`. Value sets are rules rather than
``Enum`` fields, whose members would reach the checkpoints' hyper-parameters (loaded with
``weights_only=True``). ``trainer`` stays open (any ``lightning.Trainer`` argument); :data:`TRAINER_RULES`
are the rules of the keys posformer reads there.

:func:`conform` merges a plain mapping onto a schema node one key at a time (OmegaConf converts and
refuses), so every refused key and value is one line (:func:`value_line`), all of them at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

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
SEED_RULE = Rule(
    limit=f"a non-negative integer below 2**32 = {SEED_LIMIT} (the range numpy's RNG accepts); e.g. seed=0",
    test=lambda v: is_int(v) and 0 <= v < SEED_LIMIT,
)


def spec(rule: Rule | None = None) -> Any:
    """A schema field whose value comes from the YAML files (``MISSING`` here), checked by ``rule``."""
    return field(default=MISSING, metadata={"rule": rule} if rule else {})


# ------------------------------------------------------------------------------------------ the schema
@dataclass(frozen=True)
class CompileConfig:
    """``compile``: ``torch.compile`` of the model (``Module.compile``)."""

    enabled: bool = spec()
    backend: str | None = spec()  # checked against torch._dynamo.list_backends() when enabled
    mode: str | None = spec(one_of(*COMPILE_MODES))
    dynamic: bool | None = spec()
    fullgraph: bool = spec()


@dataclass(frozen=True)
class NoDecayConfig:
    """``optim.no_decay``: parameter kinds excluded from weight decay."""

    biases: bool = spec()
    norms: bool = spec()
    embeddings: bool = spec()
    pe: bool = spec()


@dataclass(frozen=True)
class OptimConfig:
    """``optim``: the optimiser (posformer.lit.optim.build_optimizer)."""

    name: str = spec(one_of(*OPTIMIZERS, test=lambda v: str(v).lower() in OPTIMIZERS))
    # null only with schedule.name=inverse_sqrt, whose formula is the learning rate (configs.checks)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class LossConfig:
    """``loss``."""

    label_smoothing: float = spec(between(0.0, 1.0, then="0.1 is the paper's value, 0 disables it"))


@dataclass(frozen=True)
class PositionsConfig:
    """``positions``: randomized positions in training steps (Ruoss et al. 2023)."""

    randomized: bool = spec()
    n_max: int | None = spec(at_least(1, "set it well above the longest evaluation sequence"))


@dataclass(frozen=True)
class TrainConfig:
    """The root of ``configs/train.yaml`` (ConfigStore ``train_schema``), in the order it prints; read
    into an instance of itself, with ``data`` its dataset's options and ``model`` the ``ModelConfig``
    fields (:func:`posformer.configs.settings.read_train`)."""

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
    model: Any = None  # typed by each model option (/schema/model: ModelConfig)
    data: Any = None  # typed by each data option (/schema/data/<name>: posformer.configs.data)
    trainer: dict[str, Any] = field(default_factory=dict)  # any lightning.Trainer argument
    logger: Any = None
    callbacks: Any = None
    paths: dict[str, Any] = field(default_factory=dict)


#: the rules of the ``trainer`` keys posformer reads (the section takes any ``lightning.Trainer`` argument)
TRAINER_RULES: dict[str, Rule] = {
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
        limit="a positive number of steps (int) or an epoch fraction", test=lambda v: is_number(v) and v > 0
    ),
    "gradient_clip_val": Rule(
        limit=">= 0 (0 or null disables clipping)", test=lambda v: is_number(v) and v >= 0
    ),
    "accumulate_grad_batches": at_least(1),
    "log_every_n_steps": at_least(1),
    "num_nodes": at_least(1),
    "devices": Rule(
        limit="a positive integer, -1, 'auto' or a list of device ids",
        test=lambda v: v == "auto" or isinstance(v, list) or (is_int(v) and (v >= 1 or v == -1)),
    ),
}


# ------------------------------------------------------------------------------------------ merging
def schema_node(cls: type) -> DictConfig:
    """``OmegaConf.structured(cls)`` open for merging: a frozen dataclass makes its nodes read-only, but
    the YAML files and overrides must merge onto it (the instances read from it stay frozen)."""

    def writable(node: Any) -> None:
        OmegaConf.set_readonly(node, None)
        for key in node if isinstance(node, DictConfig) else range(len(node)):
            child = node._get_node(key)
            if isinstance(child, DictConfig | ListConfig):
                writable(child)

    node = OmegaConf.structured(cls)
    writable(node)
    return node


def _keys(node: DictConfig, given: Mapping[str, Any], name: str) -> list[str]:
    """The keys of section ``name``: its schema's fields and those ``given`` sets."""
    cls, value = OmegaConf.get_type(node, name), given.get(name)
    declared = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    return declared + (list(value) if isinstance(value, Mapping) else [])


def conform(cls: type, given: Mapping[str, Any], prefix: str) -> tuple[DictConfig, list[str]]:
    """``given`` (plain values) merged onto ``cls``'s node one key at a time: the node, and one line per
    key the schema does not declare or value OmegaConf refuses (keys named ``<prefix><key>``)."""
    node, problems = schema_node(cls), []
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in given.items():
        if key not in names:
            nested = None
            if not prefix and isinstance(value, Mapping):  # +optimizer.lr=0.1 meant optim.lr: name that key
                nested = nested_key_message(key, value, {n: _keys(node, given, n) for n in names})
            line = unknown_key_message(prefix.rstrip("."), key, names, drop=f"+{prefix}{key}=...")
            problems.append(nested or line)
            continue
        child = OmegaConf.get_type(node, key)
        if dataclasses.is_dataclass(child) and isinstance(value, Mapping):
            value, inner = conform(child, value, f"{prefix}{key}.")
            problems += inner
        try:
            node[key] = value
        except ValidationError as exc:
            problems.append(value_line(exc, prefix))
    return node, problems


# ------------------------------------------------------------------------------------------ wording
_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_NODES = {BooleanNode: bool, IntegerNode: int, FloatNode: float, StringNode: str}
_PLURAL = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}


def type_words(node: Any) -> str:
    """What a value of the schema node ``node`` must be, in words (``an integer or null``, ...)."""
    if isinstance(node, ListConfig):
        text = f"a list of {_PLURAL.get(node._metadata.element_type, 'values')}"
    elif isinstance(node, DictConfig):
        cls = OmegaConf.get_type(node)
        names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        text = f"a mapping of {', '.join(names)}" if names else "a mapping"
    else:
        text = _WORDS.get(_NODES.get(type(node)), "a value")
    return text + (" or null" if node._is_optional() else "")


def field_rule(cls: Any, name: str) -> Rule | None:
    """The :class:`Rule` of the dataclass ``cls``'s field ``name`` (``None``: none, or no such field)."""
    found = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    return found[name].metadata.get("rule") if name in found else None


def value_line(exc: ValidationError, prefix: str = "") -> str:
    """The one line for a value OmegaConf refused (a composition error, or :func:`conform`): the key, the
    value and what it must be, the field's rule words first."""
    key, value, parent = prefix + str(exc.full_key), exc.value, exc.parent_node
    if isinstance(parent, ListConfig):  # one item of a list: its type, then what the whole list must be
        whole, name = parent._get_parent(), str(parent._key())
        rule = field_rule(OmegaConf.get_type(whole), name) if whole is not None else None
        item = _WORDS.get(parent._metadata.element_type, "a value")
        must = rule.limit if rule and rule.limit else type_words(parent)
        return f"{key}={value!r} is not {item}; {key.rsplit('[', 1)[0]} must be {must}."
    rule = field_rule(exc.object_type, str(exc.key))
    if rule is not None and rule.choices:
        return rule.message(key, value)
    node = parent._get_node(exc.key) if isinstance(parent, DictConfig) else None
    words = rule.limit if rule and rule.limit else (type_words(node) if node is not None else "another type")
    return f"{key}={value!r} must be {words}."
