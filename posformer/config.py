"""Validation of the composed Hydra config and its conversion into plain objects.

Types, value sets, ranges and the keys of the typed sections are the schema's
(:mod:`posformer.configs.schema`): Hydra applies its types and keys at composition, and
:func:`validate_config` runs :func:`~posformer.configs.schema.check` for its rules (and for the types
of a plain dict). What is written here by hand: the keys of the open sections (``trainer``:
``lightning.Trainer``'s parameters; ``data``: the dataset's defaults; ``model``: the fields of
:class:`~posformer.model.ModelConfig`, which checks its own values), and the checks that combine
fields or need the device, torch or the PE. :func:`validate_config` raises one
:class:`~posformer.errors.ConfigError` listing every problem, each naming the key, the value, the
limit and the fix, before anything is built. :func:`check_data_fit` runs after the datamodule exists
(it needs real sequence lengths) and before the model is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import traceback
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from posformer.configs import schema
from posformer.configs.schema import PRECISIONS, SEED_LIMIT
from posformer.data.options import data_problems
from posformer.devices import cuda_problem
from posformer.errors import ConfigError, PosformerError
from posformer.model import ModelConfig
from posformer.model.backends.flex import head_dim_fits as flex_head_dim_fits
from posformer.model.backends.flex import small_heads_problem as flex_small_heads_problem
from posformer.pe import build_encoding, get_encoding_class
from posformer.pe.base import PositionalEncoding
from posformer.rules import is_int, raise_problems, unknown_key_message
from posformer.utils.memory import window_cost_words

if TYPE_CHECKING:
    import torch

__all__ = [
    "DATA_DEFAULTS",
    "OPTIM_KEYS",
    "PRECISIONS",
    "SCHEDULE_KEYS",
    "SEED_LIMIT",
    "batch_width",
    "check_data_fit",
    "longest_training_sequence",
    "model_fields",
    "section_keys",
    "to_container",
    "unknown_key_message",
    "validate_config",
]

#: ModelConfig fields filled in from the data, not from configs/model
DATA_MODEL_FIELDS = ("vocab_size", "src_vocab_size", "pad_id")
#: the keys posformer.lit.optim reads from ``optim`` and ``schedule`` (the schema's fields)
OPTIM_KEYS = tuple(f.name for f in dataclasses.fields(schema.OptimConfig))
SCHEDULE_KEYS = tuple(f.name for f in dataclasses.fields(schema.ScheduleConfig))
#: where each built-in dataset declares its keys (``data.name`` -> module, dict of defaults)
DATA_DEFAULTS = {
    "synthetic": ("posformer.data.synthetic", "DEFAULTS"),
    "text": ("posformer.data.text", "TEXT_DEFAULTS"),
    "hub": ("posformer.data.hub", "HUB_DEFAULTS"),
    "corpus": ("posformer.data.corpus", "CORPUS_DEFAULTS"),
    "translation": ("posformer.data.translation", "DEFAULTS"),
}


def to_container(cfg: Any) -> Any:
    """A DictConfig/ListConfig -> plain (resolved) dicts and lists; anything else unchanged."""
    if isinstance(cfg, DictConfig) or OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def model_fields(model_cfg: Mapping[str, Any], **data_facts: Any) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from ``cfg.model`` plus facts from the data (vocab, pad)."""
    fields = dict(to_container(model_cfg) or {})
    known = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            f"model has unknown key(s) {unknown}: "
            + "; ".join(unknown_key_message("model", k, known) for k in unknown)
        )
    fields["pe_options"] = dict(fields.get("pe_options") or {})
    fields.update({k: v for k, v in data_facts.items() if v is not None})
    return fields


def section_keys(section: str, c: Mapping[str, Any]) -> set[str] | None:
    """The keys posformer (or, for ``trainer``, ``lightning.Trainer``) reads from ``section``; ``None``:
    unknown (a dataset registered by a plugin)."""
    declared = schema.declared_keys(section)
    if declared is not None:  # a typed section (optim, schedule, optim.no_decay, ...)
        return set(declared)
    if section == "trainer":
        import inspect

        import lightning

        return set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    if section == "model":
        return set(ModelConfig.__dataclass_fields__)
    if section != "data":
        return None
    where = DATA_DEFAULTS.get(str((c.get("data") or {}).get("name", "synthetic")))
    if where is None:
        return None
    try:
        defaults = getattr(importlib.import_module(where[0]), where[1])
    except (ImportError, AttributeError):  # a moved module: the datamodule still checks its keys
        return None
    return {*defaults, "name"}


class _Problems:
    """The lines of one validation; :meth:`raise_if_any` raises them as one :class:`ConfigError`."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, msg: str) -> None:
        self.items.append(msg)

    def raise_if_any(self) -> None:
        raise_problems(self.items)


def validate_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Check the composed training config (or a plain dict); raise one ConfigError listing every problem."""
    try:
        c = to_container(cfg)
    except Exception as exc:  # interpolation errors, missing values
        raise ConfigError(f"the configuration cannot be resolved: {exc}") from None
    p = _Problems()
    p.items.extend(schema.check(c))  # types, value sets, ranges, the keys of the typed sections
    _check_open_keys(c, p)
    _check_run(c, p)
    _check_trainer(c.get("trainer") or {}, p)
    _check_attention_backend(c.get("model") or {}, c.get("trainer") or {}, p)
    _check_optim(c.get("optim") or {}, c.get("schedule") or {}, p)
    pe, model_problem = _build_model_pe(c.get("model") or {})
    _check_flex_bias(c, pe, p)
    _check_positions(c, pe, p)
    if model_problem:
        p.add(model_problem)
    _check_data(c.get("data") or {}, c, p)
    p.items.extend(data_problems(c.get("data") or {}, reported=p.items))
    _check_finite(c, p)
    p.raise_if_any()


# ------------------------------------------------------------------------------------------ by hand
def _check_open_keys(c: Mapping[str, Any], p: _Problems) -> None:
    """Keys of ``trainer`` and ``data`` that no code reads (``model``: :func:`model_fields`)."""
    for section in ("trainer", "data"):
        given = c.get(section)
        valid = section_keys(section, c) if isinstance(given, Mapping) else None
        for key in sorted(set(given or {}) - (valid or set(given or {}))):
            p.add(unknown_key_message(section, key, valid, drop=f"+{section}.{key}=..."))


def _non_finite(node: Any, key: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted key, value)`` of every NaN/inf float under ``node`` (lists: ``key[i]``)."""
    if isinstance(node, float) and not math.isfinite(node):
        yield key, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _non_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _non_finite(v, f"{key}[{i}]")


def _check_finite(c: Mapping[str, Any], p: _Problems) -> None:
    """NaN or inf in any value (the open sections too: ``model.pe_options.base=nan``), unless a rule
    already reported that key: every value a run uses is a finite number or not a number at all."""
    for key, value in _non_finite({k: v for k, v in c.items() if k != "hydra"}):
        if not any(item.startswith(f"{key}=") for item in p.items):
            p.add(
                f"{key}={value} is not a finite number (limit: every numeric setting is finite; NaN or inf "
                f"would poison training or slip past its checks); give {key} a number, e.g. its default."
            )


def _check_run(c: Mapping[str, Any], p: _Problems) -> None:
    """``train=false`` needs a checkpoint, ``init_from`` a new training run; an enabled ``compile.backend``
    must be one torch knows."""
    if not c.get("train", True) and not c.get("ckpt_path") and c.get("evaluate", True):
        p.add(
            "train=false evaluates a trained model, but ckpt_path is null; "
            "pass ckpt_path=/path/to/model.ckpt."
        )
    if c.get("init_from") and (c.get("ckpt_path") or not c.get("train", True)):
        p.add(
            f"init_from={c['init_from']} starts a new training run from a checkpoint's weights, but "
            + ("ckpt_path resumes another run" if c.get("ckpt_path") else "train=false trains nothing")
            + "; keep one: init_from=<ckpt> (fine-tune from step 0) or ckpt_path=<ckpt> (resume)."
        )
    comp = c.get("compile") or {}
    backend = comp.get("backend", "inductor")
    if comp.get("enabled") is True and isinstance(backend, str):
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            p.add(f"compile.backend={backend!r} is not a torch.compile backend; use one of {sorted(known)}.")


def _check_trainer(t: Mapping[str, Any], p: _Problems) -> None:
    """The device exists (``trainer=gpu`` on a machine without CUDA); the run stops somewhere."""
    accelerator, strategy = str(t.get("accelerator", "cpu")), str(t.get("strategy", "auto"))
    problem = cuda_problem(accelerator)
    if problem:
        p.add(problem)
    elif strategy.startswith("fsdp") and (accelerator == "cpu" or accelerator == "auto" and not _has_cuda()):
        p.add(
            f"trainer.strategy={strategy} needs CUDA GPUs (FSDP has no CPU backend), but trainer.accelerator="
            f"{accelerator} runs on the CPU; use trainer=ddp for several CPU processes."
        )
    max_epochs = t.get("max_epochs", -1)
    no_epochs = not is_int(max_epochs) or max_epochs < 1
    if t.get("max_steps", -1) == -1 and no_epochs and not t.get("fast_dev_run"):
        p.add(
            "trainer.max_steps=-1 and trainer.max_epochs<=0: training would never stop; "
            "set trainer.max_steps."
        )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_attention_backend(m: Mapping[str, Any], t: Mapping[str, Any], p: _Problems) -> None:
    """Training with FlexAttention forced needs CUDA (FlexAttention has no CPU backward), and there heads
    of at least 16 dimensions (inductor's GPU kernel)."""
    accel = str(t.get("accelerator", "cpu"))
    if m.get("attention_backend", "auto") != "flex":
        return
    if accel in ("gpu", "cuda") or accel == "auto" and _has_cuda():
        d_model, n_heads = m.get("d_model"), m.get("n_heads")
        whole = is_int(d_model) and is_int(n_heads) and n_heads > 0 and d_model % n_heads == 0
        if whole and not flex_head_dim_fits(d_model // n_heads, "cuda"):  # (else: the model's own line)
            p.add(flex_small_heads_problem(d_model // n_heads))
        return
    p.add(
        f"model.attention_backend=flex trains only on CUDA (FlexAttention has no CPU backward), but "
        f"trainer.accelerator={accel}; use model.attention_backend=auto (SDPA on the CPU) or trainer=gpu."
    )


def _check_flex_bias(c: Mapping[str, Any], pe: PositionalEncoding | None, p: _Problems) -> None:
    """Forced FlexAttention cannot train the parameters of an elementwise bias whose form does not state
    ``trainable`` (its ``score_mod`` would not read them as captured tensors, each indexed once): refused
    here, before any work, instead of at the first training forward."""
    m = c.get("model") or {}
    if m.get("attention_backend", "auto") != "flex" or not c.get("train", True) or pe is None:
        return
    form = pe.caps.bias
    untrainable = form is not None and form.score_mod and not form.trainable
    if untrainable and any(t.requires_grad for t in pe.parameters()):
        p.add(
            f"model.attention_backend=flex cannot train the parameters of pe={pe.name}'s bias (its bias form "
            "does not state trainable=True: docs/adding_a_pe.md); use model.attention_backend=auto "
            "(SDPA with the materialised bias for those calls) or freeze the PE."
        )


def _check_optim(o: Mapping[str, Any], s: Mapping[str, Any], p: _Problems) -> None:
    """``optim.lr`` may be null only for ``inverse_sqrt`` (its formula is the learning rate), which also
    needs a warm-up of at least one step."""
    if "lr" in o and o["lr"] is None and s.get("name") != "inverse_sqrt":
        p.add("optim.lr=None must be a positive number (e.g. optim.lr=1e-3).")
    warmup = s.get("warmup_steps", 0)
    if s.get("name") == "inverse_sqrt" and is_int(warmup) and warmup < 1:
        p.add("schedule.name=inverse_sqrt needs schedule.warmup_steps >= 1 (the paper uses 4000).")
    # a warm-up longer than the run is clamped (posformer.lit.optim.fit_to_run), not an error


def _check_positions(c: Mapping[str, Any], pe: PositionalEncoding | None, p: _Problems) -> None:
    """Randomized positions need ``positions.n_max``, and a PE with a table must cover it."""
    pos = c.get("positions") or {}
    if pos.get("randomized", False) is not True:
        return
    n_max = pos.get("n_max")
    if n_max is None:
        p.add(
            "positions.randomized=true draws positions from [0, positions.n_max), but positions.n_max is "
            "null; set it well above the longest evaluation sequence (e.g. positions.n_max=512)."
        )
    limit = pe.max_positions if pe is not None else None
    if is_int(n_max) and limit is not None and limit < n_max:
        p.add(
            f"pe={pe.name} has model.pe_options.max_len={limit} positions, but randomized positions "
            f"are drawn from [0, positions.n_max={n_max}); set model.pe_options.max_len={n_max}."
        )


def _plugin_problem(pe: Any) -> str | None:
    """A plugin PE ``module:Class`` that cannot be imported: a file or relative path instead of a module
    name, or a module that raises (a syntax error, an exception) while it is imported. The one line
    names the module's file and line; ``None``: a registry name, or a plugin that imports."""
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


def _build_model_pe(m: Mapping[str, Any]) -> tuple[PositionalEncoding | None, str]:
    """The model section as a validated ``ModelConfig`` (its own checks: sizes, heads, PE name, ...) and
    its PE built with its options: ``(pe, "")``, or ``(None, the problem)``."""
    plugin = _plugin_problem(m.get("pe"))
    if plugin:
        return None, plugin
    try:
        fields = model_fields(m, vocab_size=max(int(m.get("vocab_size") or 0), 8))
        cfg = ModelConfig(**fields)
    except (PosformerError, TypeError) as exc:
        return None, str(exc)
    try:
        causal = cfg.kind == "decoder" or not cfg.pe_applies("encoder")
        pe = build_encoding(
            cfg.pe,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            causal=causal,
            n_layers=max(cfg.n_layers, cfg.n_encoder_layers, cfg.n_decoder_layers),
            **cfg.pe_options,
        )
    except PosformerError as exc:
        return None, str(exc)
    return pe, ""


#: the longest data.eval_lengths the evaluation after training accepts (posformer-eval's eval.max_length)
MAX_EVAL_LENGTH = 1_048_576


def _check_data(d: Mapping[str, Any], c: Mapping[str, Any], p: _Problems) -> None:
    """What the datamodule would refuse later, said now: the data seed, the evaluation lengths, packing
    (the value rules of ``data.*`` keys are the schema's ``OPEN_RULES``)."""
    if not d:
        p.add("data is empty; pick a dataset with data=synthetic (or another configs/data option).")
        return
    data_seed = d.get("seed")
    if data_seed is not None and data_seed != c.get("seed") and not schema.SEED_RULE.holds(data_seed):
        p.add(f"data.seed={data_seed!r} must be a non-negative integer below 2**32 = {SEED_LIMIT} or null.")
    lengths = d.get("eval_lengths")
    if lengths is not None and d.get("eval_len") is None:
        bad = [v for v in lengths if is_int(v) and v < 1] if isinstance(lengths, list) else []
        if not isinstance(lengths, list) or not all(is_int(v) for v in lengths):
            p.add(f"data.eval_lengths={lengths!r} must be a list of integers, e.g. [16, 32, 64].")
        elif bad:
            p.add(f"data.eval_lengths={lengths} contains non-positive lengths {bad}; lengths must be >= 1.")
        elif any(b <= a for a, b in zip(lengths, lengths[1:])):
            p.add(f"data.eval_lengths={lengths} must be strictly increasing, e.g. {sorted(set(lengths))}.")
        elif lengths and lengths[-1] > MAX_EVAL_LENGTH:
            p.add(
                f"data.eval_lengths asks for length {lengths[-1]}, above {MAX_EVAL_LENGTH} (the limit of the "
                f"evaluation after training): {window_cost_words(lengths[-1], [c.get('model') or {}])}; "
                f"evaluate shorter lengths, or that length afterwards with posformer-eval "
                f"eval.lengths=[{lengths[-1]}] eval.max_length={lengths[-1]}."
            )
    if d.get("pack", False) is not True:
        return
    kind = (c.get("model") or {}).get("kind", "decoder")
    if kind != "decoder":
        p.add(
            f"data.pack=true packs decoder-only rows, but model.kind={kind!r}; set data.pack=false or use a "
            "decoder model (model=decoder_small)."
        )
    if (c.get("positions") or {}).get("randomized", False) is True:
        p.add(
            "data.pack=true restarts the positions at every document, which positions.randomized=true "
            "would replace; set positions.randomized=false or data.pack=false."
        )


# ----------------------------------------------------------------------------------- after the data
def batch_width(batch: Mapping[str, Any]) -> int:
    """Longest position count a batch needs (decoder input, or max of source and target)."""
    widths = [batch[k].shape[1] for k in ("input_ids", "src_ids", "tgt_ids") if k in batch]
    return max(widths) if widths else 0


def longest_training_sequence(dm: Any) -> int | None:
    """Token length of the longest training sequence, or ``None`` if it cannot be determined cheaply."""
    try:
        ds = dm.train_dataset()
        if hasattr(ds, "column_names") and "n" in ds.column_names:  # synthetic: longest instance
            import numpy as np

            n = np.asarray(ds["n"])
            return batch_width(dm.collate([ds[int(n.argmax())]]))
        loader = dm.train_dataloader()
        return batch_width(next(iter(loader)))
    except Exception:  # noqa: BLE001 - a probe; the PE still raises a clear error at the first bad batch
        return None


def check_data_fit(
    cfg: Mapping[str, Any],
    dm: Any,
    limit: tuple[int, PositionalEncoding] | None,
    dtype: torch.dtype | None = None,
) -> None:
    """Checks that need the data: the PE's positions (``limit``: the fewest any PE of the model
    represents, computing in ``dtype``, and that PE) and randomized positions cover the training
    sequences."""
    c = to_container(cfg)
    longest = longest_training_sequence(dm)
    if longest is None:
        return
    pos = c.get("positions") or {}
    p = _Problems()
    if pos.get("randomized") and int(pos.get("n_max") or 0) < longest:
        p.add(
            f"positions.n_max={pos.get('n_max')} is smaller than the longest training sequence ({longest} "
            f"tokens); randomized positions need positions.n_max >= {longest} "
            "(Ruoss et al. use several times "
            "the longest evaluation length)."
        )
    need = int(pos.get("n_max")) if pos.get("randomized") else longest
    what = "positions.n_max" if pos.get("randomized") else "the longest training sequence"
    n, pe = limit or (None, None)
    if n is not None and pe is not None and n < need:
        if n == pe.max_positions:  # a table
            where, fix = "", f"set model.pe_options.max_len={need} or use a PE without a length limit"
        else:  # the range of the run's dtype
            where, fix = f" in {str(dtype).removeprefix('torch.')}", pe.range_fix(dtype)
        p.add(f"pe={pe.name!r} represents {n} positions{where}, but training needs {need} ({what}); {fix}.")
    p.raise_if_any()
