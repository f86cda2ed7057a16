"""The typed schema of ``posformer-train``'s config: frozen dataclasses Hydra merges the YAML files and the
overrides onto, and :func:`posformer.configs.settings.read_train` reads the composed config into. Every
field is ``MISSING`` (the YAML files hold the values); a field may carry a :class:`~posformer.rules.Rule`
(value sets are rules, not ``Enum`` s, which would reach the checkpoints' hyper-parameters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posformer.conform import spec
from posformer.model.positions import POSITION_SAMPLERS
from posformer.rules import Rule, at_least, between, is_int, is_number, one_of, positive, seed

#: ``optim.name`` (posformer.lit.optim builds these and imports this tuple)
OPTIMIZERS = ("adamw", "adam")
#: ``schedule.name`` (posformer.lit.optim)
SCHEDULES = ("inverse_sqrt", "cosine", "constant")
#: ``compile.mode`` (torch.compile's modes; null: torch's default)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Lightning's ``trainer.precision`` values; ``auto`` (:func:`posformer.devices.resolve_device`) too
PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "64")
PRECISIONS += ("transformer-engine", "transformer-engine-float16")
SEED = seed(f" = {2**32} (the range numpy's RNG accepts); e.g. seed=0")
THREADS = at_least(1, limit="a positive integer or null (torch's default)")


@dataclass(frozen=True)
class CompileConfig:
    """``compile``: ``torch.compile`` of the model (``Module.compile``)."""

    enabled: bool = spec()
    backend: str | None = spec()  # checked against torch._dynamo.list_backends() when enabled
    mode: str | None = spec(one_of(*COMPILE_MODES))
    dynamic: bool | None = spec()
    fullgraph: bool = spec()


@dataclass(frozen=True)
class NoDecayConfig:
    """``optim.no_decay``: parameter kinds excluded from weight decay."""

    biases: bool = spec()
    norms: bool = spec()
    embeddings: bool = spec()
    pe: bool = spec()


@dataclass(frozen=True)
class OptimConfig:
    """``optim``: the optimiser (posformer.lit.optim.build_optimizer)."""

    name: str = spec(one_of(*OPTIMIZERS, test=lambda v: str(v).lower() in OPTIMIZERS))
    # null only with schedule.name=inverse_sqrt, whose formula is the learning rate (configs.checks)
    lr: float | None = spec(positive("a positive number (e.g. optim.lr=1e-3)"))
    betas: list[float] = spec(
        Rule(
            limit="two numbers in [0, 1), e.g. [0.9, 0.98]",
            test=lambda v: len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v),
        )
    )
    eps: float = spec(between(0.0, 1.0, lo_open=True))
    weight_decay: float = spec(between(0.0, 10.0, then="0 disables weight decay"))
    # torch's fused kernel (one launch for every parameter; a NaN step skipped in it): null on CUDA
    fused: bool | None = spec()
    no_decay: NoDecayConfig = field(default_factory=NoDecayConfig)
    # fine-tune the SSMax temperatures alone (posformer.model.knobs): every other parameter frozen
    temperatures_only: bool = spec()


@dataclass(frozen=True)
class ScheduleConfig:
    """``schedule``: the learning-rate schedule (posformer.lit.optim.build_schedule)."""

    name: str = spec(one_of(*SCHEDULES))
    # an int (steps) or a float (a fraction of the run): OmegaConf has no int-or-float type
    warmup_steps: Any = spec(
        Rule(
            limit="an integer >= 0; or give a fraction of the run in (0, 1), e.g. 0.05",
            test=lambda v: (is_int(v) and v >= 0) or (isinstance(v, float) and 0.0 < v < 1.0),
        )
    )
    multiplier: float = spec(positive())
    min_lr_ratio: float = spec(between(0.0, 1.0, hi_open=False))
    total_steps: int | None = spec(at_least(1, "null decays over trainer.max_steps"))


@dataclass(frozen=True)
class LossConfig:
    """``loss``."""

    label_smoothing: float = spec(between(0.0, 1.0, then="0.1 is the paper's value, 0 disables it"))


@dataclass(frozen=True)
class PositionsConfig:
    """``positions``: the positions of training steps: randomized integers (Ruoss et al. 2023), or a sampler
    (PoSE's chunked skips, random floats; :mod:`posformer.model.positions`), over ``[0, n_max)``."""

    randomized: bool = spec()
    n_max: int | None = spec(at_least(1, "set it well above the longest evaluation sequence"))
    sampler: str = spec(one_of(*POSITION_SAMPLERS))
    pose_chunks: int = spec(at_least(1, "PoSE uses 2 chunks"))


@dataclass(frozen=True)
class TrainConfig:
    """The root of ``configs/train.yaml`` (ConfigStore ``train_schema``), in the order it prints; read with
    ``data`` its dataset's options and ``model`` the ``ModelConfig`` fields."""

    task_name: str = spec()
    seed: int = spec(SEED)
    train: bool = spec()
    evaluate: bool = spec()
    ckpt_path: str | None = spec()
    init_from: str | None = spec()
    eval_ckpt: str = spec(one_of("best", "last"))
    torch_threads: int | None = spec(THREADS)
    flush_denormal: bool = spec(
        Rule(
            limit="true or false (true: treat float32 values below 1.2e-38 as 0 on the CPU, the fast setting)"
        )
    )
    float32_matmul_precision: str | None = spec(one_of(None, "highest", "high", "medium"))
    tags: list[str] = spec()
    compile: CompileConfig = field(default_factory=CompileConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    positions: PositionsConfig = field(default_factory=PositionsConfig)
    model: Any = None  # typed by each model option (/schema/model: ModelConfig)
    data: Any = None  # typed by each data option (/schema/data/<name>: posformer.data.options)
    trainer: dict[str, Any] = field(default_factory=dict)  # any lightning.Trainer argument
    logger: Any = None
    callbacks: Any = None
    paths: dict[str, Any] = field(default_factory=dict)
    # a named variant (+variant=<name>: configs/variant/): name, and the pe, pe_options and model settings
    # it applies over the model section (posformer.configs.variants); null: none, the run as composed
    variant: Any = None


#: ``trainer`` keys of posformer's own, beside the ``lightning.Trainer`` arguments (never passed to it):
#: ``context_parallel``, the processes that split each sequence (posformer.lit.context_parallel)
OWN_TRAINER_KEYS = ("context_parallel",)

#: the rules of the ``trainer`` keys posformer reads (the section takes any ``lightning.Trainer`` argument)
TRAINER_RULES: dict[str, Rule] = {
    "precision": one_of(
        "auto",
        *PRECISIONS[:6],
        test=lambda v: str(v) in ("auto", *PRECISIONS),
        note="(auto: bf16-mixed/16-mixed on CUDA, 32-true on the CPU; 32-true is full precision)",
    ),
    "max_steps": Rule(
        limit="a positive integer (or -1 with trainer.max_epochs > 0)",
        test=lambda v: is_int(v) and (v >= 1 or v == -1),
    ),
    "val_check_interval": positive("a positive number of steps (int) or an epoch fraction"),
    "gradient_clip_val": Rule(
        limit=">= 0 (0 or null disables clipping)", test=lambda v: is_number(v) and v >= 0
    ),
    "accumulate_grad_batches": at_least(1),
    "log_every_n_steps": at_least(1),
    "num_nodes": at_least(1),
    "devices": Rule(
        limit="a positive integer, -1, 'auto' or a list of device ids",
        test=lambda v: v == "auto" or isinstance(v, list) or (is_int(v) and (v >= 1 or v == -1)),
    ),
    "context_parallel": at_least(1, "1: every process holds whole sequences; P: P processes split each one"),
}
