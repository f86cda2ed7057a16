"""Validation of the composed Hydra config and its conversion into plain objects.

:func:`validate_config` checks types, ranges and combinations of the *composed* config before
anything is built and raises one :class:`~posformer.errors.ConfigError` listing every problem, each
naming the key, the value, the limit and the fix. :func:`check_data_fit` runs after the datamodule
exists (it needs real sequence lengths) and before the model is built.
"""

from __future__ import annotations

import difflib
import importlib
import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posformer.cpu import flush_denormal_problem
from posformer.devices import AUTO, cuda_problem
from posformer.errors import ConfigError, PosformerError
from posformer.lit.optim import OPTIMIZERS, SCHEDULES, is_warmup_fraction
from posformer.model import ModelConfig
from posformer.pe.base import PositionalEncoding

#: Lightning's ``trainer.precision`` values; ``auto`` (:func:`posformer.devices.resolve_device`) too
PRECISIONS = (
    "32-true",
    "32",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "64",
    "transformer-engine",
    "transformer-engine-float16",
)
HALF_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")
#: ModelConfig fields filled in from the data, not from configs/model
DATA_MODEL_FIELDS = ("vocab_size", "src_vocab_size", "pad_id")
#: the keys posformer.lit.optim reads from ``optim`` and ``schedule``
OPTIM_KEYS = ("name", "lr", "betas", "eps", "weight_decay", "no_decay")
SCHEDULE_KEYS = ("name", "warmup_steps", "multiplier", "min_lr_ratio", "total_steps")
#: where each built-in dataset declares its keys (``data.name`` -> module, dict of defaults)
DATA_DEFAULTS = {
    "synthetic": ("posformer.data.synthetic", "DEFAULTS"),
    "text": ("posformer.data.text", "TEXT_DEFAULTS"),
    "hub": ("posformer.data.hub", "HUB_DEFAULTS"),
    "translation": ("posformer.data.translation", "DEFAULTS"),
}
#: numpy's RNG (seeded by Lightning's seed_everything and the data) takes seeds in [0, 2**32)
SEED_LIMIT = 2**32


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


def unknown_key_message(section: str, key: str, valid: Any) -> str:
    """``<section>.<key> is not a setting ...`` with the closest valid key (difflib) as the fix."""
    valid = sorted(map(str, valid))
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    fix = f"did you mean {section}.{close[0]}?" if close else f"valid keys: {', '.join(valid)}."
    return f"{section}.{key} is not a {section} setting (no code reads it); {fix}"


def section_keys(section: str, c: Mapping[str, Any]) -> set[str] | None:
    """The keys posformer (or, for ``trainer``, ``lightning.Trainer``) reads from ``section``; ``None``:
    unknown (a dataset registered by a plugin)."""
    if section == "trainer":
        import inspect

        import lightning

        return set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    if section == "optim":
        return set(OPTIM_KEYS)
    if section == "schedule":
        return set(SCHEDULE_KEYS)
    if section == "model":
        return set(ModelConfig.__dataclass_fields__)
    where = DATA_DEFAULTS.get(str((c.get("data") or {}).get("name", "synthetic")))
    if where is None:
        return None
    try:
        defaults = getattr(importlib.import_module(where[0]), where[1])
    except (ImportError, AttributeError):  # a moved module: the datamodule still checks its keys
        return None
    return {*defaults, "name"}


def _check_unknown_keys(c: Mapping[str, Any], p: _Problems) -> None:
    for section in ("trainer", "optim", "schedule", "data"):  # model: model_fields reports its own
        given = c.get(section)
        valid = section_keys(section, c) if isinstance(given, Mapping) else None
        for key in sorted(set(given or {}) - (valid or set(given or {}))):
            p.add(unknown_key_message(section, key, valid) + f" (or drop +{section}.{key}=...).")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, msg: str) -> None:
        self.items.append(msg)

    def int_at_least(self, key: str, value: Any, minimum: int, fix: str = "") -> None:
        if not _is_int(value) or value < minimum:
            self.add(f"{key}={value!r} must be an integer >= {minimum}" + (f"; {fix}" if fix else "."))

    def num_in(
        self,
        key: str,
        value: Any,
        lo: float,
        hi: float,
        *,
        lo_open: bool = False,
        hi_open: bool = True,
        fix: str = "",
    ) -> None:
        ok = _is_num(value) and math.isfinite(value)
        if ok:
            ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:
            rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            self.add(f"{key}={value!r} must be a number in {rng}" + (f"; {fix}" if fix else "."))

    def raise_if_any(self) -> None:
        if len(self.items) == 1:
            raise ConfigError(self.items[0])
        if self.items:
            raise ConfigError(
                f"{len(self.items)} configuration problems:\n" + "\n".join(f"  - {m}" for m in self.items)
            )


def validate_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Check the composed training config; raise one ConfigError listing every problem."""
    try:
        c = to_container(cfg)
    except Exception as exc:  # interpolation errors, missing values
        raise ConfigError(f"the configuration cannot be resolved: {exc}") from None
    p = _Problems()
    _check_top(c, p)
    _check_unknown_keys(c, p)
    _check_trainer(c.get("trainer") or {}, p)
    _check_attention_backend(c.get("model") or {}, c.get("trainer") or {}, p)
    _check_optim(c.get("optim") or {}, c.get("schedule") or {}, c.get("trainer") or {}, p)
    pe, model_problem = _build_model_pe(c.get("model") or {})
    _check_flex_bias(c, pe, p)
    _check_positions(c, pe, p)
    if model_problem:
        p.add(model_problem)
    _check_data(c.get("data") or {}, c, p)
    p.raise_if_any()


def _check_compile(c: Mapping[str, Any], p: _Problems) -> None:
    for key in ("enabled", "fullgraph"):
        if not isinstance(c.get(key, False), bool):
            p.add(f"compile.{key}={c.get(key)!r} must be true or false.")
    if c.get("dynamic") is not None and not isinstance(c.get("dynamic"), bool):
        p.add(f"compile.dynamic={c.get('dynamic')!r} must be true, false or null.")
    modes = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    if c.get("mode") not in modes:
        p.add(f"compile.mode={c.get('mode')!r} is not one of {list(modes)}.")
    backend = c.get("backend", "inductor")
    if c.get("enabled") and backend is not None:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            p.add(f"compile.backend={backend!r} is not a torch.compile backend; use one of {sorted(known)}.")


def _check_top(c: dict[str, Any], p: _Problems) -> None:
    seed = c.get("seed")
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        p.add(
            f"seed={seed!r} must be a non-negative integer below 2**32 = {SEED_LIMIT} (the range numpy's RNG "
            "accepts); e.g. seed=0."
        )
    data_seed = (c.get("data") or {}).get("seed")
    bad_data_seed = not _is_int(data_seed) or not 0 <= data_seed < SEED_LIMIT
    if data_seed is not None and data_seed != seed and bad_data_seed:
        p.add(f"data.seed={data_seed!r} must be a non-negative integer below 2**32 = {SEED_LIMIT} or null.")
    for key in ("train", "evaluate"):
        if not isinstance(c.get(key, True), bool):
            p.add(f"{key}={c.get(key)!r} must be true or false.")
    threads = c.get("torch_threads")
    if threads is not None and (not _is_int(threads) or threads < 1):
        p.add(f"torch_threads={threads!r} must be a positive integer or null (torch's default).")
    denormal_problem = flush_denormal_problem(c.get("flush_denormal", True))
    if denormal_problem:
        p.add(denormal_problem)
    _check_compile(c.get("compile") or {}, p)
    if c.get("eval_ckpt", "best") not in ("best", "last"):
        p.add(f"eval_ckpt={c.get('eval_ckpt')!r} must be 'best' or 'last'.")
    ls = (c.get("loss") or {}).get("label_smoothing", 0.0)
    p.num_in("loss.label_smoothing", ls, 0.0, 1.0, fix="0.1 is the paper's value, 0 disables it.")
    if not c.get("train", True) and not c.get("ckpt_path") and c.get("evaluate", True):
        p.add(
            "train=false evaluates a trained model, but ckpt_path is null; "
            "pass ckpt_path=/path/to/model.ckpt."
        )


def _check_trainer(t: dict[str, Any], p: _Problems) -> None:
    prec = str(t.get("precision", "32-true"))
    if prec not in PRECISIONS and prec != AUTO:
        p.add(
            f"trainer.precision={t.get('precision')!r} is unknown; "
            f"valid: {AUTO}, {', '.join(PRECISIONS[:6])} "
            "(auto: bf16-mixed/16-mixed on CUDA, 32-true on the CPU; 32-true is full precision)."
        )
    accel = str(t.get("accelerator", "cpu"))
    problem = cuda_problem(accel)  # trainer=gpu on a machine without CUDA
    if problem:
        p.add(problem)
    max_steps = t.get("max_steps", -1)
    max_epochs = t.get("max_epochs", -1)
    if not _is_int(max_steps) or (max_steps < 1 and max_steps != -1):
        p.add(
            f"trainer.max_steps={max_steps!r} must be a positive integer (or -1 with trainer.max_epochs > 0)."
        )
    elif max_steps == -1 and (not _is_int(max_epochs) or max_epochs < 1) and not t.get("fast_dev_run"):
        p.add(
            "trainer.max_steps=-1 and trainer.max_epochs<=0: training would never stop; "
            "set trainer.max_steps."
        )
    vci = t.get("val_check_interval")
    if vci is not None and (not _is_num(vci) or vci <= 0):
        p.add(
            f"trainer.val_check_interval={vci!r} must be a positive number of steps (int) "
            "or an epoch fraction."
        )
    clip = t.get("gradient_clip_val")
    if clip is not None and (not _is_num(clip) or clip < 0):
        p.add(f"trainer.gradient_clip_val={clip!r} must be >= 0 (0 or null disables clipping).")
    p.int_at_least("trainer.accumulate_grad_batches", t.get("accumulate_grad_batches", 1), 1)
    p.int_at_least("trainer.log_every_n_steps", t.get("log_every_n_steps", 50), 1)
    p.int_at_least("trainer.num_nodes", t.get("num_nodes", 1), 1)
    devices = t.get("devices", 1)
    if (
        devices != "auto"
        and not (_is_int(devices) and (devices >= 1 or devices == -1))
        and not isinstance(devices, list)
    ):
        p.add(f"trainer.devices={devices!r} must be a positive integer, -1, 'auto' or a list of device ids.")
    if accel == "cpu" and prec in ("16-mixed",):
        pass  # Lightning runs fp16 AMP on CPU as bf16-mixed (it warns); allowed.


def _check_attention_backend(m: dict[str, Any], t: dict[str, Any], p: _Problems) -> None:
    """Training with FlexAttention forced needs CUDA: FlexAttention has no CPU backward."""
    accel = str(t.get("accelerator", "cpu"))
    if m.get("attention_backend", "auto") != "flex" or accel in ("gpu", "cuda"):
        return
    import torch

    if accel == "auto" and torch.cuda.is_available():
        return
    p.add(
        f"model.attention_backend=flex trains only on CUDA (FlexAttention has no CPU backward), but "
        f"trainer.accelerator={accel}; use model.attention_backend=auto (SDPA on the CPU) or trainer=gpu."
    )


def _check_flex_bias(c: dict[str, Any], pe: PositionalEncoding | None, p: _Problems) -> None:
    """Forced FlexAttention cannot train a bias's parameters (T5, KERPLE, FIRE, ...): refused here, before
    any work, instead of at the first training forward."""
    m = c.get("model") or {}
    if m.get("attention_backend", "auto") != "flex" or not c.get("train", True) or pe is None:
        return
    if "bias" in pe.caps.hooks and any(t.requires_grad for t in pe.parameters()):
        p.add(
            f"model.attention_backend=flex cannot train the parameters of pe={pe.name}'s bias (FlexAttention"
            "'s gradients for learned score_mod tensors failed on CUDA, docs/performance.md); use "
            "model.attention_backend=auto (SDPA with the materialised bias for those calls)."
        )


def _check_optim(o: dict[str, Any], s: dict[str, Any], t: dict[str, Any], p: _Problems) -> None:
    if str(o.get("name", "adamw")).lower() not in OPTIMIZERS:
        p.add(f"optim.name={o.get('name')!r} is unknown; valid: {', '.join(OPTIMIZERS)}.")
    lr = o.get("lr")
    if s.get("name") != "inverse_sqrt" and (not _is_num(lr) or not lr > 0 or not math.isfinite(lr)):
        p.add(f"optim.lr={lr!r} must be a positive number (e.g. optim.lr=1e-3).")
    betas = o.get("betas", [0.9, 0.999])
    if (
        not isinstance(betas, list | tuple)
        or len(betas) != 2
        or not all(_is_num(b) and 0 <= b < 1 for b in betas)
    ):
        p.add(f"optim.betas={betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.98].")
    p.num_in("optim.eps", o.get("eps", 1e-8), 0.0, 1.0, lo_open=True)
    p.num_in("optim.weight_decay", o.get("weight_decay", 0.0), 0.0, 10.0, fix="0 disables weight decay.")
    name = s.get("name", "constant")
    if name not in SCHEDULES:
        p.add(f"schedule.name={name!r} is unknown; valid: {', '.join(SCHEDULES)}.")
    warmup = s.get("warmup_steps", 0)
    if not is_warmup_fraction(warmup):
        p.int_at_least(
            "schedule.warmup_steps", warmup, 0, fix="or give a fraction of the run in (0, 1), e.g. 0.05."
        )
    if name == "inverse_sqrt":
        p.num_in("schedule.multiplier", s.get("multiplier", 1.0), 0.0, math.inf, lo_open=True)
        if _is_int(warmup) and warmup < 1:
            p.add("schedule.name=inverse_sqrt needs schedule.warmup_steps >= 1 (the paper uses 4000).")
    if name == "cosine":
        p.num_in("schedule.min_lr_ratio", s.get("min_lr_ratio", 0.0), 0.0, 1.0, hi_open=False)
        # a warm-up longer than the run is clamped (posformer.lit.optim.fit_to_run), not an error


def _check_positions(c: dict[str, Any], pe: PositionalEncoding | None, p: _Problems) -> None:
    pos = c.get("positions") or {}
    randomized = pos.get("randomized", False)
    if not isinstance(randomized, bool):
        p.add(f"positions.randomized={randomized!r} must be true or false.")
    n_max = pos.get("n_max")
    if randomized:
        p.int_at_least("positions.n_max", n_max, 1, fix="set it well above the longest evaluation sequence.")
    limit = pe.max_positions if pe is not None else None
    if randomized and _is_int(n_max) and limit is not None and limit < n_max:
        p.add(
            f"pe={pe.name} has model.pe_options.max_len={limit} positions, but randomized positions "
            f"are drawn from [0, positions.n_max={n_max}); set model.pe_options.max_len={n_max}."
        )


def _build_model_pe(m: dict[str, Any]) -> tuple[PositionalEncoding | None, str]:
    """The model section as a validated ``ModelConfig`` (its own checks: sizes, heads, PE name, ...) and
    its PE built with its options: ``(pe, "")``, or ``(None, the problem)``."""
    try:
        fields = model_fields(m, vocab_size=max(int(m.get("vocab_size") or 0), 8))
        cfg = ModelConfig(**fields)
    except (PosformerError, TypeError) as exc:
        return None, str(exc)
    from posformer.pe import build_encoding

    try:
        causal = cfg.kind == "decoder" or not cfg.pe_apply.get("encoder", True)
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


def _check_data(d: dict[str, Any], c: dict[str, Any], p: _Problems) -> None:
    if not d:
        p.add("data is empty; pick a dataset with data=synthetic (or another configs/data option).")
        return
    for key in ("batch_size", "eval_batch_size"):
        value = d.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            p.add(f"data.{key}={value!r} must be a positive integer.")
    lengths = d.get("eval_lengths")
    if lengths is not None and d.get("eval_len") is None:
        if not isinstance(lengths, list) or not all(_is_int(v) for v in lengths):
            p.add(f"data.eval_lengths={lengths!r} must be a list of integers, e.g. [16, 32, 64].")
        else:
            bad = [v for v in lengths if v < 1]
            if bad:
                p.add(
                    f"data.eval_lengths={lengths} contains non-positive lengths {bad}; lengths must be >= 1."
                )
            elif any(b <= a for a, b in zip(lengths, lengths[1:])):
                p.add(
                    f"data.eval_lengths={lengths} must be strictly increasing, e.g. {sorted(set(lengths))}."
                )
    for key in ("train_len", "eval_len"):
        value = d.get(key)
        vals = value if isinstance(value, list) else [value]
        if value is not None and any(_is_int(v) and v < 1 for v in vals):
            p.add(f"data.{key}={value!r}: lengths must be >= 1.")
    _check_pack(d, c, p)


def _check_pack(d: dict[str, Any], c: dict[str, Any], p: _Problems) -> None:
    """``data.pack`` (packed training rows): a bool, decoder-only, ordinary positions."""
    pack = d.get("pack", False)
    if not isinstance(pack, bool):
        p.add(f"data.pack={pack!r} must be true or false (true: packed training rows with segment ids).")
        return
    if not pack:
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


def check_data_fit(cfg: Mapping[str, Any], dm: Any, max_positions: int | None) -> None:
    """Checks that need the data: the PE table and randomized positions cover the training sequences."""
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
    if max_positions is not None and max_positions < need:
        p.add(
            f"pe={c['model'].get('pe')!r} represents {max_positions} positions, but training needs {need} "
            f"({'positions.n_max' if pos.get('randomized') else 'the longest training sequence'}); set "
            f"model.pe_options.max_len={need} or use a PE without a length limit."
        )
    p.raise_if_any()
