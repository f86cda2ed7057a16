"""Hydra's composition errors (a typed value refused, an unknown key, a ``+`` on a key already set, a
file that is not YAML) as posformer's one line: the value, the limit, the fix. Other Hydra errors keep
Hydra's own report."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from posformer.configs.schema import OWN_TRAINER_KEYS
from posformer.conform import keys_of, sections, value_line
from posformer.errors import ConfigError
from posformer.rules import nested_key_message, unknown_key_message

__all__ = ["composition_error", "valid_keys", "yaml_error"]


def _cause(exc: BaseException | None, kind: type, depth: int) -> Any:
    """The ``kind`` error at ``exc`` or behind it (causes or contexts, ``depth`` deep), or ``None``."""
    for _ in range(depth):
        if exc is None or isinstance(exc, kind):
            break
        exc = exc.__cause__ or exc.__context__
    return exc if isinstance(exc, kind) else None


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
    return keys_of(node)


def _unknown_key(key: str, parent: Any, override: str | None, origin: str) -> str:
    """The line for a key the composed config does not have: ``key`` dotted, ``override`` as given on
    the command line, or ``origin`` the config file that sets it."""
    section, _, name = key.rpartition(".")
    given = override or f"{key}=..."
    if origin and not section and origin.split("/", 1)[0] == name:  # a group file without its header
        return (
            f"configs/{origin} has no package header, so everything it sets lands under {name}.<key>, where "
            "nothing reads it (the file would do nothing); make '# @package _global_' its first line so it "
            "overrides the run's settings (e.g. trainer.max_steps), or delete the file."
        )
    if not section and override and "." in override.split("=", 1)[0] and parent is not None:
        dotted, _, value = override.lstrip("+~").partition("=")
        head, _, tail = dotted.partition(".")
        nested = nested_key_message(head, tail.split(".", 1)[0], value, sections(parent))
        if nested:
            return nested
    valid = valid_keys(section, parent) | keys_of(parent)
    if origin:
        return unknown_key_message(section, name, valid - {"hydra"}, drop=f"it from {origin}")
    if section.startswith("model.pe_options"):
        return _unknown_pe_option(section, name, parent, given)
    if name in valid - keys_of(parent):  # a key the section takes, which this config leaves out
        return f"{key} is a {section} setting this config does not set; add it with +{given.lstrip('+')}."
    return unknown_key_message(section, name, valid - {"hydra"}, drop=given)


def _pe_name(parent: Any) -> str:
    """The ``model.pe`` of the config holding the ``pe_options`` node ``parent`` (``""``: unknown)."""
    try:
        model = parent._get_parent() if OmegaConf.is_config(parent) else None
        name = model.get("pe") if OmegaConf.is_config(model) else None
    except Exception:  # a node without the usual layout: no name
        return ""
    return str(name) if isinstance(name, str) else ""


def _unknown_pe_option(section: str, name: str, parent: Any, given: str) -> str:
    """The line for an option the PE's config does not have: the PE named (a sweep composes several),
    the closest option as the fix, ``+`` to add a new one."""
    pe = _pe_name(parent)
    whose = f"pe={pe}'s config" if pe else "this PE's config"
    close = difflib.get_close_matches(name, sorted(keys_of(parent)), n=1, cutoff=0.6)
    add = f"+{given.lstrip('+')} adds a new one (the PE refuses options it does not take)"
    if close:
        return f"{given}: {name!r} is not an option of {whose}; did you mean {section}.{close[0]}? ({add})."
    return f"{given}: {name!r} is not an option of {whose}; {add}."


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
    from omegaconf.errors import OmegaConfBaseException

    cause = _cause(exc.__cause__ or exc.__context__, OmegaConfBaseException, 3)
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

    seen = _cause(exc, yaml.YAMLError, 6)
    if seen is None:
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
