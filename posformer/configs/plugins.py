"""Optional integrations named on the command line, checked before Hydra starts.

``logger=wandb``, ``logger=mlflow``, ``hydra/sweeper=optuna`` and ``hydra/launcher=submitit_*`` need
packages outside posformer's core dependencies (the ``[wandb]``, ``[mlflow]``, ``[optuna]`` and
``[slurm]`` extras). Without them Hydra or Lightning fail deep inside instantiation with a long
report; :func:`check_plugins` says instead, in one :class:`~posformer.errors.ConfigError` line, which
override needs which package and how to install it.
"""

from __future__ import annotations

import importlib.util

from posformer.errors import ConfigError

__all__ = ["OPTIONAL", "check_plugins", "missing_plugin"]

#: (config group, part of the option name) -> (module that must be importable, pyproject extra, pip package)
OPTIONAL: dict[tuple[str, str], tuple[str, str, str]] = {
    ("logger", "wandb"): ("wandb", "wandb", "wandb"),
    ("logger", "mlflow"): ("mlflow", "mlflow", "mlflow"),
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna", "hydra-optuna-sweeper"),
    ("hydra/launcher", "submitit"): (
        "hydra_plugins.hydra_submitit_launcher",
        "slurm",
        "hydra-submitit-launcher",
    ),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def missing_plugin(override: str) -> str | None:
    """The one-line hint for a ``group=option`` override whose package is not installed, else ``None``."""
    group, sep, option = override.lstrip("+~").partition("=")
    if not sep:
        return None
    for (want_group, prefix), (module, extra, package) in OPTIONAL.items():
        if group == want_group and prefix in option and not _importable(module):
            return (
                f"{override} needs the {package} package, which is not installed; install it with "
                f"pip install -e '.[{extra}]' (or pip install {package}), or choose another {group}."
            )
    return None


def check_plugins(argv: list[str]) -> None:
    """Raise a :class:`ConfigError` for the first override in ``argv`` that needs a missing package."""
    for arg in argv:
        hint = missing_plugin(arg)
        if hint:
            raise ConfigError(hint)
