"""The positional-encoding registry.

``ENCODINGS`` is a plain dict from registry name to class (like HF's ``ROPE_INIT_FUNCTIONS``).
Each PE module registers its class with :func:`register`; :func:`build_encoding` builds one.
"""

from __future__ import annotations

from typing import Any, TypeVar

from posformer.errors import ConfigError
from posformer.pe.base import Capabilities, PositionalEncoding

ENCODINGS: dict[str, type[PositionalEncoding]] = {}

T = TypeVar("T", bound=type[PositionalEncoding])


def register(name: str):
    """Class decorator adding a PE class to :data:`ENCODINGS` under ``name``."""

    def wrap(cls: T) -> T:
        if name in ENCODINGS:
            raise RuntimeError(f"positional encoding {name!r} registered twice")
        check_class(cls)
        cls.name = name
        ENCODINGS[name] = cls
        return cls

    return wrap


def check_class(cls: type) -> None:
    """Raise ``TypeError`` unless ``cls`` is a :class:`PositionalEncoding` with a consistent declaration."""
    if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
        raise TypeError(f"{cls!r} is not a subclass of posformer.pe.PositionalEncoding")
    caps = cls.__dict__.get("capabilities", cls.capabilities)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{cls.__name__}.capabilities must be a posformer.pe.Capabilities, got {caps!r}")
    problems = caps.problems()
    overrides_attention = cls.attention is not PositionalEncoding.attention
    if overrides_attention != caps.attention_shortcut:
        problems.append(
            f"attention_shortcut={caps.attention_shortcut} but the class "
            f"{'implements' if overrides_attention else 'does not implement'} attention()"
        )
    if problems:
        raise TypeError(f"{cls.__name__}: inconsistent capabilities: {'; '.join(problems)}")


def list_encodings() -> list[str]:
    """Registry names of every positional encoding, sorted."""
    return sorted(ENCODINGS)


def get_encoding_class(name: str) -> type[PositionalEncoding]:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ConfigError(
            f"unknown positional encoding pe={name!r}; valid names: {', '.join(list_encodings())}."
        ) from None


def build_encoding(name: str, **kwargs: Any) -> PositionalEncoding:
    """Build the PE registered as ``name``.

    ``kwargs`` are the model facts (``d_model``, ``n_heads``, ``causal``, ``n_layers``) plus the PE's
    own options. An unknown ``name`` raises ``ValueError`` listing the valid names; an unknown
    option raises one naming the PE's valid options.
    """
    import inspect

    cls = get_encoding_class(name)
    kwargs.setdefault("d_model", 64)
    kwargs.setdefault("n_heads", 1)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        options = [p for p in accepted if p not in ("d_model", "n_heads", "causal", "n_layers")]
        raise ConfigError(
            f"pe={name!r} has no option(s) {', '.join(unknown)} (model.pe_options); valid options: "
            f"{', '.join(options) or 'none'}."
        )
    return cls(**kwargs)


# Import the modules so they register themselves.
from posformer.pe import (  # noqa: E402,F401
    alibi,
    fire,
    kerple,
    learned,
    nope,
    rope,
    shaw,
    sinusoidal,
    t5,
)

__all__ = ["ENCODINGS", "Capabilities", "PositionalEncoding", "build_encoding", "list_encodings", "register"]
