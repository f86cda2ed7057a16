"""What ``--help`` of the Hydra mains shows beyond their ``hydra/help`` config (``configs/hydra/help/``).

:func:`register_help_resolvers` registers ``${posformer_pe_list:}``: every registered positional
encoding with the hooks its class declares (``rope (rotary)``, ``alibi (bias)``, ``nope (none)``),
wrapped to the help text's width, from the registry (plugins included).
"""

from __future__ import annotations

import textwrap

from omegaconf import OmegaConf


def pe_list(width: int = 96, indent: str = "  ") -> str:
    """The registered PEs with their hooks, comma-separated, wrapped at ``width``."""
    from posformer.pe.registry import ENCODINGS

    items = [
        f"{name} ({'+'.join(sorted(cls.capabilities.hooks)) or 'none'})" for name, cls in ENCODINGS.items()
    ]
    return textwrap.fill(", ".join(items), width=width, initial_indent=indent, subsequent_indent=indent)


def register_help_resolvers() -> None:
    if not OmegaConf.has_resolver("posformer_pe_list"):
        OmegaConf.register_new_resolver("posformer_pe_list", pe_list)
