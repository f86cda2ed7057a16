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

from omegaconf import DictConfig, OmegaConf

from posformer.configs import register_resolvers
from posformer.configs.composition import composition_error
from posformer.configs.plugins import check_plugins
from posformer.errors import CheckpointError, ConfigError, Interrupted, PosformerError, RunInterrupted
from posformer.eval.results import RESULTS_CSV, RESULTS_JSON, RESULTS_MD
from posformer.interop import export_hf, hf_to_checkpoint, import_hf
from posformer.runs import Run, load_run

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
