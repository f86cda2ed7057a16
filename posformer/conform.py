"""A plain mapping merged onto a typed dataclass's node (the config's sections, each dataset's options,
``posformer-eval``'s settings) one key at a time, so that every refused key and value is one line
(:func:`value_line`), all of them at once; :func:`spec` declares a field whose value the YAML files give."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from posformer.rules import Rule, nested_key_message, unknown_key_message


def spec(rule: Rule | None = None) -> Any:
    return field(default=MISSING, metadata={"rule": rule} if rule else {})


def schema_node(cls: type) -> DictConfig:
    """``OmegaConf.structured(cls)`` open for merging (a frozen dataclass makes its nodes read-only)."""

    def writable(node: Any) -> None:
        OmegaConf.set_readonly(node, None)
        for key in node if isinstance(node, DictConfig) else range(len(node)):
            child = node._get_node(key)
            if isinstance(child, DictConfig | ListConfig):
                writable(child)

    node = OmegaConf.structured(cls)
    writable(node)
    return node


def keys_of(node: Any) -> set[str]:
    return {str(k) for k in node} if hasattr(node, "keys") else set()


def sections(root: Any, given: Mapping[str, Any] | None = None) -> dict[str, set[str]]:
    """Each section of the config ``root`` with its keys (and those ``given`` sets): where a mistyped
    ``+optimizer.lr`` is looked up (:func:`~posformer.rules.nested_key_message`)."""
    given = given or {}
    return {
        s: keys_of(root._get_node(s)) | keys_of(given.get(s) if isinstance(given.get(s), Mapping) else None)
        for s in keys_of(root) - {"hydra"}
    }


def conform(cls: type, given: Mapping[str, Any], prefix: str) -> tuple[DictConfig, list[str]]:
    """``given`` (plain values) merged onto ``cls``'s node one key at a time: the node, and one line per
    key the schema does not declare or value OmegaConf refuses (keys named ``<prefix><key>``)."""
    node, problems = schema_node(cls), []
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in given.items():
        if key not in names:
            nested = None
            if not prefix and isinstance(value, Mapping) and value:  # +optimizer.lr=0.1 meant optim.lr
                nested = nested_key_message(key, *next(iter(value.items())), sections(node, given))
            problems.append(
                nested or unknown_key_message(prefix.rstrip("."), key, names, f"+{prefix}{key}=...")
            )
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
