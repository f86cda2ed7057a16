"""posformer from Python: :func:`train`, :func:`evaluate` and :func:`load_run`, with results objects.

The same flow, checks and files as the command line, from a plain Python process (a notebook, a
script) with no Hydra app around it::

    import posformer
    result = posformer.train(["pe=alibi", "trainer.max_steps=200"])     # like posformer-train pe=alibi ...
    result = posformer.train(pe="alibi", trainer={"max_steps": 200})   # the same, as keyword arguments
    result.metrics[64]["exact_match"]                  # per evaluated length
    ev = posformer.evaluate(result.run_dir, lengths=[16, 32, 64])      # like posformer-eval
    ev.metric("exact_match")                           # {label: {length: value}}
    run = posformer.load_run(result.run_dir)           # model, tokenizer, config, metrics
    run.generate("ROMEO:", max_new_tokens=50, temperature=0.8, top_k=20, seed=0)

Overrides are Hydra's: ``key=value`` strings, or keyword arguments (``pe="alibi"``; a mapping value is
flattened: ``trainer={"max_steps": 200}`` -> ``trainer.max_steps=200``; a dotted key is passed with
``**{"data.path": p}``). A wrong type, an unknown key, a bad value: one
:class:`~posformer.errors.ConfigError` line (the command line's words), raised before anything is
written. The run dir is ``<paths.log_dir>/train/runs/<time>`` as on the command line, or ``run_dir=``;
it holds ``config.yaml``, ``checkpoints/``, ``tokenizer/`` and ``results.{json,csv,md}``.
"""

from __future__ import annotations

import datetime
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import DictConfig, OmegaConf

from posformer import metrics
from posformer.configs import job_items, register_resolvers
from posformer.configs.composition import composition_error
from posformer.configs.plugins import check_plugins
from posformer.configs.variants import run_label, variant_name
from posformer.errors import CheckpointError, ConfigError, Interrupted, PosformerError, RunInterrupted
from posformer.eval.results import RESULTS_CSV, RESULTS_JSON, RESULTS_MD
from posformer.eval.sweep_jobs import SEP, split_seed
from posformer.interop import export_hf, hf_to_checkpoint, import_hf
from posformer.runs import Run, load_run
from posformer.utils.format import markdown_table, spread_table

__all__ = [
    "EvalResult",
    "Run",
    "TrainResult",
    "evaluate",
    "export_hf",
    "hf_to_checkpoint",
    "import_hf",
    "load_run",
    "train",
]

_PLAIN_VALUE = re.compile(r"[A-Za-z_/.~][\w./~:+-]*")
_NOT_STRINGS = {"true", "false", "null", "none", "nan", "inf"}


# ------------------------------------------------------------------------------------ overrides
def override_value(value: Any) -> str:
    """``value`` in Hydra's override grammar: ``None`` -> ``null``, lists ``[a,b]``, mappings
    ``{k: v}``, strings quoted unless they are plain names or paths."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN_VALUE.fullmatch(text) and text.lower() not in _NOT_STRINGS:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def as_overrides(overrides: Sequence[str] | None = None, **kwargs: Any) -> list[str]:
    """``overrides`` (``key=value`` strings) followed by ``kwargs`` as overrides; a mapping value is
    flattened to dotted keys (``trainer={"max_steps": 9}`` -> ``trainer.max_steps=9``)."""
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides={overrides!r} is one string; pass a list of key=value strings, e.g. [{overrides!r}]."
        )
    if overrides is not None and (
        not isinstance(overrides, list | tuple) or not all(isinstance(o, str) for o in overrides)
    ):
        raise ConfigError(
            f"overrides={overrides!r} must be a list of key=value strings, e.g. ['pe=alibi', "
            "'trainer.max_steps=200'] (or keyword arguments: pe='alibi')."
        )
    out = list(overrides or [])

    def add(key: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                add(f"{key}.{k}", v)
        else:
            out.append(f"{key}={override_value(value)}")

    for key, value in kwargs.items():
        add(key, value)
    return out


@contextmanager
def _posformer_hydra() -> Iterator[None]:
    """Hydra initialised on posformer's configs for the duration; a Hydra set up by the caller (a
    notebook's own ``initialize``) is put back afterwards."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    gh = GlobalHydra.instance()
    saved = gh.hydra if gh.is_initialized() else None
    gh.clear()
    try:
        with initialize_config_module("posformer.configs", version_base="1.3"):
            yield
    finally:
        gh = GlobalHydra.instance()  # initialize_config_module put back a copy of the instance
        gh.clear()
        if saved is not None:
            gh.initialize(saved)


def compose(config_name: str, overrides: Sequence[str]) -> DictConfig:
    """``configs/<config_name>.yaml`` with ``overrides``, as the command line composes it; a composition
    error is one :class:`ConfigError` line (:func:`posformer.configs.composition.composition_error`)."""
    from hydra import compose as hydra_compose

    overrides = list(overrides)
    check_plugins(overrides)  # logger=wandb, hydra/sweeper=optuna, ... without their package
    with _posformer_hydra():
        try:
            return hydra_compose(config_name=config_name, overrides=overrides)
        except Exception as exc:  # noqa: BLE001 - every composition error becomes one line
            error = composition_error(exc, overrides)
            if error is not None:
                raise error from None
            text = " ".join(str(exc).split())
            raise ConfigError(f"{config_name} config with overrides {overrides}: {text}") from None


def _new_run_dir(cfg: DictConfig, task: str) -> Path:
    """``<paths.log_dir>/<task>/runs/<time>``: where the command line's Hydra would put the run."""
    now = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    return Path(str(OmegaConf.select(cfg, "paths.log_dir"))) / task / "runs" / now


def _path(name: str, value: Any) -> Path | None:
    """``value`` (a str or ``Path``; ``None`` passes) as a ``Path``, else one :class:`ConfigError` line."""
    if value is None:
        return None
    if not isinstance(value, str | Path):
        raise ConfigError(
            f"{name}={value!r} is a {type(value).__name__}; pass a path (a str or pathlib.Path)."
        )
    return Path(value).expanduser().absolute()


def _free_dir(name: str, path: Path) -> None:
    """``path`` must be a directory or not exist yet (a file there: one line, before any work)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{name}={str(path)!r} is a file, not a directory; choose a new folder (e.g. {path}_dir)."
        )


@contextmanager
def _unless_refused(path: Path, started: str) -> Iterator[None]:
    """A directory the call creates is removed again if the call fails before writing ``started`` (the
    command line's rule: a refused run leaves no run dir); a signal is raised as
    :class:`~posformer.errors.RunInterrupted` (the line says what was kept and how to continue)."""
    existed = path.exists()
    try:
        yield
    except (PosformerError, Interrupted) as exc:
        if not existed and path.is_dir() and not (path / started).exists():
            shutil.rmtree(path, ignore_errors=True)
        if isinstance(exc, Interrupted):
            raise RunInterrupted(exc.signum, exc.message) from None
        raise


# ------------------------------------------------------------------------------------ train
@dataclass
class TrainResult:
    """What :func:`train` returns: the run's headline metrics and where everything is.

    Attributes:
        run_dir: the run directory (``config.yaml``, ``checkpoints/``, ``results.{json,csv,md}``).
        metrics: per evaluated length, its metrics (``loss``, ``ppl``, ``token_acc``, ``exact_match``,
            ``n_tokens``, ``in_distribution``).
        val: the last validation's metrics (``val/loss``, ...).
        results: ``results.json`` as written.
    """

    run_dir: Path
    pe: str
    model_kind: str
    task_type: str
    seed: int
    global_step: int
    train_length: Any
    metrics: dict[int, dict[str, Any]]
    val: dict[str, float]
    best_checkpoint: Path | None
    last_checkpoint: Path | None
    results: dict[str, Any] = field(repr=False)

    @property
    def files(self) -> dict[str, Path]:
        return {n: self.run_dir / f"results.{n}" for n in ("json", "csv", "md")}

    def load(self, which: str = "last") -> Run:
        """The trained run (:func:`load_run`)."""
        return load_run(self.run_dir, which=which)

    @classmethod
    def from_results(cls, results: Mapping[str, Any]) -> TrainResult:
        ckpt = results.get("checkpoint") or {}
        rows = results.get("results") or []
        return cls(
            run_dir=Path(results["output_dir"]),
            pe=str(results.get("pe", "")),
            model_kind=str(results.get("model_kind", "")),
            task_type=str((results.get("data") or {}).get("task_type", "")),
            seed=int(results.get("seed", 0)),
            global_step=int(results.get("global_step", 0)),
            train_length=results.get("train_length"),
            metrics={int(r["length"]): {k: v for k, v in r.items() if k != "length"} for r in rows},
            val=dict(results.get("val") or {}),
            best_checkpoint=Path(ckpt["best"]) if ckpt.get("best") else None,
            last_checkpoint=Path(ckpt["last"]) if ckpt.get("last") else None,
            results=dict(results),
        )


def train(
    overrides: Sequence[str] | None = None, *, run_dir: str | Path | None = None, **kwargs: Any
) -> TrainResult:
    """Train and evaluate one model, as ``posformer-train <overrides>`` does; returns a :class:`TrainResult`.

    ``overrides``: Hydra overrides (``["pe=alibi", "trainer.max_steps=200"]``); ``kwargs``: more of them
    (:func:`as_overrides`); ``run_dir``: where the run writes (default: a new
    ``<paths.log_dir>/train/runs/<time>``). Multiruns (``-m``) stay on the command line.
    """
    from posformer.training import run

    run_dir = _path("run_dir", run_dir)
    given = as_overrides(overrides, **kwargs)
    if any(o in ("-m", "--multirun") for o in given):
        raise ConfigError(
            "posformer.train runs one job; for a sweep call it per setting or use posformer-train -m."
        )
    cfg = compose("train", given)
    if run_dir is None and not any(o.lstrip("+").startswith("paths.output_dir=") for o in given):
        run_dir = _new_run_dir(cfg, str(cfg.task_name))
    if run_dir is not None:
        cfg.paths.output_dir = str(run_dir)
    out = Path(str(cfg.paths.output_dir))
    _free_dir("run_dir", out)
    try:
        with _unless_refused(out, "config.yaml"):
            return TrainResult.from_results(run(cfg))
    except RunInterrupted as exc:
        raise RunInterrupted(exc.signum, _api_resume(str(exc), given, out)) from None


def _api_resume(message: str, given: list[str], run_dir: Path) -> str:
    """The interrupt line with the Python call that resumes: the same overrides, ``run_dir`` and the
    newest checkpoint of the run."""
    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        return message
    kept = [o for o in given if not o.lstrip("+").startswith(("ckpt_path=", "paths.output_dir="))]
    return (
        f"{message}; from Python: posformer.train({kept!r}, run_dir={str(run_dir)!r}, "
        f"ckpt_path={str(ckpts[-1])!r})"
    )


# ------------------------------------------------------------------------------------ evaluate
@dataclass
class EvalResult:
    """What :func:`evaluate` returns: one row per checkpoint × mode × length (``extrapolation.json``).

    ``metric("ppl")`` -> ``{label: {length: value}}`` (language models: the ``nonoverlap`` windows by
    default); ``scored_tokens`` of each row says how many tokens it averages.
    """

    output_dir: Path
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = field(repr=False)

    @property
    def files(self) -> dict[str, Path]:
        return {n.rsplit(".", 1)[1]: self.output_dir / n for n in (RESULTS_JSON, RESULTS_CSV, RESULTS_MD)}

    @property
    def labels(self) -> list[str]:
        return list(dict.fromkeys(str(r.get("label")) for r in self.rows))

    def aggregate(self, mode: str | None = None) -> pd.DataFrame:
        """Mean ± std over seeds, like the command line's sweep table: one row per group (a label without
        its seed, ``prope · seed 1`` -> ``prope``; a rotary scaling stays in it) and length, in first-seen
        order, with ``<metric>_mean``, ``<metric>_std`` (NaN for one seed) and ``<metric>_n`` of every
        metric of :data:`posformer.metrics.REGISTRY` the rows hold, ``n_runs`` and ``seeds``
        (:func:`posformer.metrics.aggregate`). ``mode``: the LM window mode (default ``nonoverlap``)."""
        rows = [r for r in self.rows if r.get("status") == "ok"]
        rows = [r for r in rows if r.get("task_type") != "lm" or r.get("mode") == (mode or "nonoverlap")]
        if not rows:
            raise ConfigError(
                f"no ok rows in mode {mode or 'nonoverlap'!r} to aggregate; modes here: "
                f"{sorted({str(r.get('mode')) for r in self.rows})}."
            )
        split = [split_seed(str(r.get("series") or r["label"])) for r in rows]
        frame = pd.DataFrame(rows).assign(group=[g for g, _ in split], seed=[sd for _, sd in split])
        values = [m for m in metrics.names(lead="lm", kinds=("task", "lm")) if m in frame]
        named = {"variant": ("variant", metrics.first)} if "variant" in frame else {}
        agg = metrics.aggregate(
            frame.astype({"length": int}),
            ["group", "length"],
            values,
            sort_rest=True,
            pe=("pe", metrics.first),
            **named,
            in_distribution=("in_distribution", lambda v: bool(v.iloc[0])),
            n_runs=("length", "size"),
            seeds=("seed", lambda v: sorted(int(x) for x in v.dropna())),
        )
        return agg

    def table(self, metric: str = "ppl", mode: str | None = None) -> str:
        """:meth:`aggregate` as a Markdown table of ``metric``: a row per group, a column per length
        (``*`` = training length), cells ``mean ± std`` (one seed: the value)."""
        if metric not in metrics.REGISTRY:
            raise ConfigError(f"metric={metric!r} is unknown; valid: {', '.join(metrics.REGISTRY)}.")
        agg = self.aggregate(mode)
        table, columns = spread_table(metrics.records(agg), metric)
        return markdown_table(table, columns, align={"group": "l"}, missing="")

    def metric(self, name: str = "ppl", mode: str | None = None) -> dict[str, dict[int, float]]:
        """``{label: {length: value}}`` of metric ``name`` over the ``ok`` rows; ``mode``: an LM window
        mode (default ``nonoverlap``); task rows have their own mode and are always included."""
        out: dict[str, dict[int, float]] = {}
        for r in self.rows:
            lm = r.get("task_type") == "lm"
            if r.get("status") != "ok" or (lm and r.get("mode") != (mode or "nonoverlap")):
                continue
            if r.get(name) is not None:
                out.setdefault(str(r["label"]), {})[int(r["length"])] = float(r[name])
        return out


#: settings that name no model difference: where a run writes and logs, its name, and what the label says
_NOT_IN_LABELS = ("paths.", "logger.", "callbacks.", "trainer.default_root_dir", "task_name", "tags", "seed")
_NOT_IN_LABELS += ("ckpt_path", "init_from", "variant", "model.pe")


def _leaves(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping) and node:
        for k, v in node.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    else:
        yield key, node


def run_dir_labels(run_dirs: Sequence[Path]) -> list[str] | None:
    """The labels of plain training run dirs (each with a ``config.yaml``; a sweep dir or a missing file:
    ``None``, posformer-eval's own labels): the run's label (its variant's name, else its PE:
    :func:`posformer.configs.variants.run_label`), the settings that differ between the runs, and the
    seed: ``prope · seed 0``, ``rope · base 500.0 · seed 1``; :meth:`EvalResult.aggregate` groups the
    seeds. A label two runs share gets `` [<run dir name>]``."""
    configs = []
    for run_dir in run_dirs:
        path = run_dir / "config.yaml"
        if not path.is_file() or (run_dir / "multirun.yaml").is_file():
            return None
        configs.append(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    flat = [dict(_leaves(c)) for c in configs]

    def counts(key: str, cfg: Mapping[str, Any]) -> bool:
        if key.startswith(_NOT_IN_LABELS) and not key.startswith("model.pe_options"):
            return False
        return not (variant_name(cfg.get("variant")) and key.startswith(("model.pe_options", "model.layer")))

    keys = dict.fromkeys(k for f in flat for k in f)
    varying = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    seeds = [c.get("seed") for c in configs]  # a key that follows the seed (data.seed: ${seed}) is the seed
    varying = [k for k in varying if [f.get(k) for f in flat] != seeds]
    labels = []
    for cfg, f in zip(configs, flat):
        overrides = [f"{k}={f.get(k)}" for k in varying if counts(k, cfg)] + [f"seed={cfg.get('seed')}"]
        parts = [f"{k} {v}" for k, v in job_items(overrides, None)]
        labels.append(SEP.join([run_label(cfg.get("model") or {}, cfg.get("variant")), *parts]))
    return [
        f"{label} [{d.name}]" if labels.count(label) > 1 else label
        for label, d in zip(labels, run_dirs, strict=True)
    ]


def evaluate(
    target: str | Path | Sequence[str | Path],
    *,
    lengths: Sequence[int] | None = None,
    output_dir: str | Path | None = None,
    which: str = "best",
    overrides: Sequence[str] | None = None,
    **options: Any,
) -> EvalResult:
    """Length extrapolation of a run dir, a sweep dir or checkpoints, as ``posformer-eval`` does.

    ``target``: a training run or multirun dir (one checkpoint per run: ``which`` = best | last) or a
    ``.ckpt`` path, or a list of them. ``lengths``: evaluation lengths (default: 1, 2, 4, 8, 16 × the
    training length). ``options``: other ``eval.*`` settings (``n_tokens=16384``, ``modes=["nonoverlap"]``,
    ``rope_scaling={...}``). ``overrides``: raw overrides (``trainer=cpu``). Results go to
    ``output_dir`` (default ``<paths.log_dir>/eval/runs/<time>``).
    """
    from posformer.eval.run import dispatch

    if isinstance(target, str | Path):
        targets = [target]
    elif isinstance(target, list | tuple) and target and all(isinstance(t, str | Path) for t in target):
        targets = list(target)
    else:
        raise ConfigError(
            f"evaluate({target!r}): target must be a run dir, sweep dir or .ckpt path (str or pathlib.Path) "
            "or a non-empty list of them."
        )
    if lengths is not None and (
        not isinstance(lengths, list | tuple)
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)
    ):
        raise ConfigError(
            f"lengths={lengths!r} must be a list of positive integers, e.g. lengths=[64, 128, 256]."
        )
    if overrides is not None:
        as_overrides(overrides)  # the same check as train's
    ckpts = [str(t) for t in targets if Path(t).is_file()]
    dirs = [str(t) for t in targets if not Path(t).is_file()]
    for d in dirs:
        if not Path(d).is_dir():
            raise CheckpointError(
                f"evaluate({d!r}): no such checkpoint file or run directory; pass a .ckpt or a run dir."
            )
    settings: dict[str, Any] = {"checkpoints": ckpts, "which": which, **options}
    if "labels" not in options and not ckpts:
        labels = run_dir_labels([Path(d) for d in dirs])
        if labels:
            settings["labels"] = labels
    if dirs:
        settings["sweep_dir"] = dirs[0] if len(dirs) == 1 else dirs
    if lengths is not None:
        settings["lengths"] = list(lengths)
    given = [*(overrides or []), *as_overrides(None, eval=settings)]
    cfg = compose("eval", given)
    out = _path("output_dir", output_dir) or _new_run_dir(cfg, "eval").absolute()
    _free_dir("output_dir", out)
    cfg.eval.output_dir = cfg.paths.output_dir = str(out)
    with _unless_refused(out, RESULTS_JSON):
        out.mkdir(parents=True, exist_ok=True)
        results = dispatch(cfg)
    return EvalResult(Path(cfg.eval.output_dir), list(results.rows), dict(results.meta))
