"""Hydra's composition errors as posformer's one line: the value, the limit, the fix.

Hydra composes the config before any posformer code runs, and the typed schema
(:mod:`posformer.configs.schema`) makes it refuse a value of the wrong type there, as it refuses a key
that no config declares and a ``+key`` that is already set. ``hydra.main`` would print such a refusal
as several lines of Hydra's and OmegaConf's words; :func:`composition_error` words it as posformer's
other errors (the command-line mains through :func:`posformer.cli.composition.composition_errors`, the
Python API directly)::

    seed=abc                  seed='abc' must be a non-negative integer below 2**32 = 4294967296
                              (the range numpy's RNG accepts); e.g. seed=0.
    optim.weight_decy=0.1     optim.weight_decy is not an optim setting (no code reads it); did you mean
                              optim.weight_decay? (or drop optim.weight_decy=0.1).
    trainer.enable_progress_bar=false
                              trainer.enable_progress_bar is a trainer setting this config does not set;
                              add it with +trainer.enable_progress_bar=false.
    +optim.lr=1               +optim.lr=1: optim.lr is already set; drop the + (optim.lr=1).

:func:`valid_keys` says which keys a section takes, here and for the keys added with ``+`` that
:func:`posformer.configs.settings.read_train` refuses. Other Hydra errors (an unknown group option such
as ``pe=rotary``, with Hydra's list of the valid ones) keep Hydra's own report.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from posformer.configs.schema import OWN_TRAINER_KEYS
from posformer.conform import value_line
from posformer.errors import ConfigError
from posformer.rules import nested_key_message, unknown_key_message

__all__ = ["composition_error", "valid_keys", "yaml_error"]


def _omegaconf_cause(exc: BaseException) -> Any:
    """The OmegaConf error behind Hydra's ``exc`` (its cause or context), or ``None``."""
    from omegaconf.errors import OmegaConfBaseException

    seen = exc
    for _ in range(4):
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            return None
        if isinstance(nxt, OmegaConfBaseException):
            return nxt
        seen = nxt
    return None


def _keys_of(node: Any) -> set[str]:
    return {str(k) for k in node} if hasattr(node, "keys") else set()


def valid_keys(section: str, node: Any) -> set[str]:
    """The keys ``section`` (dotted; ``""``: the root) takes: the fields of its typed ``node``, every
    ``lightning.Trainer`` argument under ``trainer``, else the keys ``node`` has."""
    cls = OmegaConf.get_type(node) if OmegaConf.is_config(node) else None
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    if section == "trainer":
        import inspect

        import lightning

        lightning_keys = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
        return lightning_keys | set(OWN_TRAINER_KEYS)
    return _keys_of(node)


def _unknown_key(key: str, parent: Any, override: str | None, origin: str) -> str:
    """The line for a key the composed config does not have: ``key`` dotted, ``override`` as given on
    the command line, or ``origin`` the config file that sets it."""
    section, _, name = key.rpartition(".")
    given = override or f"{key}=..."
    if origin and not section and origin.split("/", 1)[0] == name:  # group file content under its group
        return _missing_package_header(origin, name, parent)
    if not section and override and "." in override.split("=", 1)[0]:
        nested = _nested_guess(override, parent)
        if nested:
            return nested
    valid = valid_keys(section, parent) | _keys_of(parent)
    if origin:
        return unknown_key_message(section, name, valid - {"hydra"}, drop=f"it from {origin}")
    if section.startswith("model.pe_options"):
        return (
            f"{given}: {name!r} is not an option of this PE's config; add a new one with "
            f"+{given.lstrip('+')} (the PE refuses options it does not take)."
        )
    if name in valid - _keys_of(parent):  # a key the section takes, which this config leaves out
        return f"{key} is a {section} setting this config does not set; add it with +{given.lstrip('+')}."
    return unknown_key_message(section, name, valid - {"hydra"}, drop=given)


def _missing_package_header(origin: str, group: str, parent: Any) -> str:
    """A group file (``local/default.yaml``) whose keys land under ``<group>.``: it lacks its header."""
    del parent
    return (
        f"configs/{origin} has no package header, so everything it sets lands under {group}.<key>, where "
        "nothing reads it (the file would do nothing); make '# @package _global_' its first line so it "
        "overrides the run's settings (e.g. trainer.max_steps), or delete the file."
    )


def _nested_guess(override: str, parent: Any) -> str | None:
    """``optimizer.lr=0.1``: the key it meant (``optim.lr``; :func:`~posformer.rules.nested_key_message`)."""
    dotted, _, value = override.lstrip("+~").partition("=")
    head, _, tail = dotted.partition(".")
    sections = (
        {s: _keys_of(parent.get(s)) for s in _keys_of(parent) - {"hydra"}} if parent is not None else {}
    )
    return nested_key_message(head, {tail.split(".", 1)[0]: value}, sections)


def composition_error(exc: BaseException, overrides: Sequence[str]) -> ConfigError | None:
    """One :class:`ConfigError` line for a composition error of a typed value, an unknown key or a
    ``+`` on a key already set; ``None`` for other errors (Hydra's own report stays)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

    if not isinstance(exc, ConfigCompositionException) or isinstance(exc, MissingConfigException):
        return None  # not a composition error, or an unknown group option (Hydra lists the valid ones)
    text = str(exc)
    given = {o.split("=", 1)[0].lstrip("+~"): o for o in overrides if "=" in o}
    found = re.match(r"In '([^']+)': ", text)  # an error in a config file, not in an override
    origin = f"{found.group(1)}.yaml" if found else ""
    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if m:
        said = given.get(m.group(1), f"+{m.group(1)}=...")
        return ConfigError(f"{said}: {m.group(1)} is already set; drop the + ({said.lstrip('+')}).")
    cause = _omegaconf_cause(exc)
    key = str(getattr(cause, "full_key", "") or "")
    if cause is None or not key:
        return None
    if isinstance(cause, ConfigTypeError) and "does not support deletion" in str(cause):
        return ConfigError(
            f"~{key}: {key} is part of the typed schema (posformer/configs/schema.py) and cannot be "
            f"removed; give it a value instead ({key}=...)."
        )
    if isinstance(cause, ValidationError):
        line = value_line(cause)
        return ConfigError(f"{line[:-1]} (set in {origin})." if origin else line)
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        said = given.get(key) or next((o for k, o in given.items() if k.startswith(f"{key}.")), None)
        return ConfigError(_unknown_key(key, getattr(cause, "parent_node", None), said, origin))
    return None


def yaml_error(exc: BaseException) -> ConfigError | None:
    """One line for a YAML error behind ``exc`` (a ``--config-name`` file, ``configs/local/default.yaml``):
    the file, line and column and what is wrong; ``None`` when there is none."""
    import yaml

    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None or isinstance(seen, yaml.YAMLError):
            break
        seen = seen.__cause__ or seen.__context__
    if not isinstance(seen, yaml.YAMLError):
        return None
    mark = getattr(seen, "problem_mark", None)
    where = "a config file"
    if mark is not None:
        where = f"{mark.name} (line {mark.line + 1}, column {mark.column + 1})"
    problem = str(getattr(seen, "problem", "") or seen).strip().splitlines()[0]
    tag = re.search(r"tag:yaml\.org,2002:(python/\S+?)'", problem)
    if tag:
        return ConfigError(
            f"{where} holds the YAML tag !!{tag.group(1)}, which config files may not use (a !!python/ tag "
            "would run code as the file loads; posformer loads configs as plain data); remove the tag and "
            "write the value itself."
        )
    return ConfigError(
        f"{where} is not valid YAML: {problem}; fix the file there (quote values with ':' or '#', close "
        "brackets, indent with spaces) or move it away."
    )
