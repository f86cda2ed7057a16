"""Rules: what a config value must be beyond its OmegaConf type, and the one line that says so
(``<key>=<value> must be <limit>.`` or ``... is unknown; valid: ....``). Light: the model code uses it too."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from posformer.errors import ConfigError


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Rule:
    """``limit`` completes ``<key>=<value> must be ...`` with the fix, ``test`` checks it; ``choices``: the
    valid values (``note`` follows their list); ``line(key, value)``: a line of its own (``None``: kept)."""

    limit: str = ""
    test: Callable[[Any], bool] | None = None
    choices: tuple[Any, ...] = ()
    note: str = ""
    line: Callable[[str, Any], str | None] | None = None

    def holds(self, value: Any) -> bool:
        if self.line is not None:
            return self.line("", value) is None
        if self.test is not None:
            return bool(self.test(value))
        return not self.choices or value in self.choices

    def message(self, key: str, value: Any) -> str:
        if self.line is not None and self.line(key, value):
            return str(self.line(key, value))
        if self.choices:
            valid = ", ".join("null" if c is None else str(c) for c in self.choices)
            return f"{key}={value!r} is unknown; valid: {valid}{f' {self.note}' if self.note else ''}."
        return f"{key}={value!r} must be {self.limit}."


def one_of(*choices: Any, test: Callable[[Any], bool] | None = None, note: str = "") -> Rule:
    return Rule(choices=choices, test=test, note=note)


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = True, then: str = "") -> Rule:
    """A number in ``[lo, hi)`` (brackets as ``lo_open``/``hi_open`` say); ``then``: the fix."""
    rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def test(v: Any) -> bool:
        return is_number(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return Rule(limit=f"a number in {rng}" + (f"; {then}" if then else ""), test=test)


def at_least(minimum: int, then: str = "", *, limit: str = "", null: str = "") -> Rule:
    """An integer ``>= minimum``; ``then``: the fix; ``null``: what null means; ``limit``: other words."""
    null, then = f" or null ({null})" if null else "", f"; {then}" if then else ""
    return Rule(
        limit=limit or f"an integer >= {minimum}{null}{then}", test=lambda v: is_int(v) and v >= minimum
    )


def positive(limit: str = "a positive number") -> Rule:
    return Rule(limit=limit, test=lambda v: is_number(v) and v > 0)


def seed(words: str) -> Rule:
    """A seed numpy's RNG accepts: ``[0, 2**32)``; ``words`` follow ``below 2**32``."""
    return Rule(
        limit=f"a non-negative integer below 2**32{words}", test=lambda v: is_int(v) and 0 <= v < 2**32
    )


def worded(ok: Callable[[Any], bool], line: Callable[[str, Any], str]) -> Rule:
    """A rule whose own ``line(key, value)`` words a value ``ok`` refuses."""
    return Rule(line=lambda k, v: None if ok(v) else line(k, v))


def ruled(default: Any, rule: Rule | None = None) -> Any:
    """A dataclass field with a ``default`` (a list or dict copied for each instance) and a ``rule``."""
    meta = {"rule": rule} if rule else {}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


#: a positive integer (sizes, counts)
POSITIVE_INT = at_least(1, limit="a positive integer")


def rule_problems(obj: Any, prefix: str, values: Mapping[str, Any] | None = None) -> list[str]:
    """One line per field of the dataclass ``obj`` (an instance, or its class with its ``values``), nested
    ones too, whose value breaks its rule; ``None`` is never judged (whether it may be null is the type's)."""
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
    """``<section>.<key> is not a <section> setting ...``, the closest valid key as the fix; ``drop``: the
    override to drop instead."""
    valid = sorted(map(str, valid))
    where = f"{section}." if section else ""
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    if not valid:  # an open section with nothing in it yet (model.layer_kinds): Hydra adds a key with +
        fix = f"{section} has no keys yet: add one with a leading +, e.g. +{where}{key}=..."
    else:
        fix = f"did you mean {where}{close[0]}?" if close else f"valid keys: {', '.join(valid)}"
    tail = f" (or drop {drop})." if drop else ("" if close else ".")
    what = f"{'an' if section[:1] in tuple('aeiou') else 'a'} {section} setting" if section else "a setting"
    return f"{where}{key} is not {what} (no code reads it); {fix}{tail}"


def nested_key_message(head: str, leaf: Any, value: Any, sections: Mapping[str, Iterable[Any]]) -> str | None:
    """``+optimizer.lr=0.1``: an unknown ``head`` whose ``leaf`` is a key of a known section (the closest
    name first) names ``optim.lr`` as the fix; ``None`` when no section has a key close to it."""
    for section in difflib.get_close_matches(head, sorted(sections), n=len(sections), cutoff=0.0):
        close = difflib.get_close_matches(str(leaf), sorted(map(str, sections[section])), n=1, cutoff=0.8)
        if close:
            meant = f"{section}.{close[0]}"
            return (
                f"{head} is not a setting (no code reads it, so {head}.{leaf}={value} would be ignored); did "
                f"you mean {meant}? ({meant}={value}, without a +)"
            )
    return None


def raise_problems(problems: list[str]) -> None:
    """One :class:`ConfigError` for the lines of one check (``N configuration problems:`` and one line
    each when there are several); nothing when ``problems`` is empty."""
    if len(problems) > 1:
        problems = [f"{len(problems)} configuration problems:\n" + "\n".join(f"  - {m}" for m in problems)]
    if problems:
        raise ConfigError(problems[0])
