"""The typed schema of ``posformer-eval``'s config (``eval_schema`` and each ``eval`` option's), which
:func:`posformer.eval.settings.read_eval` reads the composed config into before any checkpoint loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posformer.configs.schema import SEED, THREADS
from posformer.conform import spec
from posformer.model.policy import ATTENTION_BACKENDS
from posformer.rules import Rule, at_least, is_int, is_number, one_of, worded

__all__ = ["OPTIONS", "TASK_POSITIONS", "EvalRootConfig", "ExtrapolateConfig", "TranslateConfig"]

#: ``eval.task_positions`` -> the row mode: ordinary positions ``0 … T-1``, or randomized ones (sorted
#: random subsets of ``[0, n_max)`` in every forward, evaluation included, as in Ruoss et al. 2023's code)
TASK_POSITIONS = {"ordinary": "task", "randomized": "task_randomized"}


def _numbers_line(integers: bool, example: str) -> Callable[[str, Any], str | None]:
    """The line of a non-empty list of positive integers (``integers``) or numbers; null and ``[]`` pass."""
    what, ok = ("positive integers", is_int) if integers else ("positive numbers", is_number)

    def line(key: str, value: Any) -> str | None:
        if value is None or (isinstance(value, list | tuple) and not value):
            return None
        if not isinstance(value, list | tuple):
            single = f" (one length is written {key}=[{value}])" if is_int(value) else ""
            return f"{key}={value!r} must be a non-empty list of {what}, e.g. {key}={example}{single}."
        bad = [v for v in value if not ok(v) or not v > 0]
        no = ", no fractions" if integers else ""
        return (
            f"{key}={list(value)!r} contains {bad!r}; every entry must be one of the {what} (>= 1{no}), e.g. "
            f"{key}={example}."
            if bad
            else None
        )

    return line


def _positions(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value or [])


LENGTHS = Rule(line=_numbers_line(True, "[64, 128, 256]"))
LENGTH_MULTIPLES = Rule(line=_numbers_line(False, "[1, 2, 4, 8]"))
STRIDE = Rule(
    limit="a number of tokens (int >= 1) or a fraction of the window length (float in (0, 1], e.g. 0.5)",
    test=lambda v: (is_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0),
)
TASK_POSITIONS_RULE = worded(
    lambda v: bool(_positions(v)) and all(p in TASK_POSITIONS for p in _positions(v)),
    lambda k, v: (
        f"{k}={_positions(v)!r}: give a non-empty list of {' / '.join(TASK_POSITIONS)} (randomized: "
        "positions as in a randomized-positions training run, sampled again in every evaluation forward)."
    ),
)
MAX_BATCHES = at_least(
    1,
    limit="an integer >= 1 (batches per length) or null (all batches); 0 or less would record results "
    "from zero sequences",
)
POSITIONS_SEED = at_least(0, limit="an integer >= 0 (it seeds the randomized positions)")
MAX_LENGTH = at_least(1, limit="an integer >= 1 (the longest length accepted) or null (no limit)")
N_TOKENS = at_least(1, limit="a positive number of tokens (or null: as the training run scored)")
POSITIVE = at_least(1, limit="an integer >= 1")
#: ``eval.attention_backend``: the checkpoints' ``model.attention_backend`` replaced (null: theirs)
ATTENTION_BACKEND = one_of(*ATTENTION_BACKENDS, note="(null: each checkpoint's model.attention_backend)")

#: ``eval.context_parallel``: the processes that split every LM window (posformer.eval.parallel)
CONTEXT_PARALLEL = at_least(
    1, limit="an integer >= 1 (1: one process holds every window; P: P processes split each)"
)


@dataclass(frozen=True)
class ExtrapolateConfig:
    """``eval=extrapolate`` (``configs/eval/extrapolate.yaml``, ConfigStore ``eval/extrapolate_schema``)."""

    name: str = spec()
    checkpoints: Any = spec()  # a path or a list of paths
    sweep_dir: Any = spec()  # a dir, a list of dirs or null
    which: str = spec(one_of("best", "last"))
    labels: list[str] | None = spec()
    lengths: Any = spec(LENGTHS)  # Any: the rule words a bare 8 or a 2.5 better than a type error
    length_multiples: Any = spec(LENGTH_MULTIPLES)
    max_length: int | None = spec(MAX_LENGTH)
    modes: list[str] = spec()  # the values: EvalSettings (they depend on eval.streaming)
    stride: Any = spec(STRIDE)  # tokens (int) or a fraction (float)
    n_tokens: int | None = spec(N_TOKENS)
    windows_at_max: int = spec(POSITIVE)
    batch_tokens: int = spec(POSITIVE)
    streaming: Any = spec()  # checked by posformer.eval.streaming.parse_streaming
    max_batches: int | None = spec(MAX_BATCHES)
    task_positions: Any = spec(TASK_POSITIONS_RULE)
    positions_seed: int = spec(POSITIONS_SEED)
    rope_scaling: Any = spec()  # a dict, a list of dicts/nulls, or null (posformer.eval.scaling)
    position_map: Any = spec()  # a map, a list of maps/nulls, or null (posformer.model.remap)
    attention_chunk_mb: int | None = spec(POSITIVE)
    attention_backend: str | None = spec(ATTENTION_BACKEND)
    context_parallel: int = spec(CONTEXT_PARALLEL)
    data: dict[str, Any] = field(default_factory=dict)
    output_dir: str | None = spec()
    progress: bool = spec()
    tensorboard: bool = spec()


@dataclass(frozen=True)
class TranslateConfig:
    """``eval=translate`` (``configs/eval/translate.yaml``, ConfigStore ``eval/translate_schema``)."""

    name: str = spec()
    checkpoint: str | None = spec()
    run_dir: str | None = spec()
    average_last: int = spec(at_least(0, limit="an integer >= 0 (0: one checkpoint)"))
    up_to_step: int | None = spec()
    which: str = spec(one_of("best", "last"))
    split: str = spec()
    beam_size: int = spec(POSITIVE)
    alpha: float = spec()
    max_len_a: float = spec()
    max_len_b: int = spec()
    max_tokens: int = spec(POSITIVE)
    limit: int | None = spec(POSITIVE)
    data: dict[str, Any] = field(default_factory=dict)
    output_dir: str | None = spec()
    device: str = spec()
    progress: bool = spec()


@dataclass(frozen=True)
class EvalRootConfig:
    """The root of ``configs/eval.yaml`` (ConfigStore ``eval_schema``); ``eval`` is typed by its option's
    schema, ``trainer`` (accelerator and precision are read) and ``paths`` stay open."""

    task_name: str = spec()
    seed: int = spec(SEED)
    torch_threads: int | None = spec(THREADS)
    flush_denormal: bool = spec()
    eval: Any = None
    trainer: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, Any] = field(default_factory=dict)


#: the schema of each ``eval`` option
OPTIONS: dict[str, type] = {"extrapolate": ExtrapolateConfig, "translate": TranslateConfig}
