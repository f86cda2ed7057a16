"""A training sweep's jobs (a Hydra multirun's dir): their labels and what each left behind.

A job is named by its swept overrides only (:func:`posformer.configs.job_items`; the keys that vary
between its ``results.json`` files when the sweep has no ``multirun.yaml``): ``rope · seed 0``,
``rope · n_heads 2 · seed 1``; the PE is always named, or the variant in its place (``prope · seed
1``). The *group* of a job is its label without the seed (:func:`split_seed`).
:func:`load_jobs` reads every job's ``results.json`` and the jobs that failed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from posformer.configs import job_items, swept_keys

#: between the parts of a label: ``rope · n_heads 2 · seed 0``
SEP = " · "
_SEED = re.compile(rf"{re.escape(SEP)}seed (-?\d+)")


def split_seed(label: str) -> tuple[str, int | None]:
    """``"rope · seed 0"`` -> ``("rope", 0)``; a label without a seed -> ``(label, None)``."""
    m = _SEED.search(label)
    return (_SEED.sub("", label), int(m.group(1))) if m else (label, None)


def job_overrides(job_dir: Path) -> list[str]:
    """The overrides of one job (``.hydra/overrides.yaml``); ``[]`` if it has none."""
    path = Path(job_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in (OmegaConf.load(path) or [])] if path.is_file() else []


def job_label(
    overrides: list[str], swept: list[str] | tuple[str, ...] | None, pe: str = "", variant: str | None = None
) -> str:
    """``rope · n_heads 2 · seed 0``: the swept overrides (``pe`` by its value), the PE first; a job with a
    variant (``+variant=prope``) is named by it instead, its PE left out: ``prope · seed 0``."""
    items = job_items(overrides, swept)
    if variant:
        rest = [f"{k} {v}" for k, v in items if k not in ("variant", "pe")]  # the variant sets the PE
        return SEP.join([variant, *rest])
    parts = [v if k == "pe" else f"{k} {v}" for k, v in items]
    if pe and "pe" not in {k for k, _ in items}:
        parts.insert(0, pe)
    return SEP.join(parts) or pe or "run"


def run_label(run_dir: Path | str, pe: str = "", variant: str | None = None) -> str | None:
    """The label of a training run that is a sweep job (its parent holds ``multirun.yaml``); else ``None``."""
    run_dir = Path(run_dir)
    swept = swept_keys(run_dir.parent)
    return None if swept is None else job_label(job_overrides(run_dir), swept, pe, variant)


def _job_number(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else sys.maxsize, path.name)


# ---------------------------------------------------------------------------------------------- loading
def load_jobs(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every job's ``results.json`` (job order) with ``_dir``, ``_label``, ``_group``; and the failed
    jobs (an ``error.txt`` not followed by a ``results.json``) as ``{job, error, path}``."""
    runs = []
    for path in sorted(sweep_dir.rglob("results.json"), key=lambda p: _job_number(p.parent)):
        res = json.loads(path.read_text())
        res["_dir"], res["_overrides"] = str(path.parent), job_overrides(path.parent)
        runs.append(res)
    swept = swept_keys(sweep_dir)
    if swept is None:  # no multirun.yaml: the keys whose value differs between the jobs
        values = [dict(o.lstrip("+~").partition("=")[::2] for o in r["_overrides"]) for r in runs]
        keys = dict.fromkeys(k for v in values for k in v)
        swept = [k for k in keys if len({v.get(k) for v in values}) > 1]
    for r in runs:
        r["_label"] = job_label(r["_overrides"], swept, str(r.get("pe") or ""), r.get("variant"))
        r["_group"] = split_seed(r["_label"])[0]
    failed = []
    for err in sorted(sweep_dir.rglob("error.txt"), key=lambda p: _job_number(p.parent)):
        res = err.parent / "results.json"
        if res.exists() and res.stat().st_mtime > err.stat().st_mtime:
            continue  # re-run successfully since
        lines = [ln for ln in err.read_text(errors="replace").splitlines() if ln.strip()]
        failed.append({"job": err.parent.name, "error": lines[0] if lines else "(empty)", "path": str(err)})
    return runs, failed
