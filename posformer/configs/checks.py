"""The training config's checks that combine sections or need the device, torch, the PE or the data: one
line per problem (key, value, limit, fix), reported by :func:`posformer.configs.settings.read_train`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from posformer.devices import cuda_problem
from posformer.errors import PosformerError
from posformer.model import ModelConfig
from posformer.model.backends.flex import head_dim_fits, small_heads_problem
from posformer.model.layer_pes import check_layer_pes
from posformer.pe.base import PositionalEncoding
from posformer.pe.registry import plugin_problem
from posformer.rules import is_int
from posformer.utils.memory import window_cost_words

if TYPE_CHECKING:
    from posformer.configs.schema import TrainConfig

#: the longest data.eval_lengths the evaluation after training accepts (posformer-eval's eval.max_length)
MAX_EVAL_LENGTH = 1_048_576


def run_problems(s: TrainConfig) -> list[str]:
    """The run's mode, the compile backend, ``optim.lr`` null only for ``inverse_sqrt`` (its formula is the
    learning rate) and its warm-up."""
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
    if s.optim.lr is None and s.schedule.name != "inverse_sqrt":
        out.append("optim.lr=None must be a positive number (e.g. optim.lr=1e-3).")
    if s.optim.temperatures_only and not _has_temperatures(s.model):
        out.append(
            "optim.temperatures_only=true trains the SSMax temperatures, but the model has none; set "
            "model.attention_knobs.ssmax=true (or ssmax on a layer kind), or drop temperatures_only."
        )
    warmup = s.schedule.warmup_steps
    if s.schedule.name == "inverse_sqrt" and is_int(warmup) and warmup < 1:
        out.append("schedule.name=inverse_sqrt needs schedule.warmup_steps >= 1 (the paper uses 4000).")
    return out


def _has_temperatures(fields: dict[str, Any]) -> bool:
    """Whether some layer of the model (its fields) has SSMax temperatures (unknown when they are bad:
    the model's own check says what)."""
    try:
        cfg = ModelConfig(**{**fields, "vocab_size": max(int(fields.get("vocab_size") or 0), 8)})
    except (PosformerError, TypeError):
        return True
    return any(kind.knobs.ssmax for place in cfg.places for kind in cfg.plan(place))


def trainer_problems(s: TrainConfig) -> list[str]:
    """The device exists, FSDP has GPUs, the run stops; forced FlexAttention: CUDA, heads wide enough."""
    import torch

    t, m, out = s.trainer, s.model, []
    accelerator, strategy = str(t.get("accelerator", "cpu")), str(t.get("strategy", "auto"))
    cuda = accelerator in ("gpu", "cuda") or accelerator == "auto" and torch.cuda.is_available()
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
        and not (is_int(max_epochs) and max_epochs >= 1)
        and not t.get("fast_dev_run")
    ):
        out.append(
            "trainer.max_steps=-1 and trainer.max_epochs<=0: training would never stop; "
            "set trainer.max_steps."
        )
    if m.get("attention_backend") == "flex" and not cuda:
        out.append(
            f"model.attention_backend=flex trains only on CUDA (FlexAttention has no CPU backward), but "
            f"trainer.accelerator={accelerator}; use model.attention_backend=auto (SDPA on the CPU) or "
            "trainer=gpu."
        )
    elif m.get("attention_backend") == "flex":
        d_model, n_heads = m.get("d_model"), m.get("n_heads")
        whole = is_int(d_model) and is_int(n_heads) and n_heads > 0 and d_model % n_heads == 0
        if whole and not head_dim_fits(d_model // n_heads, "cuda"):  # (else: the model's own line)
            out.append(small_heads_problem(d_model // n_heads))
    return out


def model_pe(fields: dict[str, Any]) -> tuple[PositionalEncoding | None, str]:
    """The model's fields as a ``ModelConfig`` and its PEs built as the model builds them (each checks
    itself): ``(the PE of its first place, "")``, or ``(None, the problem)``."""
    problem = plugin_problem(fields.get("pe"))
    if problem:
        return None, problem
    try:
        pes = check_layer_pes(
            ModelConfig(**{**fields, "vocab_size": max(int(fields.get("vocab_size") or 0), 8)})
        )
        return next((pe for pe in pes.places.values() if pe is not None), None), ""
    except (PosformerError, TypeError) as exc:
        return None, str(exc)


def pe_problems(s: TrainConfig, pe: PositionalEncoding | None) -> list[str]:
    """Randomized positions need ``positions.n_max`` a PE table covers; forced FlexAttention trains only a
    bias whose form states ``trainable``."""
    out, n_max, sampler = [], s.positions.n_max, s.positions.sampler
    if s.positions.randomized and n_max is None:
        out.append(
            "positions.randomized=true draws positions from [0, positions.n_max), but positions.n_max is "
            "null; set it well above the longest evaluation sequence (e.g. positions.n_max=512)."
        )
    if sampler != "none" and s.positions.randomized:
        out.append(
            f"positions.randomized=true and positions.sampler={sampler} both make the training positions; "
            "keep one (positions.sampler=none, or positions.randomized=false)."
        )
    if sampler != "none" and n_max is None:
        out.append(
            f"positions.sampler={sampler} draws positions over [0, positions.n_max), but positions.n_max is "
            "null; set it to the target length (e.g. positions.n_max=1024)."
        )
    if pe is None:
        return out
    if sampler == "float":  # the PE's own check of fractional positions (a table looks rows up)
        try:
            pe.check_positions(torch.zeros(1, 1))
        except PosformerError as exc:
            out.append(f"positions.sampler=float: {exc} Use positions.sampler=pose, or another PE.")
    form, forced = pe.caps.bias, s.model.get("attention_backend") == "flex" and s.train
    untrainable = form is not None and form.score_mod and not form.trainable
    if forced and untrainable and any(t.requires_grad for t in pe.parameters()):
        out.append(
            f"model.attention_backend=flex cannot train the parameters of pe={pe.name}'s bias (its bias form "
            "does not state trainable=True: docs/adding_a_pe.md); use model.attention_backend=auto "
            "(SDPA with the materialised bias for those calls) or freeze the PE."
        )
    if (
        (s.positions.randomized or sampler != "none")
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
    """The evaluation lengths in order and within the limit; packing with the model and the positions."""
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
    if getattr(d, "pack", False) is True and s.model.get("kind") != "decoder":
        out.append(
            f"data.pack=true packs decoder-only rows, but model.kind={s.model.get('kind')!r}; set "
            "data.pack=false or use a decoder model (model=decoder_small)."
        )
    if getattr(d, "pack", False) is True and s.positions.randomized:
        out.append(
            "data.pack=true restarts the positions at every document, which positions.randomized=true "
            "would replace; set positions.randomized=false or data.pack=false."
        )
    if getattr(d, "pack", False) is True and s.positions.sampler != "none":
        out.append(
            "data.pack=true restarts the positions at every document, which positions.sampler="
            f"{s.positions.sampler} would replace; set positions.sampler=none or data.pack=false."
        )
    return out
