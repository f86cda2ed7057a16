"""Rules: what a config value must be beyond its type, and the one line that says so.

OmegaConf types the config (:mod:`posformer.configs.schema`); a :class:`Rule` on a dataclass field
(:func:`ruled`) says what the value must be beyond that: a set of choices, a range or a test, with the
words of its line (``<key>=<value> must be <limit>.`` or ``<key>=<value> is unknown; valid: ....``).
:func:`rule_problems` checks the rules of a dataclass instance; :func:`raise_problems` raises the lines
of one check as one :class:`~posformer.errors.ConfigError`. This module imports nothing heavy, so the
model code can use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from posformer.errors import ConfigError

__all__ = [
    "POSITIVE_INT",
    "LineRule",
    "Rule",
    "at_least",
    "between",
    "is_int",
    "is_number",
    "nested_key_message",
    "one_of",
    "raise_problems",
    "rule_problems",
    "ruled",
    "unknown_key_message",
]


def is_int(value: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Rule:
    """What a value must be beyond its type, and the words that say so.

    Attributes:
        limit: completes ``<key>=<value> must be ...``, a fix included (``a positive number (e.g.
            optim.lr=1e-3)``); without ``test`` and ``choices`` it only words the type.
        test: the check beyond the type (``None``: the type is all).
        choices: the valid values; the line is then ``<key>=<value> is unknown; valid: ...``.
        note: appended to the list of choices.
    """

    limit: str = ""
    test: Callable[[Any], bool] | None = None
    choices: tuple[Any, ...] = ()
    note: str = ""

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (already of the field's type) keeps the rule."""
        if self.test is not None:
            return bool(self.test(value))
        return not self.choices or value in self.choices

    def message(self, key: str, value: Any) -> str:
        """The one line for a ``value`` of ``key`` that breaks the rule (or the type)."""
        if self.choices:
            valid = ", ".join("null" if c is None else str(c) for c in self.choices)
            return f"{key}={value!r} is unknown; valid: {valid}{f' {self.note}' if self.note else ''}."
        return f"{key}={value!r} must be {self.limit}."


@dataclass(frozen=True)
class LineRule(Rule):
    """A rule whose line ``line(key, value)`` writes (``None``: the value keeps the rule), for values
    whose line says more than ``must be <limit>`` (which entries of a list are wrong)."""

    line: Callable[[str, Any], str | None] = field(default=lambda key, value: None)

    def holds(self, value: Any) -> bool:
        return self.line("", value) is None

    def message(self, key: str, value: Any) -> str:
        return self.line(key, value) or super().message(key, value)


def one_of(*choices: Any, test: Callable[[Any], bool] | None = None, note: str = "") -> Rule:
    """A value set (``test``: a looser membership test, e.g. case-insensitive)."""
    return Rule(choices=choices, test=test, note=note)


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = True, then: str = "") -> Rule:
    """A number in ``[lo, hi)`` (brackets as ``lo_open``/``hi_open`` say); ``then``: the fix."""
    rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def test(v: Any) -> bool:
        return is_number(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return Rule(limit=f"a number in {rng}" + (f"; {then}" if then else ""), test=test)


def at_least(minimum: int, then: str = "", *, limit: str = "") -> Rule:
    """An integer ``>= minimum``; ``then``: the fix; ``limit``: other words for the same."""
    words = limit or f"an integer >= {minimum}" + (f"; {then}" if then else "")
    return Rule(limit=words, test=lambda v: is_int(v) and v >= minimum)


def ruled(default: Any, rule: Rule | None = None) -> Any:
    """A dataclass field with a ``default`` (a list or dict is copied for each instance) and a ``rule``
    (:func:`rule_problems` checks it)."""
    meta = {"rule": rule} if rule else {}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


#: a positive integer (sizes, counts)
POSITIVE_INT = Rule(limit="a positive integer", test=lambda v: is_int(v) and v >= 1)


def rule_problems(obj: Any, prefix: str, values: Mapping[str, Any] | None = None) -> list[str]:
    """One line per field of the dataclass ``obj`` (an instance, or its class with the ``values`` it has)
    whose value breaks its :class:`Rule`, keys named ``<prefix><field>``; nested dataclass values are
    checked too. ``None`` is never judged: whether a field may be null is its type's (OmegaConf refuses
    null in a field that is not optional)."""
    values = vars(obj) if values is None else values
    problems = []
    for f in dataclasses.fields(obj):
        value, rule = values.get(f.name), f.metadata.get("rule")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            problems += rule_problems(value, f"{prefix}{f.name}.")
        elif rule is not None and value is not None and not rule.holds(value):
            problems.append(rule.message(prefix + f.name, value))
    return problems


def unknown_key_message(section: str, key: str, valid: Iterable[Any], drop: str = "") -> str:
    """``<section>.<key> is not a <section> setting ...`` with the closest valid key (difflib) as the fix;
    ``drop``: the override to drop instead (``+optim.weight_decy=...``)."""
    valid = sorted(map(str, valid))
    where = f"{section}." if section else ""
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    fix = f"did you mean {where}{close[0]}?" if close else f"valid keys: {', '.join(valid)}"
    tail = f" (or drop {drop})." if drop else ("" if close else ".")
    what = f"{'an' if section[:1] in tuple('aeiou') else 'a'} {section} setting" if section else "a setting"
    return f"{where}{key} is not {what} (no code reads it); {fix}{tail}"


def nested_key_message(
    head: str, leaves: Mapping[str, Any], sections: Mapping[str, Iterable[Any]]
) -> str | None:
    """``+optimizer.lr=0.1``: an unknown top-level ``head`` whose first key (``lr``) is a key of a known
    section (``optim``, the closest name first): the line names ``optim.lr`` as the fix. ``None`` when
    no section has a key close to it."""
    leaf, value = next(iter(leaves.items()), (None, None))
    if leaf is None:
        return None
    ranked = difflib.get_close_matches(head, sorted(sections), n=len(sections), cutoff=0.0)
    for section in ranked:
        close = difflib.get_close_matches(str(leaf), sorted(map(str, sections[section])), n=1, cutoff=0.8)
        if close:
            meant = f"{section}.{close[0]}"
            return (
                f"{head} is not a setting (no code reads it, so {head}.{leaf}={value} would be ignored); did "
                f"you mean {meant}? ({meant}={value}, without a +)"
            )
    return None


def raise_problems(problems: list[str]) -> None:
    """One :class:`~posformer.errors.ConfigError` for the lines of one check: the line itself, or
    ``N configuration problems:`` and one line each; nothing when ``problems`` is empty."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(
            f"{len(problems)} configuration problems:\n" + "\n".join(f"  - {m}" for m in problems)
        )
