"""The positional-encoding registry: names (or import paths) to classes, checked once at registration.

``ENCODINGS`` is a plain dict from registry name to class (like HF's ``ROPE_INIT_FUNCTIONS``). A PE
module registers its class with :func:`register`, which checks the facts the class states (its bias
form) against the methods it defines (:func:`~posformer.pe.base.contract_problems`). A PE defined
outside the package needs no registration: ``model.pe=mypkg.pe:MyBias`` (an import path
``module:Class``) names it directly, and :func:`get_encoding_class` imports and checks it the same way.
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from typing import Any, TypeVar

from posformer.errors import ConfigError, PosformerError
from posformer.pe.base import PositionalEncoding, contract_problems

ENCODINGS: dict[str, type[PositionalEncoding]] = {}
#: the PE of a bare ``ModelConfig()`` and of ``posformer-inspect`` without ``pe=`` (Vaswani et al. 2017)
DEFAULT_ENCODING = "sinusoidal"
#: the model facts every PE constructor takes; everything else is a PE option (``model.pe_options``)
MODEL_FACTS = ("d_model", "n_heads", "causal", "n_layers")

T = TypeVar("T", bound=type[PositionalEncoding])


def check_class(cls: Any) -> None:
    """Raise ``TypeError`` unless ``cls`` is a :class:`PositionalEncoding` whose stated facts agree with
    the methods it implements (:func:`~posformer.pe.base.contract_problems`)."""
    if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
        raise TypeError(f"{cls!r} is not a subclass of posformer.pe.PositionalEncoding")
    problems = contract_problems(cls)
    if problems:
        raise TypeError(f"{cls.__name__}: inconsistent capabilities: {'; '.join(problems)}")


def register(name: str):
    """Class decorator adding a PE class to :data:`ENCODINGS` under ``name`` (checked first)."""

    def wrap(cls: T) -> T:
        if name in ENCODINGS:
            raise RuntimeError(f"positional encoding {name!r} registered twice")
        check_class(cls)
        cls.name = name
        ENCODINGS[name] = cls
        return cls

    return wrap


def list_encodings() -> list[str]:
    """Registry names of every registered positional encoding, sorted."""
    return sorted(ENCODINGS)


def is_import_path(name: str) -> bool:
    """Whether ``name`` is an import path ``module:Class`` rather than a registry name."""
    return ":" in name


def _import_class(path: str) -> type[PositionalEncoding]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"pe={path!r}: cannot import module {module_name!r} ({exc}). Put the module on PYTHONPATH "
            "(or install its package) and give the path as module:Class, e.g. model.pe=mypkg.pe:MyBias."
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"pe={path!r}: module {module_name!r} has no attribute {attr!r}.")
    try:
        check_class(cls)
    except TypeError as exc:
        raise ConfigError(f"pe={path!r}: {exc}.") from None
    if not cls.__dict__.get("name"):
        cls.name = path  # unregistered plugin: its import path is its name in tables and errors
    return cls


def get_encoding_class(name: str) -> type[PositionalEncoding]:
    """The class of the PE ``name``: a registry name, or an import path ``module:Class``."""
    if name in ENCODINGS:
        return ENCODINGS[name]
    if isinstance(name, str) and is_import_path(name):
        return _import_class(name)
    raise ConfigError(
        f"unknown positional encoding pe={name!r}; valid names: {', '.join(list_encodings())}, "
        "or an import path module:Class of a posformer.pe.PositionalEncoding subclass."
    )


def encoding_options(cls: type[PositionalEncoding]) -> list[str]:
    """The option names (``model.pe_options`` keys) the constructor of ``cls`` accepts."""
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "kwargs", *MODEL_FACTS)]


def build_encoding(name: str, **kwargs: Any) -> PositionalEncoding:
    """Build the PE ``name`` (registry name or ``module:Class``).

    ``kwargs`` are the model facts (``d_model``, ``n_heads``, ``causal``, ``n_layers``) plus the PE's
    own options. An unknown ``name`` raises :class:`ConfigError` listing the valid names; an unknown
    option raises one naming the PE's valid options.
    """
    cls = get_encoding_class(name)
    kwargs.setdefault("d_model", 64)
    kwargs.setdefault("n_heads", 1)
    options = encoding_options(cls)
    unknown = sorted(set(kwargs) - set(options) - set(MODEL_FACTS))
    if unknown:
        hint = (
            " A pe=<name> config group sets its own PE's options: start a plugin PE from none with "
            "pe=custom (then model.pe=module:Class +model.pe_options.<key>=...)."
            if is_import_path(name)
            else ""
        )
        raise ConfigError(
            f"pe={name!r} has no option(s) {', '.join(unknown)} (model.pe_options); valid options: "
            f"{', '.join(options) or 'none'}.{hint}"
        )
    return cls(**kwargs)


def plugin_problem(pe: Any) -> str | None:
    """A plugin PE ``module:Class`` that cannot be imported: a file or relative path instead of a module
    name, or a module that raises while it is imported (the line names its file and line); ``None``: a
    registry name, or a plugin that imports."""
    if not isinstance(pe, str) or ":" not in pe:
        return None
    module = pe.partition(":")[0]
    if module.startswith(".") or "/" in module or "\\" in module or module.endswith(".py"):
        return (
            f"model.pe={pe!r} is a file or relative path; a plugin PE is named module:Class with an "
            "importable module name (e.g. model.pe=my_pe:Bias for plugins/my_pe.py) and the module's "
            "directory on PYTHONPATH (PYTHONPATH=plugins posformer-train ...)."
        )
    try:
        get_encoding_class(pe)
    except PosformerError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the plugin's own code failed at import: say where
        if isinstance(exc, SyntaxError):
            where = f"{exc.filename}:{exc.lineno}"
        else:
            frames = traceback.extract_tb(exc.__traceback__)
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else module
        return (
            f"model.pe={pe!r}: importing module {module!r} failed with {type(exc).__name__}: {exc} (at "
            f"{where}); fix the module (python -c 'import {module}' shows the full error) or use another PE."
        )
    return None
