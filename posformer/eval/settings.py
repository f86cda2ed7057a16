"""What the extrapolation harness evaluates and how: :func:`read_eval` (``posformer-eval``'s config read
once, before any checkpoint is loaded), :class:`EvalSettings` (lengths, modes, budgets) and
:class:`Subject` (one model with its data, training length and rotary scaling), plus the small facts
about lengths the other evaluation modules share (in-distribution test, scaling label, the fingerprint
that makes results of a rewritten checkpoint stale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from posformer.checkpoints.read import TRUST_FLAG
from posformer.configs import eval_schema
from posformer.conform import conform
from posformer.errors import ConfigError
from posformer.eval.streaming import STREAMING, StreamingSpec, parse_streaming
from posformer.model.remap import PositionMap, parse_position_map
from posformer.rules import raise_problems, rule_problems

#: language-model evaluation modes (:mod:`posformer.eval.windows`, :mod:`posformer.eval.streaming`)
MODES = ("nonoverlap", "sliding", STREAMING)
#: the LM modes evaluated unless ``eval.modes`` names others (``eval.streaming`` adds ``streaming``)
DEFAULT_MODES = ("nonoverlap", "sliding")
#: task-mode positions -> the row ``mode``: ordinary positions ``0 … T-1``, or randomized ones (sorted
#: random subsets of ``[0, n_max)`` in every forward, evaluation included, as in Ruoss et al. 2023's code)
TASK_MODES = eval_schema.TASK_POSITIONS


def translate_problems(o: Mapping[str, Any]) -> list[str]:
    """``eval=translate``'s options that combine: a checkpoint or a run, what averaging needs."""
    out = []
    if not o["checkpoint"] and not o["run_dir"]:
        out.append("eval=translate needs eval.checkpoint=<.ckpt> or eval.run_dir=<training run directory>.")
    if o["average_last"] and not o["run_dir"]:
        out.append("eval.average_last needs eval.run_dir (the run whose checkpoints are averaged).")
    if o["up_to_step"] is not None and not o["average_last"]:
        out.append("eval.up_to_step selects the checkpoints to average; set eval.average_last=N too.")
    return out


def extrapolate_problems(ev: eval_schema.ExtrapolateConfig) -> list[str]:
    """``eval=extrapolate``'s checkpoints given, its modes known, ``eval.streaming`` set for the
    streaming mode (:class:`EvalSettings` takes these values)."""
    out = []
    if not ev.checkpoints and not ev.sweep_dir:
        out.append(
            "posformer-eval eval=extrapolate needs checkpoints: set eval.checkpoints=[path/to.ckpt] or "
            "eval.sweep_dir=path/to/training/multirun."
        )
    modes = list(ev.modes or DEFAULT_MODES)
    if set(modes) - set(MODES):
        out.append(f"eval.modes={modes!r} is invalid; valid modes: {', '.join(MODES)}.")
    maps = ev.position_map if isinstance(ev.position_map, list | tuple) else [ev.position_map]
    for raw in maps:
        try:
            parse_position_map(raw)
        except ConfigError as exc:
            out.append(str(exc))
    if any(m is not None for m in maps) and ev.context_parallel > 1:
        out.append(
            f"eval.position_map with eval.context_parallel={ev.context_parallel}: a remapped attention runs "
            "unsplit; set eval.context_parallel=1."
        )
    try:
        streaming = parse_streaming(ev.streaming)
    except ConfigError as exc:
        return [*out, str(exc)]
    if STREAMING in modes and not streaming:
        out.append(STREAMING_UNSET.format(modes=modes))
    return out


#: the line for the streaming mode without its spec
STREAMING_UNSET = (
    "eval.modes={modes!r} includes streaming, but eval.streaming is not set; give "
    "eval.streaming={{sink: 4, window: 256}} (first tokens kept, recent tokens kept)."
)


def read_eval(cfg: DictConfig, option: str) -> eval_schema.EvalRootConfig:
    """``posformer-eval``'s composed config (``option``: the ``eval`` group's choice) read once into its
    settings: the root and the option's section merged onto their schema nodes (a key added with ``+``
    that the schema does not declare, one line each), every field's rule, and ``eval.streaming``
    (:func:`~posformer.eval.streaming.parse_streaming`), the checks that combine fields
    (:func:`extrapolate_problems`, :func:`translate_problems`); one :class:`ConfigError` lists every
    problem, before any work."""
    try:
        given = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # interpolation errors
        raise ConfigError(f"the configuration cannot be resolved: {exc}") from None
    section, _ = given.pop("eval", None) or {}, given.pop("hydra", None)
    given.pop(TRUST_FLAG, None)  # +trust_checkpoint_code=true: read from the command line (check_pe_trusted)
    cls = eval_schema.OPTIONS.get(option)
    if cls is None:
        raise ConfigError(f"eval={option!r} is unknown; valid: {', '.join(eval_schema.OPTIONS)}.")
    node, problems = conform(eval_schema.EvalRootConfig, given, "")
    enode, lines = conform(cls, section, "eval.")
    raise_problems(problems + lines)
    root, ev = OmegaConf.to_object(node), OmegaConf.to_object(enode)
    problems = rule_problems(root, "") + rule_problems(ev, "eval.")
    if option == "extrapolate":
        problems += extrapolate_problems(ev)
    else:
        problems += translate_problems(dataclasses.asdict(ev))
    raise_problems(problems)
    return dataclasses.replace(root, eval=ev)


@dataclass
class EvalSettings:
    """What to evaluate and how.

    Attributes:
        lengths: evaluation lengths (LM: tokens per window; tasks: problem lengths).
        modes: LM modes, a subset of ``("nonoverlap", "sliding", "streaming")``.
        streaming: ``eval.streaming`` ({sink, window, positions}; :mod:`posformer.eval.streaming`), adds
            the ``streaming`` mode; ``None``: off.
        stride: sliding-window stride, in tokens (int >= 1) or as a fraction of ``L`` (float in (0, 1]).
        n_tokens: scored tokens per length (LM); ``None``: ``windows_at_max`` windows of the longest length.
        windows_at_max: see ``n_tokens``.
        batch_tokens: tokens per forward pass (batch size = max(1, batch_tokens // L)).
        position_curves: keep the per-position loss curve (nonoverlap mode).
        attention_chunk_mb: override of ``model.attention_chunk_mb`` (the attention's query-chunking budget).
        attention_backend: override of ``model.attention_backend`` (``auto``, ``flex``, ``sdpa``; e.g.
            ``sdpa`` where a GPU lacks the shared memory of FlexAttention's compiled kernel).
        max_batches: task mode: evaluate at most this many batches per length (``None``: all).
        task_positions: task mode: evaluate with ``ordinary`` positions, ``randomized`` ones (each
            sequence a sorted random subset of ``[0, n_max)``, ``n_max`` from the checkpoint's
            training; row mode ``task_randomized``), or both.
        positions_seed: seed of the randomized evaluation positions (one generator per subject and length).
        progress: show progress: a rich bar on a terminal, one line per finished row otherwise.
    """

    lengths: list[int]
    modes: tuple[str, ...] = DEFAULT_MODES
    stride: float | int = 0.5
    n_tokens: int | None = None
    windows_at_max: int = 4
    batch_tokens: int = 16384
    position_curves: bool = True
    attention_chunk_mb: int | None = None
    attention_backend: str | None = None
    max_batches: int | None = None
    task_positions: tuple[str, ...] = ("ordinary",)
    positions_seed: int = 0
    progress: bool = True
    streaming: StreamingSpec | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        """The lengths sorted, each once; the modes, with ``streaming`` when its spec is given (the values
        themselves are the config's: :func:`read_eval` checks them)."""
        if not self.lengths:
            raise ConfigError(f"eval.lengths={self.lengths!r} must be a non-empty list of positive integers.")
        self.lengths = sorted({int(x) for x in self.lengths})
        items = [self.task_positions] if isinstance(self.task_positions, str) else self.task_positions
        self.task_positions = tuple(dict.fromkeys(items))
        self.modes = tuple(self.modes)
        bad = set(self.modes) - set(MODES)
        if bad or not self.modes:
            raise ConfigError(f"eval.modes={list(self.modes)!r} is invalid; valid modes: {', '.join(MODES)}.")
        self.streaming = parse_streaming(self.streaming)
        if self.streaming and STREAMING not in self.modes:
            self.modes += (STREAMING,)
        if STREAMING in self.modes and not self.streaming:
            raise ConfigError(STREAMING_UNSET.format(modes=list(self.modes)))

    def model_overrides(self) -> dict[str, Any]:
        """The fields of each checkpoint's ``model.cfg`` this evaluation replaces (``None``: its own)."""
        return {"attention_chunk_mb": self.attention_chunk_mb, "attention_backend": self.attention_backend}

    def stride_for(self, length: int) -> int:
        """The sliding-window stride in tokens at window length ``length`` (1 .. ``length``)."""
        if isinstance(self.stride, float):
            return max(1, int(round(self.stride * length)))
        return min(int(self.stride), length)

    def wanted_tokens(self) -> int:
        """Scored tokens per length before capping to the data (``n_tokens`` or windows_at_max x longest)."""
        return self.n_tokens or self.windows_at_max * self.lengths[-1]


@dataclass
class Subject:
    """One model to evaluate.

    Attributes:
        label: name in tables and plots (e.g. the run name or PE).
        model: the model (``DecoderOnlyTransformer`` or ``EncoderDecoderTransformer``).
        task_type: ``"lm"`` or ``"task"``.
        data: LM: a 1-D token tensor ``(N,)``, or an object with ``eval_stream()`` or ``val_stream``;
            task: an object with ``eval_dataloaders(lengths) -> {length: DataLoader}``.
        train_len: the training length (int) or range ``(min, max)``; marks in-distribution lengths.
        checkpoint: the checkpoint path (part of the skip-done key).
        pe: the PE name.
        scaling: rotary context extension to apply (``pe.scaling`` dict; ``factor: auto`` = L / train length).
        position_map: the remapping of query/key distances set on ``model`` (``eval.position_map``), or None.
        fingerprint: identifies the checkpoint file's contents (:func:`file_fingerprint`); results recorded
            for the same path with another fingerprint (e.g. ``last.ckpt`` overwritten by further
            training) are stale and are evaluated again.
        n_max: the checkpoint's ``positions.n_max`` (the range of its randomized positions), if any.
        n_tokens: LM: the tokens the training run scored per length (its ``results.md``;
            :func:`posformer.eval.windows.training_scored_tokens`), the default of ``eval.n_tokens``.
        variant: the name of the run's variant (``+variant=prope``), if it has one: its rows say it, and
            figures draw it in a colour of its own.
    """

    label: str
    model: nn.Module
    task_type: str
    data: Any
    train_len: int | tuple[int, int] | None = None
    checkpoint: str = ""
    pe: str = ""
    scaling: dict[str, Any] | None = None
    position_map: PositionMap | None = None
    fingerprint: str = ""
    n_max: int | None = None
    n_tokens: int | None = None
    variant: str | None = None

    @property
    def scaling_name(self) -> str:
        """The scaling as tables show it (``none``, ``linear(factor=auto)``, ...)."""
        name = scaling_label(self.scaling)
        if self.position_map is None:
            return name
        return self.position_map.label if name == "none" else f"{name}+{self.position_map.label}"

    def key(self, mode: str, length: int) -> str:
        """The skip-done key of one (mode, length) result row."""
        return f"{self.checkpoint or self.label}|{self.scaling_name}|{mode}|{length}"


def file_fingerprint(path: str | Path) -> str:
    """``<size>-<mtime_ns>`` of a file: changes when a checkpoint at the same path is rewritten."""
    st = Path(path).stat()
    return f"{st.st_size}-{st.st_mtime_ns}"


def scaling_label(scaling: dict[str, Any] | None) -> str:
    """``none`` for no scaling, else ``<type>(<options>)`` without ``original_max_len``."""
    if not scaling or scaling.get("type") in (None, "none"):
        return "none"
    extra = ",".join(f"{k}={v}" for k, v in sorted(scaling.items()) if k not in ("type", "original_max_len"))
    return f"{scaling['type']}({extra})" if extra else str(scaling["type"])


def in_distribution(length: int, train_len: int | Sequence[int] | None) -> bool | None:
    """Whether ``length`` is within the training length/range (``None``: unknown)."""
    if train_len is None:
        return None
    if isinstance(train_len, (list, tuple)):
        lo, hi = (int(train_len[0]), int(train_len[-1]))
        return lo <= length <= hi
    return length <= int(train_len)


def train_len_max(train_len: int | Sequence[int] | None) -> int | None:
    """The longest training length (the upper end of a range)."""
    if train_len is None:
        return None
    return int(train_len[-1]) if isinstance(train_len, (list, tuple)) else int(train_len)
