"""Each dataset's options, declared once: default, rule (type, range, choices, the words that say so).

A datamodule class lists its options in ``OPTIONS`` (``{key: Option}``), the model kinds it feeds in
``MODEL_KINDS`` and, optionally, the checks that combine options in ``cross_problems(o)``.
:func:`option_problems` checks a data section against that declaration and returns one line per problem
(``data.<key>=<value> must be <limit>.``, the words of :mod:`posformer.rules`); :func:`checked_options`
is what a constructor calls: the merged options, or one :class:`~posformer.errors.ConfigError` listing
every problem, before any work. :func:`data_problems` is the same check by ``data.name``, for
:func:`posformer.config.validate_config`, which reports it together with the rest of the config.

Checks of values that exist only at call time (an evaluation length passed to a method, a resume
position) stay where the value arrives (:func:`posformer.data.base.check_int`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from posformer.data.base import MODEL_KINDS, take_options
from posformer.errors import ConfigError
from posformer.rules import Rule, at_least, is_int, is_number, raise_problems

__all__ = [
    "BUILT_IN",
    "BOOL",
    "ChoiceRule",
    "Option",
    "RangeRule",
    "checked_options",
    "data_problems",
    "defaults_of",
    "lengths",
    "option_problems",
    "span",
]


@dataclass(frozen=True)
class Option:
    """One data option: its ``default``, its ``rule`` (``None``: any value, e.g. a path), whether
    ``null`` is a valid value (then the rule is not applied to it), and ``when``: the rule applies only
    if ``when(options)`` (``vocab_size`` only for ``tokenizer=bpe``)."""

    default: Any
    rule: Rule | None = None
    null: bool = False
    when: Callable[[Mapping[str, Any]], bool] | None = None


@dataclass(frozen=True)
class RangeRule(Rule):
    """``[min, max]`` (or one integer ``n`` = ``[n, n]``) of integers with ``minimum <= min <= max``."""

    minimum: int = 1

    def holds(self, value: Any) -> bool:
        return self._problem("", value) is None

    def message(self, key: str, value: Any) -> str:
        return self._problem(key, value) or f"{key}={value!r} is valid."

    def _problem(self, key: str, value: Any) -> str | None:
        pair = [value, value] if is_int(value) else value
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            return f"{key}={value!r} must be [min, max] (two integers) or one integer."
        for i, v in enumerate(pair):
            if not (is_int(v) and v >= self.minimum):
                return f"{key}[{i}]={v!r} must be an integer >= {self.minimum}."
        lo, hi = pair
        if lo > hi:
            return f"{key}={list(pair)}: min {lo} is greater than max {hi}; write [{hi}, {lo}]."
        return None


@dataclass(frozen=True)
class LengthsRule(Rule):
    """A list of integers ``>= minimum`` (evaluation lengths); a bad item is named ``<key>[]``."""

    minimum: int = 1

    def holds(self, value: Any) -> bool:
        return isinstance(value, list | tuple) and all(is_int(v) and v >= self.minimum for v in value)

    def message(self, key: str, value: Any) -> str:
        if not isinstance(value, list | tuple):
            return f"{key}={value!r} must be a list of integers >= {self.minimum}, e.g. [16, 32, 64]."
        bad = next(v for v in value if not (is_int(v) and v >= self.minimum))
        return f"{key}[]={bad!r} must be an integer >= {self.minimum}."


@dataclass(frozen=True)
class ChoiceRule(Rule):
    """One of ``choices``, named ``what`` in the line (``valid tasks: copy, reverse, ...``)."""

    what: str = ""

    def message(self, key: str, value: Any) -> str:
        valid = ", ".join(map(str, self.choices))
        return f"{key}={value!r} is unknown; valid{f' {self.what}' if self.what else ''}: {valid}."


#: true or false
BOOL = Rule(limit="true or false", test=lambda v: isinstance(v, bool))
#: a data seed (null: the run seed)
SEED = Rule(
    limit="a non-negative integer below 2**32 or null (null: the run seed)",
    test=lambda v: is_int(v) and 0 <= v < 2**32,
)
#: evaluation lengths
LENGTHS = LengthsRule()


def fraction(example: str) -> Rule:
    """A number in the open interval (0, 1)."""
    return Rule(limit=f"a number in (0, 1), e.g. {example}", test=lambda v: is_number(v) and 0 < v < 1)


def count(minimum: int = 1, null: str = "", limit: str = "") -> Rule:
    """An integer ``>= minimum``; ``null``: what null means (named in the line); ``limit``: other words."""
    words = limit or f"an integer >= {minimum}" + (f" or null ({null})" if null else "")
    return at_least(minimum, limit=words)


def defaults_of(table: Mapping[str, Option]) -> dict[str, Any]:
    """``{key: default}`` of an options table (the keys a data section may set, besides ``name``)."""
    return {key: opt.default for key, opt in table.items()}


def span(value: Any) -> tuple[int, int]:
    """A checked ``[min, max]`` or ``n`` (:class:`RangeRule`) as ``(min, max)``."""
    return (int(value), int(value)) if is_int(value) else (int(value[0]), int(value[1]))


def lengths(value: Any) -> list[int]:
    """Checked evaluation lengths (:data:`LENGTHS`; null or empty: ``[]``), sorted, each once."""
    return sorted({int(v) for v in value or ()})


def _plain(value: Any) -> Any:
    """numpy scalars (and lists of them) as Python values, so the rules see ints and floats."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple) and any(isinstance(v, np.generic) for v in value):
        return [v.item() if isinstance(v, np.generic) else v for v in value]
    return value


def _name(cls: type) -> str:
    return str(getattr(cls, "name", "") or cls.__name__)


def option_problems(
    cls: type, cfg: Mapping[str, Any], model_kind: str | None = None, keys: bool = True
) -> tuple[dict[str, Any], list[str]]:
    """``(options, problems)``: ``cfg`` merged over ``cls.OPTIONS``' defaults and one line per problem:
    unknown keys (``keys``), the model kind (``model_kind``; ``None``: not checked), each option's rule,
    then ``cls.cross_problems(options)`` when every option keeps its rule."""
    table: Mapping[str, Option] = cls.OPTIONS  # type: ignore[attr-defined]
    where = f"data={_name(cls)}"
    problems: list[str] = []
    given = {k: _plain(v) for k, v in cfg.items()}
    if keys:
        try:
            take_options(given, defaults_of(table), where)
        except ConfigError as exc:
            problems.append(str(exc))
    known = {k: v for k, v in given.items() if k in table}
    options = {**defaults_of(table), **known}
    allowed = getattr(cls, "MODEL_KINDS", MODEL_KINDS)
    if model_kind is not None and model_kind not in allowed:
        problems.append(
            f"model kind {model_kind!r} is not supported for data={_name(cls)}; valid: {', '.join(allowed)}."
        )
    ruled = []
    for key, opt in table.items():
        value = options[key]
        if opt.rule is None or (value is None and opt.null) or (opt.when and not opt.when(options)):
            continue
        if not opt.rule.holds(value):
            ruled.append(opt.rule.message(f"data.{key}", value))
    problems += ruled
    cross = getattr(cls, "cross_problems", None)
    if not ruled and cross is not None:
        problems += cross(options)
    return options, problems




def checked_options(cls: type, cfg: Mapping[str, Any], model_kind: str) -> dict[str, Any]:
    """The options of a ``cls`` datamodule from ``cfg`` (``name`` dropped), every rule kept; otherwise one
    ConfigError listing every problem. Called first in a datamodule's constructor."""
    options, problems = option_problems(cls, cfg, model_kind)
    raise_problems(problems)
    return options


#: the built-in datasets' classes (``data.name`` -> ``module:Class``), imported when asked
BUILT_IN = {
    "synthetic": "posformer.data.synthetic:SyntheticDataModule",
    "text": "posformer.data.text:TextDataModule",
    "hub": "posformer.data.hub:HubDataModule",
    "corpus": "posformer.data.corpus:CorpusDataModule",
    "translation": "posformer.data.translation:TranslationDataModule",
}
_KEY = re.compile(r"^(data\.\w+)")


def data_problems(data: Mapping[str, Any], reported: Iterable[str] = ()) -> list[str]:
    """The problems of a composed config's ``data`` section (plain containers), one line each, for
    :func:`posformer.config.validate_config`: the rules and the cross checks of the dataset
    ``data.name`` declares. Leaves out unknown keys (the config's own key check names them), the model
    kind (every data option composes with every model; the datamodule refuses a kind it cannot feed)
    and keys a line of ``reported`` already names; ``[]`` for a dataset without ``OPTIONS``."""
    if not isinstance(data, Mapping):
        return []
    target = BUILT_IN.get(str(data.get("name", "synthetic")))
    if target is None:
        return []
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    _, problems = option_problems(cls, data, None, keys=False)
    named = {m.group(1) for m in map(_KEY.match, reported) if m}
    return [line for line in problems if (m := _KEY.match(line)) is None or m.group(1) not in named]
