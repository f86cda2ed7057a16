"""Positional encodings: the contract (:mod:`posformer.pe.base`), the registry, one module per family.

Adding a PE = one module here (a :class:`PositionalEncoding` subclass with a ``capabilities``
declaration, decorated with :func:`register`) + one config file ``configs/pe/<name>.yaml``; see
``docs/adding_a_pe.md``. A PE outside the package plugs in as ``model.pe=module:Class``.
"""

from posformer.pe.base import Capabilities, PositionalEncoding
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

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "Capabilities",
    "PositionalEncoding",
    "build_encoding",
    "check_class",
    "encoding_options",
    "get_encoding_class",
    "list_encodings",
    "register",
]
