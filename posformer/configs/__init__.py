"""Hydra configs shipped with posformer (``configs/`` in the repository is a symlink here).

Importing this package (Hydra does, to read the files) registers the config resolvers:
``${posformer_cwd:}`` (the working directory; unlike ``${hydra:runtime.cwd}`` it also resolves
where Hydra's runtime config is not set yet, e.g. in the multirun sweep dir) and
``${posformer_job_dirname:num,override_dirname}`` (safe, short sweep subdirs).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from omegaconf import OmegaConf


def job_dirname(num: Any, override_dirname: str, max_len: int = 80) -> str:
    """Sweep subdir of one job: ``<num>_<overrides>``, shortest overrides first, filesystem-safe
    (``/`` and odd characters replaced) and shortened with a hash when long."""
    items = re.split(r",(?=[+~]?[\w.]+=)", override_dirname or "")  # commas inside values stay
    items.sort(key=lambda item: (len(item), item))  # short, identifying items (pe=rope, seed=0) first
    name = re.sub(r"[^\w=,.+\-\[\]]", "_", ",".join(i for i in items if i))
    if len(name) > max_len:
        name = name[: max_len - 9] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{num}_{name}" if name else str(num)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("posformer_cwd"):
        OmegaConf.register_new_resolver("posformer_cwd", os.getcwd)
    if not OmegaConf.has_resolver("posformer_job_dirname"):
        OmegaConf.register_new_resolver("posformer_job_dirname", job_dirname)


register_resolvers()
