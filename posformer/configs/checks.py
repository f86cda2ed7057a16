"""The training config's checks that combine sections or need the device, torch, the PE or the data.

Each ``*_problems`` function takes the typed settings (:class:`~posformer.configs.schema.TrainConfig`,
``model`` its ``ModelConfig`` fields) and returns one line per problem, naming the key, the value, the
limit and the fix; :func:`posformer.configs.settings.read_train` reports them together with the
schema's, before anything is built. :func:`model_pe` builds the model's PE the way the model does, so its
own checks (sizes, heads, options) speak. :func:`check_data_fit` runs after the datamodule exists (it
needs real sequence lengths) and before the model is built.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

from posformer.devices import cuda_problem
from posformer.errors import PosformerError
from posformer.model import ModelConfig
from posformer.model.backends.flex import head_dim_fits, small_heads_problem
from posformer.pe import build_encoding, get_encoding_class
from posformer.pe.base import PositionalEncoding
from posformer.rules import is_int, raise_problems
from posformer.utils.memory import window_cost_words

if TYPE_CHECKING:
    import torch

    from posformer.configs.schema import TrainConfig

#: the longest data.eval_lengths the evaluation after training accepts (posformer-eval's eval.max_length)
MAX_EVAL_LENGTH = 1_048_576


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_problems(s: TrainConfig) -> list[str]:
    """``train=false`` needs a checkpoint, ``init_from`` a new training run; an enabled ``compile.backend``
    must be one torch knows."""
    out = []
    if not s.train and not s.ckpt_path and s.evaluate:
        out.append(
            "train=false evaluates a trained model, but ckpt_path is null; "
            "pass ckpt_path=/path/to/model.ckpt."
        )
    if s.init_from and (s.ckpt_path or not s.train):
        out.append(
            f"init_from={s.init_from} starts a new training run from a checkpoint's weights, but "
            + ("ckpt_path resumes another run" if s.ckpt_path else "train=false trains nothing")
            + "; keep one: init_from=<ckpt> (fine-tune from step 0) or ckpt_path=<ckpt> (resume)."
        )
    if s.compile.enabled and s.compile.backend is not None:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if s.compile.backend not in known:
            out.append(
                f"compile.backend={s.compile.backend!r} is not a torch.compile backend; "
                f"use one of {sorted(known)}."
            )
    return out


def trainer_problems(s: TrainConfig) -> list[str]:
    """The device exists (``trainer=gpu`` on a machine without CUDA), FSDP has GPUs, the run stops;
    forced FlexAttention trains only on CUDA, with heads of at least 16 dimensions there."""
    t, m, out = s.trainer, s.model, []
    accelerator, strategy = str(t.get("accelerator", "cpu")), str(t.get("strategy", "auto"))
    cuda = accelerator in ("gpu", "cuda") or accelerator == "auto" and _has_cuda()
    problem = cuda_problem(accelerator)
    if problem:
        out.append(problem)
    elif strategy.startswith("fsdp") and not cuda:
        out.append(
            f"trainer.strategy={strategy} needs CUDA GPUs (FSDP has no CPU backend), but trainer.accelerator="
            f"{accelerator} runs on the CPU; use trainer=ddp for several CPU processes."
        )
    max_epochs = t.get("max_epochs", -1)
    if (
        t.get("max_steps", -1) == -1
        and (not is_int(max_epochs) or max_epochs < 1)
        and not t.get("fast_dev_run")
    ):
        out.append(
            "trainer.max_steps=-1 and trainer.max_epochs<=0: training would never stop; "
            "set trainer.max_steps."
        )
    if m.get("attention_backend") != "flex":
        return out
    if not cuda:
        out.append(
            f"model.attention_backend=flex trains only on CUDA (FlexAttention has no CPU backward), but "
            f"trainer.accelerator={accelerator}; use model.attention_backend=auto (SDPA on the CPU) or "
            "trainer=gpu."
        )
        return out
    d_model, n_heads = m.get("d_model"), m.get("n_heads")
    whole = is_int(d_model) and is_int(n_heads) and n_heads > 0 and d_model % n_heads == 0
    if whole and not head_dim_fits(d_model // n_heads, "cuda"):  # (else: the model's own line)
        out.append(small_heads_problem(d_model // n_heads))
    return out


def optim_problems(s: TrainConfig) -> list[str]:
    """``optim.lr`` may be null only for ``inverse_sqrt`` (its formula is the learning rate), which also
    needs a warm-up of at least one step (a warm-up longer than the run is clamped, not refused)."""
    out = []
    if s.optim.lr is None and s.schedule.name != "inverse_sqrt":
        out.append("optim.lr=None must be a positive number (e.g. optim.lr=1e-3).")
    warmup = s.schedule.warmup_steps
    if s.schedule.name == "inverse_sqrt" and is_int(warmup) and warmup < 1:
        out.append("schedule.name=inverse_sqrt needs schedule.warmup_steps >= 1 (the paper uses 4000).")
    return out


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


def model_pe(fields: dict[str, Any]) -> tuple[PositionalEncoding | None, str]:
    """The model's fields as a ``ModelConfig`` (its own checks: sizes, heads, PE name, ...) and its PE
    built with its options: ``(pe, "")``, or ``(None, the problem)``."""
    problem = plugin_problem(fields.get("pe"))
    if problem:
        return None, problem
    try:
        cfg = ModelConfig(**{**fields, "vocab_size": max(int(fields.get("vocab_size") or 0), 8)})
        causal = cfg.kind == "decoder" or not cfg.pe_applies("encoder")
        depth = max(cfg.n_layers, cfg.n_encoder_layers, cfg.n_decoder_layers)
        shape = {"d_model": cfg.d_model, "n_heads": cfg.n_heads, "causal": causal, "n_layers": depth}
        return build_encoding(cfg.pe, **shape, **cfg.pe_options), ""
    except (PosformerError, TypeError) as exc:
        return None, str(exc)


def pe_problems(s: TrainConfig, pe: PositionalEncoding | None) -> list[str]:
    """Forced FlexAttention cannot train the parameters of an elementwise bias whose form does not state
    ``trainable``; randomized positions need ``positions.n_max``, and a PE table must cover it
    (``pe``: ``None`` when the model's own checks refused it)."""
    out, n_max = [], s.positions.n_max
    if s.positions.randomized and n_max is None:
        out.append(
            "positions.randomized=true draws positions from [0, positions.n_max), but positions.n_max is "
            "null; set it well above the longest evaluation sequence (e.g. positions.n_max=512)."
        )
    if pe is None:
        return out
    form, forced = pe.caps.bias, s.model.get("attention_backend") == "flex" and s.train
    untrainable = form is not None and form.score_mod and not form.trainable
    if forced and untrainable and any(t.requires_grad for t in pe.parameters()):
        out.append(
            f"model.attention_backend=flex cannot train the parameters of pe={pe.name}'s bias (its bias form "
            "does not state trainable=True: docs/adding_a_pe.md); use model.attention_backend=auto "
            "(SDPA with the materialised bias for those calls) or freeze the PE."
        )
    if (
        s.positions.randomized
        and n_max is not None
        and pe.max_positions is not None
        and pe.max_positions < n_max
    ):
        out.append(
            f"pe={pe.name} has model.pe_options.max_len={pe.max_positions} positions, but randomized "
            f"positions are drawn from [0, positions.n_max={n_max}); set model.pe_options.max_len={n_max}."
        )
    return out


def data_problems(s: TrainConfig) -> list[str]:
    """What the datamodule would refuse later, said now: the evaluation lengths in order and within the
    limit, packing with the model and the positions (each option's own rules: its dataset's options)."""
    out, d = [], s.data
    lengths = getattr(d, "eval_lengths", None)
    if (
        isinstance(lengths, list)
        and all(is_int(v) and v >= 1 for v in lengths)
        and getattr(d, "eval_len", None) is None
    ):
        if any(b <= a for a, b in zip(lengths, lengths[1:])):
            out.append(
                f"data.eval_lengths={lengths} must be strictly increasing, e.g. {sorted(set(lengths))}."
            )
        elif lengths and lengths[-1] > MAX_EVAL_LENGTH:
            out.append(
                f"data.eval_lengths asks for length {lengths[-1]}, above {MAX_EVAL_LENGTH} (the limit of the "
                f"evaluation after training): {window_cost_words(lengths[-1], [s.model])}; evaluate shorter "
                f"lengths, or that length afterwards with posformer-eval eval.lengths=[{lengths[-1]}] "
                f"eval.max_length={lengths[-1]}."
            )
    if getattr(d, "pack", False) is not True:
        return out
    if s.model.get("kind") != "decoder":
        out.append(
            f"data.pack=true packs decoder-only rows, but model.kind={s.model.get('kind')!r}; set "
            "data.pack=false or use a decoder model (model=decoder_small)."
        )
    if s.positions.randomized:
        out.append(
            "data.pack=true restarts the positions at every document, which positions.randomized=true "
            "would replace; set positions.randomized=false or data.pack=false."
        )
    return out


# ----------------------------------------------------------------------------------- after the data
def longest_training_sequence(dm: Any) -> int | None:
    """Token length of the longest training sequence, or ``None`` if it cannot be determined cheaply."""
    from posformer.data import batch_width

    try:
        ds = dm.train_dataset()
        if hasattr(ds, "column_names") and "n" in ds.column_names:  # synthetic: longest instance
            import numpy as np

            return batch_width(dm.collate([ds[int(np.asarray(ds["n"]).argmax())]]))
        return batch_width(next(iter(dm.train_dataloader())))
    except Exception:  # noqa: BLE001 - a probe; the PE still raises a clear error at the first bad batch
        return None


def check_data_fit(
    s: TrainConfig, dm: Any, limit: tuple[int, PositionalEncoding] | None, dtype: torch.dtype | None = None
) -> None:
    """Checks that need the data: the PE's positions (``limit``: the fewest any PE of the model
    represents, computing in ``dtype``, and that PE) and randomized positions cover the training
    sequences."""
    longest = longest_training_sequence(dm)
    if longest is None:
        return
    problems, randomized, n_max = [], s.positions.randomized, s.positions.n_max
    if randomized and int(n_max or 0) < longest:
        problems.append(
            f"positions.n_max={n_max} is smaller than the longest training sequence ({longest} tokens); "
            f"randomized positions need positions.n_max >= {longest} (Ruoss et al. use several times the "
            "longest evaluation length)."
        )
    need = int(n_max or 0) if randomized else longest
    what = "positions.n_max" if randomized else "the longest training sequence"
    n, pe = limit or (None, None)
    if n is not None and pe is not None and n < need:
        if n == pe.max_positions:  # a table
            where, fix = "", f"set model.pe_options.max_len={need} or use a PE without a length limit"
        else:  # the range of the run's dtype
            where, fix = f" in {str(dtype).removeprefix('torch.')}", pe.range_fix(dtype)
        problems.append(
            f"pe={pe.name!r} represents {n} positions{where}, but training needs {need} ({what}); {fix}."
        )
    raise_problems(problems)
