"""Positional encodings: the contract (:mod:`posformer.pe.base`), the registry, one module per family.

Adding a PE = one module here (a :class:`PositionalEncoding` subclass that states its bias form,
decorated with :func:`register`) + one config file ``configs/pe/<name>.yaml``; see
``docs/adding_a_pe.md``. A PE outside the package plugs in as ``model.pe=module:Class``.
"""

from posformer.pe.base import Capabilities, PositionalEncoding
from posformer.pe.forms import BiasForm, Features, Offsets, PerCall, Positions
from posformer.pe.registry import (
    DEFAULT_ENCODING,
    ENCODINGS,
    build_encoding,
    check_class,
    encoding_options,
    get_encoding_class,
    list_encodings,
    register,
)
from posformer.pe.shortcut import AttentionShortcut

# isort: split
# Import the family modules so they register themselves.
from posformer.pe import (  # noqa: F401
    alibi,
    cope,
    dpb,
    fire,
    forget_alibi,
    kerple,
    learned,
    nope,
    rope,
    sandwich,
    shaw,
    sinusoidal,
    t5,
)

# isort: split
# PoPE last: a PE's figure colour and marker follow registry order, so a new one comes after the others
from posformer.pe.rope import polar  # noqa: F401

# isort: split
from posformer.pe import content_rel  # noqa: F401

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "AttentionShortcut",
    "BiasForm",
    "Capabilities",
    "Features",
    "Offsets",
    "PerCall",
    "PositionalEncoding",
    "Positions",
    "build_encoding",
    "check_class",
    "encoding_options",
    "get_encoding_class",
    "list_encodings",
    "register",
]
