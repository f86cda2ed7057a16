"""Length-extrapolation harness: evaluate trained models at lengths beyond their training length.

Two kinds of subjects:

* **Language models** (``task_type == "lm"``): loss / perplexity per evaluation length ``L`` on one
  token stream, in two modes, always scoring the *same* number of tokens ``n_tokens`` at every length:

  - ``nonoverlap``: the stream is cut into consecutive length-``L`` chunks; every token of every chunk
    is scored (so early tokens of each chunk have little context). The loss per token position
    (averaged over chunks) is kept as a curve.
  - ``sliding``: windows of length ``L`` moved by a stride ``S``; the first window scores all of its
    tokens, every later window only its last ``S`` (the last window is shifted back to end at the
    stream end, scoring only the tokens not scored yet). With ``S = L`` this equals ``nonoverlap``.

* **Synthetic tasks** (``task_type == "task"``): exact-match and token accuracy per problem length from
  the datamodule's ``eval_dataloaders(lengths)``, with the in-distribution (training) range marked.

Evaluation runs through Lightning Fabric, so ``trainer.accelerator/devices/precision`` mean the same as
in training. A PE that cannot represent a length (a learned table too short: ``PositionRangeError``) is
reported as ``n/a`` with the reason; the other lengths still run. Peak memory is measured per length
(CUDA: ``max_memory_allocated``; CPU: the process's peak RSS, reset per length through
``/proc/self/clear_refs``, or a sampling thread where that is unavailable).

Results go to ``extrapolation.{json,csv,md}``, PNG plots and TensorBoard under the output directory,
written atomically after every (checkpoint, length) pair, so an interrupted sweep re-run with the same
output directory skips the pairs already done.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import math
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.errors import CheckpointError, ConfigError, PositionRangeError, ResourceError, is_out_of_memory
from posformer.io import atomic_write_bytes, safe_load_checkpoint
from posformer.pe.base import PositionalEncoding

MODES = ("nonoverlap", "sliding")
RESULTS_JSON, RESULTS_CSV, RESULTS_MD = "extrapolation.json", "extrapolation.csv", "extrapolation.md"
CSV_FIELDS = (
    "label",
    "checkpoint",
    "pe",
    "scaling",
    "task_type",
    "mode",
    "length",
    "stride",
    "train_len",
    "in_distribution",
    "status",
    "loss",
    "ppl",
    "exact_match",
    "token_acc",
    "scored_tokens",
    "n_sequences",
    "peak_mem_mb",
    "peak_mem_delta_mb",
    "seconds",
    "reason",
)


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class EvalSettings:
    """What to evaluate and how.

    Attributes:
        lengths: evaluation lengths (LM: tokens per window; tasks: problem lengths).
        modes: LM modes, a subset of ``("nonoverlap", "sliding")``.
        stride: sliding-window stride, in tokens (int >= 1) or as a fraction of ``L`` (float in (0, 1]).
        n_tokens: scored tokens per length (LM); ``None``: ``windows_at_max`` windows of the longest length.
        windows_at_max: see ``n_tokens``.
        batch_tokens: tokens per forward pass (batch size = max(1, batch_tokens // L)).
        position_curves: keep the per-position loss curve (nonoverlap mode).
        attention_chunk_mb: override of ``model.attention_chunk_mb`` (the attention's query-chunking budget).
        max_batches: task mode: evaluate at most this many batches per length (``None``: all).
        progress: show a rich progress bar.
    """

    lengths: list[int]
    modes: tuple[str, ...] = MODES
    stride: float | int = 0.5
    n_tokens: int | None = None
    windows_at_max: int = 4
    batch_tokens: int = 16384
    position_curves: bool = True
    attention_chunk_mb: int | None = None
    max_batches: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        self.lengths = sorted({int(x) for x in self.lengths})
        if not self.lengths or self.lengths[0] < 1:
            raise ConfigError(f"eval.lengths={self.lengths!r} must be a non-empty list of positive integers.")
        self.modes = tuple(self.modes)
        bad = set(self.modes) - set(MODES)
        if bad or not self.modes:
            raise ConfigError(f"eval.modes={list(self.modes)!r} is invalid; valid modes: {', '.join(MODES)}.")
        stride_ok = (isinstance(self.stride, int) and self.stride >= 1) or (
            isinstance(self.stride, float) and 0.0 < self.stride <= 1.0
        )
        if isinstance(self.stride, bool) or not stride_ok:
            raise ConfigError(
                f"eval.stride={self.stride!r} must be a number of tokens (int >= 1) or a fraction of the "
                "window length (float in (0, 1], e.g. 0.5)."
            )
        if self.n_tokens is not None and self.n_tokens < 1:
            raise ConfigError(
                f"eval.n_tokens={self.n_tokens!r} must be a positive number of tokens (or null)."
            )
        if self.batch_tokens < 1:
            raise ConfigError(f"eval.batch_tokens={self.batch_tokens!r} must be >= 1.")

    def stride_for(self, length: int) -> int:
        if isinstance(self.stride, float):
            return max(1, int(round(self.stride * length)))
        return min(int(self.stride), length)


@dataclass
class Subject:
    """One model to evaluate.

    Attributes:
        label: name in tables and plots (e.g. the run name or PE).
        model: the model (``DecoderOnlyTransformer`` or ``EncoderDecoderTransformer``).
        task_type: ``"lm"`` or ``"task"``.
        data: LM: a 1-D token tensor, or an object with ``eval_stream()`` or ``val_stream``;
            task: an object with ``eval_dataloaders(lengths) -> {length: DataLoader}``.
        train_len: the training length (int) or range ``(min, max)``; marks in-distribution lengths.
        checkpoint: the checkpoint path (part of the skip-done key).
        pe: the PE name.
        scaling: rotary context extension to apply (``pe.scaling`` dict; ``factor: auto`` = L / train length).
        fingerprint: identifies the checkpoint file's contents (:func:`file_fingerprint`); results recorded
            for the same path with another fingerprint (e.g. ``last.ckpt`` overwritten by further
            training) are stale and are evaluated again.
    """

    label: str
    model: nn.Module
    task_type: str
    data: Any
    train_len: int | tuple[int, int] | None = None
    checkpoint: str = ""
    pe: str = ""
    scaling: dict[str, Any] | None = None
    fingerprint: str = ""

    @property
    def scaling_name(self) -> str:
        return scaling_label(self.scaling)

    def key(self, mode: str, length: int) -> str:
        return f"{self.checkpoint or self.label}|{self.scaling_name}|{mode}|{length}"


def file_fingerprint(path: str | Path) -> str:
    """``<size>-<mtime_ns>`` of a file: changes when a checkpoint at the same path is rewritten."""
    st = Path(path).stat()
    return f"{st.st_size}-{st.st_mtime_ns}"


def scaling_label(scaling: dict[str, Any] | None) -> str:
    if not scaling or scaling.get("type") in (None, "none"):
        return "none"
    extra = ",".join(f"{k}={v}" for k, v in sorted(scaling.items()) if k not in ("type", "original_max_len"))
    return f"{scaling['type']}({extra})" if extra else str(scaling["type"])


def in_distribution(length: int, train_len: int | Sequence[int] | None) -> bool | None:
    if train_len is None:
        return None
    if isinstance(train_len, (list, tuple)):
        lo, hi = (int(train_len[0]), int(train_len[-1]))
        return lo <= length <= hi
    return length <= int(train_len)


def train_len_max(train_len: int | Sequence[int] | None) -> int | None:
    if train_len is None:
        return None
    return int(train_len[-1]) if isinstance(train_len, (list, tuple)) else int(train_len)


# ---------------------------------------------------------------------------------------------- memory
def _read_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field_name}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


class MemoryMeter:
    """Peak memory of a block of code, in MiB.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset. CPU: the process's peak resident set size,
    reset at entry by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) and read from ``VmHWM``;
    where that is not possible a thread samples the RSS every few milliseconds. ``peak_mb`` is the
    whole process's peak; ``delta_mb`` is the peak minus the usage at entry.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_mb: float | None = None
        self.delta_mb: float | None = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled = 0

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._start = (_read_status_kb("VmRSS") or 0) * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._mode = "hwm"
        except OSError:
            self._mode = "sample"
            self._sampled = self._start
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            rss = (_read_status_kb("VmRSS") or 0) * 1024
            self._sampled = max(self._sampled, rss)

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._mode == "hwm":
            peak = (_read_status_kb("VmHWM") or 0) * 1024
        else:
            self._stop.set()
            self._sampler.join()
            peak = self._sampled
        self.peak_mb = round(peak / 2**20, 1)
        self.delta_mb = round(max(peak - self._start, 0) / 2**20, 1)


# ---------------------------------------------------------------------------------------------- scaling
def rotary_modules(model: nn.Module) -> list[PositionalEncoding]:
    """The PEs of ``model`` whose rotary frequencies can be rescaled (``caps.rotary_scalable``)."""
    return [m for m in model.modules() if isinstance(m, PositionalEncoding) and m.caps.rotary_scalable]


def resolve_scaling(
    scaling: dict[str, Any] | None, length: int, train_len: int | None
) -> dict[str, Any] | None:
    """A concrete ``pe.scaling`` dict for evaluation length ``length``.

    ``original_max_len`` defaults to the training length; ``factor: auto`` becomes
    ``max(1, length / original_max_len)`` (scale exactly to the evaluation length).
    """
    if not scaling or scaling.get("type") in (None, "none"):
        return None
    out = dict(scaling)
    if not out.get("original_max_len"):
        if train_len is None:
            raise ConfigError(
                f"eval.rope_scaling={scaling} needs original_max_len (the training length), and the "
                "checkpoint does not record one; set eval.rope_scaling.original_max_len."
            )
        out["original_max_len"] = int(train_len)
    if out.get("factor") in ("auto", None):
        out["factor"] = max(1.0, length / out["original_max_len"])
    return out


def set_rope_scaling(model: nn.Module, scaling: dict[str, Any] | None) -> int:
    """Set ``scaling`` on every rotary PE of ``model`` (and drop their cos/sin caches).

    Returns the number of PEs changed; raises :class:`ConfigError` for an invalid scaling.
    """
    mods = rotary_modules(model)
    for pe in mods:
        pe.set_scaling(scaling)
    return len(mods)


# ---------------------------------------------------------------------------------------------- LM windows
@dataclass
class Window:
    """One forward window: inputs ``stream[start : start+length]``, scoring its last ``n_scored`` targets."""

    start: int
    length: int
    n_scored: int


def nonoverlap_windows(n_tokens: int, length: int) -> list[Window]:
    """Consecutive chunks covering targets 1..n_tokens (the last one shorter if needed)."""
    out = [
        Window(s, min(length, n_tokens - s), min(length, n_tokens - s)) for s in range(0, n_tokens, length)
    ]
    return out


def sliding_windows(n_tokens: int, length: int, stride: int) -> list[Window]:
    """Windows of ``length`` ending ``stride`` apart; each scores the targets not scored before.

    Targets ``1..n_tokens`` are scored exactly once: the first window scores all of its ``length``
    targets, later ones their last ``stride`` (the last window is moved back to end at ``n_tokens``).
    """
    if n_tokens <= length:
        return [Window(0, n_tokens, n_tokens)]
    out, end = [Window(0, length, length)], length
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        out.append(Window(new_end - length, length, new_end - end))
        end = new_end
    return out


def _batches(windows: list[Window], batch: int) -> Iterator[list[Window]]:
    """Group windows of equal length into batches of at most ``batch``."""
    group: list[Window] = []
    for w in windows:
        if group and (len(group) == batch or group[0].length != w.length):
            yield group
            group = []
        group.append(w)
    if group:
        yield group


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def score_lm_windows(
    model: nn.Module,
    stream: Tensor,
    windows: list[Window],
    *,
    batch: int,
    curve_len: int | None = None,
    on_batch: Any = None,
) -> dict[str, Any]:
    """Sum of next-token NLL over the scored targets of ``windows``.

    ``stream`` (N,) long; window ``w`` feeds ``stream[w.start : w.start + w.length]`` and scores targets
    ``stream[w.start + 1 : ...]`` of its last ``w.n_scored`` positions. Returns ``nll_sum``,
    ``scored_tokens`` and (with ``curve_len``) ``position_nll`` / ``position_count`` (curve_len,).
    """
    device = _model_device(model)
    nll_sum, scored = 0.0, 0
    pos_sum = torch.zeros(curve_len or 0, dtype=torch.float64)
    pos_cnt = torch.zeros(curve_len or 0, dtype=torch.long)
    for group in _batches(windows, batch):
        T = group[0].length
        starts = torch.tensor([w.start for w in group])
        idx = starts.unsqueeze(1) + torch.arange(T + 1)  # (B, T+1)
        tokens = stream[idx].to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        n_scored = torch.tensor([w.n_scored for w in group], device=device)
        keep = torch.arange(T, device=device).unsqueeze(0) >= (T - n_scored).unsqueeze(1)  # (B, T)
        logits = model(inputs)  # (B, T, V)
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(
            len(group), T
        )
        nll = nll.masked_fill(~keep, 0.0)
        nll_sum += float(nll.double().sum())
        scored += int(keep.sum())
        if curve_len:
            pos_sum[:T] += nll.double().sum(0).cpu()
            pos_cnt[:T] += keep.sum(0).cpu()
        if on_batch is not None:
            on_batch()
    out: dict[str, Any] = {"nll_sum": nll_sum, "scored_tokens": scored}
    if curve_len:
        out["position_nll"], out["position_count"] = pos_sum, pos_cnt
    return out


def lm_stream(data: Any, n_tokens: int) -> Tensor:
    """A 1-D long token stream of at least ``n_tokens + 1`` tokens if the data has them (else all it has).

    ``data`` is a tensor, or an object with ``eval_stream()`` or a ``val_stream`` array (the LM
    datamodules of :mod:`posformer.data`: the validation split).
    """
    if isinstance(data, Tensor):
        stream = data
    elif hasattr(data, "eval_stream"):
        stream = data.eval_stream()
    elif getattr(data, "val_stream", None) is not None:
        stream = data.val_stream  # posformer.data LM modules: the validation split (numpy, maybe memmapped)
    else:
        raise ConfigError(
            f"LM evaluation needs a token stream, but the data object {type(data).__name__} has neither "
            "eval_stream() nor val_stream."
        )
    if not isinstance(stream, Tensor):
        import numpy as np

        stream = torch.from_numpy(np.asarray(stream[: n_tokens + 1], dtype=np.int64))
    stream = stream.reshape(-1).long()
    if stream.numel() < 2:
        raise ConfigError(f"the LM evaluation stream has {stream.numel()} tokens; need at least 2.")
    return stream


def default_n_tokens(settings: EvalSettings, available: int) -> tuple[int, str]:
    """Scored tokens per length: settings.n_tokens, or windows_at_max longest windows (data permitting)."""
    want = settings.n_tokens or settings.windows_at_max * settings.lengths[-1]
    note = ""
    if want > available:
        note = f"capped from {want} to the {available} tokens available in the evaluation stream"
        want = available
    return want, note


# ---------------------------------------------------------------------------------------------- tasks
def score_task_batch(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, float]:
    """Teacher-forced loss/accuracy of one batch (the data contract in docs/design.md).

    A sequence is exactly right when every scored label is the argmax prediction.
    """
    device = _model_device(model)
    batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
    if "src_ids" in batch:
        logits = model(batch["src_ids"], batch["tgt_ids"], batch.get("src_mask"), batch.get("tgt_mask"))
    else:
        logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
    labels = batch["labels"]
    mask = labels != -100
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    correct = (logits.argmax(-1) == labels) & mask
    has = mask.any(1)
    exact = ((correct | ~mask).all(1) & has).sum()
    return {
        "nll_sum": float(loss),
        "scored_tokens": int(mask.sum()),
        "correct_tokens": int(correct.sum()),
        "exact": int(exact),
        "n_sequences": int(has.sum()),
    }


# ---------------------------------------------------------------------------------------------- results
def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    atomic_write_bytes(path, data.encode() if isinstance(data, str) else data)  # posformer.io: fsync, cleanup


@dataclass
class Results:
    """Rows of results (one per checkpoint × scaling × mode × length) plus run metadata."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, out_dir: Path) -> Results:
        path = Path(out_dir) / RESULTS_JSON
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(rows=list(data.get("results", [])), meta=dict(data.get("meta", {})))

    def done_keys(self) -> set[str]:
        return {r["key"] for r in self.rows if r.get("status") in ("ok", "n/a")}

    def add(self, row: dict[str, Any]) -> None:
        self.rows = [r for r in self.rows if r["key"] != row["key"]] + [row]

    def save(self, out_dir: Path) -> None:
        """Write JSON, CSV and Markdown (atomically)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / RESULTS_JSON, json.dumps({"meta": self.meta, "results": self.rows}, indent=1))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
        atomic_write(out_dir / RESULTS_CSV, buf.getvalue())
        atomic_write(out_dir / RESULTS_MD, markdown_report(self))


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.3g}"
    return str(x)


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r["series"], None)
    return list(seen)


def markdown_report(results: Results) -> str:
    """Markdown tables: one per (task type, mode, metric); rows = series, columns = lengths."""
    lines = ["# Length extrapolation", ""]
    meta = results.meta
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    rows = results.rows
    lm_rows = [r for r in rows if r["task_type"] == "lm"]
    task_rows = [r for r in rows if r["task_type"] != "lm"]
    if lm_rows:
        toks = sorted({r["scored_tokens"] for r in lm_rows if r.get("scored_tokens")})
        lines += [
            f"Language modelling: perplexity (loss in nats) with the same number of scored tokens at every "
            f"length: {', '.join(map(str, toks)) or '–'}. `*` = training length; `n/a` = the PE cannot "
            "represent the length (reason below).",
            "",
        ]
        for mode in MODES:
            sub = [r for r in lm_rows if r["mode"] == mode]
            if sub:
                stride_note = ""
                if mode == "sliding":
                    strides = sorted({(r["length"], r["stride"]) for r in sub})
                    stride_note = " (stride: " + ", ".join(f"{s} @ {L}" for L, s in strides) + ")"
                lines += [f"## {mode}{stride_note}", ""] + _table(sub, "ppl", "loss") + [""]
    if task_rows:
        lines += ["Synthetic tasks: exact-match (token accuracy). `*` = in the training range.", ""]
        lines += ["## exact match", ""] + _table(task_rows, "exact_match", "token_acc") + [""]
    na = [r for r in rows if r["status"] == "n/a"]
    if na:
        lines += ["## Not applicable", ""]
        for reason in sorted({r["reason"] for r in na}):
            who = sorted({r["series"] for r in na if r["reason"] == reason})
            lens = sorted({r["length"] for r in na if r["reason"] == reason})
            lines.append(f"- {', '.join(who)} at lengths {lens}: {reason}")
        lines.append("")
    mem = [r for r in rows if r.get("peak_mem_mb") is not None and r["status"] == "ok"]
    if mem:
        lines += ["## Peak memory (MiB; process peak / increase during the length)", ""]
        lines += _table(mem, "peak_mem_mb", "peak_mem_delta_mb", digits=0, first=True) + [""]
    return "\n".join(lines)


def _table(
    rows: list[dict[str, Any]], main: str, second: str, digits: int = 3, first: bool = False
) -> list[str]:
    lengths = sorted({r["length"] for r in rows})
    series = _labels(rows)

    def head(L: int) -> str:
        flags = {r.get("in_distribution") for r in rows if r["length"] == L}
        return f"{L}*" if True in flags else str(L)

    out = ["| model | " + " | ".join(head(L) for L in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for s in series:
        cells = []
        for L in lengths:
            match = [r for r in rows if r["series"] == s and r["length"] == L]
            if first and len(match) > 1:
                match = match[:1]
            if not match:
                cells.append("")
                continue
            r = match[0]
            if r["status"] != "ok":
                cells.append("n/a")
            else:
                cells.append(f"{_fmt(r.get(main), digits)} ({_fmt(r.get(second), digits)})")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return out


# ---------------------------------------------------------------------------------------------- plots
def write_plots(results: Results, out_dir: Path, writer: Any = None) -> list[Path]:
    """Metric-vs-length plots (one line per series, training length marked) and per-position loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths: list[Path] = []
    ok = [r for r in results.rows if r["status"] == "ok"]
    panels: list[tuple[str, str, list[dict[str, Any]]]] = []
    for mode in MODES:
        sub = [r for r in ok if r["task_type"] == "lm" and r["mode"] == mode]
        if sub:
            panels.append((f"ppl_{mode}", "ppl", sub))
    tasks = [r for r in ok if r["task_type"] != "lm"]
    if tasks:
        panels += [("exact_match", "exact_match", tasks), ("token_acc", "token_acc", tasks)]
    for name, metric, sub in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s in _labels(sub):
            pts = sorted(
                (r["length"], r[metric]) for r in sub if r["series"] == s and r.get(metric) is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        _mark_train(ax, sub)
        ax.set_xscale("log", base=2)
        if metric == "ppl":
            ax.set_yscale("log")
        ax.set_xlabel("evaluation length")
        ax.set_ylabel(metric)
        ax.set_title(name.replace("_", " "))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"extrapolation_{name}.png"
        _save_fig(fig, path)
        if writer is not None:
            writer.add_figure(f"extrapolation/{name}", fig)
        plt.close(fig)
        paths.append(path)
    curves = [r for r in ok if r.get("position_loss")]
    if curves:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s in _labels(curves):
            r = max((r for r in curves if r["series"] == s), key=lambda r: r["length"])
            y = torch.tensor(r["position_loss"], dtype=torch.float64)
            k = max(1, len(y) // 64)
            if k > 1:  # moving average over k positions
                y = F.avg_pool1d(y.view(1, 1, -1), k, stride=k).view(-1)
            x = (torch.arange(len(y)) * k + (k - 1) / 2).tolist()
            ax.plot(x, y.tolist(), label=f"{s} (L={r['length']})")
        _mark_train(ax, curves)
        ax.set_xlabel("token position in window")
        ax.set_ylabel("loss (nats)")
        ax.set_title("loss per position (nonoverlap)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / "extrapolation_position_loss.png"
        _save_fig(fig, path)
        if writer is not None:
            writer.add_figure("extrapolation/position_loss", fig)
        plt.close(fig)
        paths.append(path)
    return paths


def _mark_train(ax: Any, rows: list[dict[str, Any]]) -> None:
    spans = {tuple(r["train_len"]) if isinstance(r["train_len"], list) else r["train_len"] for r in rows}
    spans.discard(None)
    for span in spans:
        if isinstance(span, tuple):
            ax.axvspan(span[0], span[-1], color="grey", alpha=0.15, label=f"train {span[0]}–{span[-1]}")
        else:
            ax.axvline(span, color="grey", ls="--", lw=1, label=f"train len {span}")


def _save_fig(fig: Any, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------- the harness
@contextlib.contextmanager
def _chunk_override(model: nn.Module, chunk_mb: int | None) -> Iterator[None]:
    cfg = getattr(model, "cfg", None)
    if chunk_mb is None or cfg is None:
        yield
        return
    old = cfg.attention_chunk_mb
    cfg.attention_chunk_mb = int(chunk_mb)
    try:
        yield
    finally:
        cfg.attention_chunk_mb = old


class _Progress:
    """A rich progress bar over (subject, length) pairs and the batches of the current one."""

    def __init__(self, enabled: bool, total_pairs: int):
        self.enabled = enabled
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self.pairs = self.bar.add_task("lengths", total=total_pairs)
            self.batches = self.bar.add_task("batches", total=1)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start(self, desc: str, n_batches: int) -> None:
        if self.bar is not None:
            self.bar.reset(self.batches, total=max(n_batches, 1), description=desc)

    def batch(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.batches)

    def pair(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.pairs)


def _base_row(subject: Subject, mode: str, length: int) -> dict[str, Any]:
    series = subject.label if subject.scaling_name == "none" else f"{subject.label} +{subject.scaling_name}"
    tl = subject.train_len
    return {
        "key": subject.key(mode, length),
        "label": subject.label,
        "series": series,
        "checkpoint": subject.checkpoint,
        "fingerprint": subject.fingerprint,
        "pe": subject.pe,
        "scaling": subject.scaling_name,
        "task_type": subject.task_type,
        "mode": mode,
        "length": length,
        "stride": None,
        "train_len": list(tl) if isinstance(tl, (list, tuple)) else tl,
        "in_distribution": in_distribution(length, tl),
        "status": "ok",
        "reason": "",
    }


def _stop_on_oom(
    subject: Subject,
    row: dict[str, Any],
    settings: EvalSettings,
    results: Results,
    out_dir: Path,
    exc: Exception,
) -> None:
    """Record an out-of-memory row (not 'done': a re-run retries it), save, raise a ResourceError."""
    length = row["length"]
    done = [r["length"] for r in results.rows if r.get("label") == row["label"] and r.get("status") == "ok"]
    row.update(status="oom", reason=f"out of memory: {str(exc).strip().splitlines()[0][:200]}")
    results.add(row)
    results.save(out_dir)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    raise ResourceError(
        f"out of memory evaluating {subject.label} at length {length} ({row['mode']}); the longest "
        f"length done is {max(done) if done else 'none'}. Results so far are in {out_dir / RESULTS_JSON}. "
        f"Fix: lower eval.batch_tokens (now {settings.batch_tokens}), set eval.attention_chunk_mb (e.g. 64), "
        f"or drop lengths >= {length}; re-run with eval.output_dir={out_dir} to continue from this length."
    ) from None


def evaluate_subjects(
    subjects: Iterable[Subject],
    settings: EvalSettings,
    out_dir: Path | str,
    *,
    fabric: Any = None,
    meta: dict[str, Any] | None = None,
    tensorboard: bool = True,
    plots: bool = True,
) -> Results:
    """Evaluate every subject at every length; write results after each (subject, length) pair.

    Pairs already in ``out_dir/extrapolation.json`` (status ok or n/a) are skipped. ``fabric`` (a
    ``lightning.Fabric``) places the models and sets the precision; ``None``: a CPU fp32 Fabric.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if fabric is None:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    subjects = list(subjects)
    results = Results.load(out_dir)
    stale = {(s.checkpoint, s.fingerprint) for s in subjects if s.checkpoint and s.fingerprint}
    if stale:  # results of an older version of a checkpoint file are evaluated again
        paths = {c for c, _ in stale}
        before = len(results.rows)
        results.rows = [
            r
            for r in results.rows
            if r.get("checkpoint") not in paths or (r["checkpoint"], r.get("fingerprint", "")) in stale
        ]
        results.meta["stale_rows_dropped"] = before - len(results.rows)
    done = results.done_keys()
    results.meta.update(meta or {})
    results.meta["settings"] = {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()
    }
    n_pairs = sum(
        len(settings.lengths) * (len(settings.modes) if s.task_type == "lm" else 1) for s in subjects
    )
    skipped = 0
    with _Progress(settings.progress, n_pairs) as progress:
        for subject in subjects:
            todo_modes = list(settings.modes) if subject.task_type == "lm" else ["task"]
            pending = [(m, L) for m in todo_modes for L in settings.lengths if subject.key(m, L) not in done]
            skipped += len(todo_modes) * len(settings.lengths) - len(pending)
            for _ in range(len(todo_modes) * len(settings.lengths) - len(pending)):
                progress.pair()
            if not pending:
                continue
            model = (
                fabric.setup_module(subject.model)
                if not hasattr(subject.model, "_forward_module")
                else subject.model
            )
            raw = subject.model
            raw.eval()
            with _chunk_override(raw, settings.attention_chunk_mb), torch.inference_mode():
                if subject.task_type == "lm":
                    _run_lm(subject, model, raw, pending, settings, results, out_dir, progress, fabric)
                else:
                    _run_tasks(subject, model, raw, pending, settings, results, out_dir, progress, fabric)
    results.meta["skipped_pairs"] = skipped
    results.save(out_dir)
    if plots:
        writer = None
        if tensorboard:
            writer = _tb_writer(out_dir)
            _log_scalars(results, writer)
        write_plots(results, out_dir, writer)
        if writer is not None:
            writer.close()
    return results


def _tb_writer(out_dir: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out_dir / "tensorboard"))


def _log_scalars(results: Results, writer: Any) -> None:
    for r in results.rows:
        if r["status"] != "ok":
            continue
        for metric in ("loss", "ppl", "exact_match", "token_acc", "peak_mem_mb"):
            if r.get(metric) is not None:
                tag = f"{metric}/{r['mode']}/{r['series']}".replace(" ", "_")
                writer.add_scalar(tag, r[metric], global_step=r["length"])


def _apply_length_scaling(subject: Subject, raw: nn.Module, length: int) -> None:
    if subject.scaling is None:
        return
    scaling = resolve_scaling(subject.scaling, length, train_len_max(subject.train_len))
    if set_rope_scaling(raw, scaling) == 0:
        raise ConfigError(
            f"eval.rope_scaling={subject.scaling} was given, but {subject.label} (pe={subject.pe!r}) has no "
            "rotary PE to scale; evaluate it without rope_scaling."
        )


def _run_lm(
    subject: Subject,
    model: Any,
    raw: nn.Module,
    pending: list[tuple[str, int]],
    settings: EvalSettings,
    results: Results,
    out_dir: Path,
    progress: _Progress,
    fabric: Any,
) -> None:
    want = settings.n_tokens or settings.windows_at_max * settings.lengths[-1]
    stream = lm_stream(subject.data, want)
    n_tokens, note = default_n_tokens(settings, stream.numel() - 1)
    if note:
        results.meta.setdefault("notes", []).append(f"{subject.label}: {note}")
    results.meta["scored_tokens_per_length"] = n_tokens
    for mode, L in pending:
        row = _base_row(subject, mode, L)
        stride = settings.stride_for(L) if mode == "sliding" else L
        row["stride"] = stride
        windows = (
            nonoverlap_windows(n_tokens, L) if mode == "nonoverlap" else sliding_windows(n_tokens, L, stride)
        )
        batch = max(1, settings.batch_tokens // L)
        progress.start(f"{subject.label} {mode} L={L}", -(-len(windows) // batch))
        t0 = time.perf_counter()
        meter = MemoryMeter(fabric.device)
        try:
            _apply_length_scaling(subject, raw, L)
            with meter:
                out = score_lm_windows(
                    model,
                    stream,
                    windows,
                    batch=batch,
                    curve_len=L if (settings.position_curves and mode == "nonoverlap") else None,
                    on_batch=progress.batch,
                )
        except PositionRangeError as exc:
            row.update(status="n/a", reason=str(exc))
        except Exception as exc:  # out of memory: record it, keep the results so far, stop clearly
            if not is_out_of_memory(exc):
                raise
            _stop_on_oom(subject, row, settings, results, out_dir, exc)
        else:
            loss = out["nll_sum"] / max(out["scored_tokens"], 1)
            row.update(
                loss=loss,
                ppl=math.exp(min(loss, 700.0)),
                scored_tokens=out["scored_tokens"],
                n_sequences=len(windows),
                peak_mem_mb=meter.peak_mb,
                peak_mem_delta_mb=meter.delta_mb,
            )
            if "position_nll" in out:
                cnt = out["position_count"].clamp(min=1).double()
                row["position_loss"] = [round(x, 5) for x in (out["position_nll"] / cnt).tolist()]
        row["seconds"] = round(time.perf_counter() - t0, 3)
        results.add(row)
        results.save(out_dir)
        progress.pair()


def _run_tasks(
    subject: Subject,
    model: Any,
    raw: nn.Module,
    pending: list[tuple[str, int]],
    settings: EvalSettings,
    results: Results,
    out_dir: Path,
    progress: _Progress,
    fabric: Any,
) -> None:
    lengths = [L for _, L in pending]
    loaders = subject.data.eval_dataloaders(lengths)
    for mode, L in pending:
        row = _base_row(subject, mode, L)
        loader = loaders.get(L) if hasattr(loaders, "get") else loaders[L]
        if loader is None:
            row.update(status="n/a", reason=f"the data module has no evaluation set for length {L}")
            results.add(row)
            results.save(out_dir)
            progress.pair()
            continue
        n_batches = len(loader) if hasattr(loader, "__len__") else 0
        if settings.max_batches:
            n_batches = min(n_batches, settings.max_batches) if n_batches else settings.max_batches
        progress.start(f"{subject.label} task L={L}", n_batches)
        totals = {"nll_sum": 0.0, "scored_tokens": 0, "correct_tokens": 0, "exact": 0, "n_sequences": 0}
        t0 = time.perf_counter()
        meter = MemoryMeter(fabric.device)
        try:
            _apply_length_scaling(subject, raw, L)
            with meter:
                for i, batch in enumerate(loader):
                    if settings.max_batches and i >= settings.max_batches:
                        break
                    for k, v in score_task_batch(model, batch).items():
                        totals[k] += v
                    progress.batch()
        except PositionRangeError as exc:
            row.update(status="n/a", reason=str(exc))
        except Exception as exc:  # out of memory: record it, keep the results so far, stop clearly
            if not is_out_of_memory(exc):
                raise
            _stop_on_oom(subject, row, settings, results, out_dir, exc)
        else:
            tok = max(totals["scored_tokens"], 1)
            row.update(
                loss=totals["nll_sum"] / tok,
                exact_match=totals["exact"] / max(totals["n_sequences"], 1),
                token_acc=totals["correct_tokens"] / tok,
                scored_tokens=totals["scored_tokens"],
                n_sequences=totals["n_sequences"],
                peak_mem_mb=meter.peak_mb,
                peak_mem_delta_mb=meter.delta_mb,
            )
        row["seconds"] = round(time.perf_counter() - t0, 3)
        results.add(row)
        results.save(out_dir)
        progress.pair()


# ---------------------------------------------------------------------------------------------- checkpoints
def find_checkpoints(sweep_dir: Path | str, which: str = "best") -> list[Path]:
    """One checkpoint per run under ``sweep_dir`` (found by globbing ``**/checkpoints/*.ckpt``).

    ``which="last"``: each run's ``last.ckpt`` (or its newest file); ``"best"``: the best model path
    recorded by Lightning's ``ModelCheckpoint`` in the run's checkpoints, if that file exists, else the
    newest non-``last`` checkpoint, else ``last.ckpt``.
    """
    if which not in ("best", "last"):
        raise ConfigError(f"eval.which={which!r}; valid: best, last.")
    root = Path(sweep_dir)
    if not root.is_dir():
        raise CheckpointError(f"eval.sweep_dir={str(root)!r} is not a directory.")
    runs: dict[Path, list[Path]] = {}
    for path in sorted(root.glob("**/checkpoints/*.ckpt")):
        runs.setdefault(path.parent, []).append(path)
    if not runs:
        raise CheckpointError(f"no checkpoints (**/checkpoints/*.ckpt) under eval.sweep_dir={str(root)!r}.")
    chosen = []
    for files in runs.values():
        last = [f for f in files if f.name.startswith("last")]
        others = sorted((f for f in files if not f.name.startswith("last")), key=lambda f: f.stat().st_mtime)
        if which == "last":
            chosen.append(last[0] if last else max(files, key=lambda f: f.stat().st_mtime))
            continue
        best = _recorded_best(last[0] if last else others[-1])
        if best is not None and best.exists():
            chosen.append(best)
        else:
            chosen.append(others[-1] if others else last[0])
    return chosen


def _recorded_best(path: Path) -> Path | None:
    try:
        ckpt = safe_load_checkpoint(path, verify=False)  # weights_only=True: never runs code
    except Exception:
        return None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if "ModelCheckpoint" in str(key) and isinstance(state, dict) and state.get("best_model_path"):
            best = Path(state["best_model_path"])
            if not best.is_absolute() or not best.exists():
                best = path.parent / best.name
            return best
    return None


def _get(d: Any, *paths: str, default: Any = None) -> Any:
    """The first ``a.b.c`` path present in nested dicts / configs ``d``."""
    for p in paths:
        cur = d
        for part in p.split("."):
            if cur is None:
                break
            cur = cur.get(part) if isinstance(cur, dict) else getattr(cur, part, None)
        if cur is not None:
            return cur
    return default


def _plain(x: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, (DictConfig, ListConfig)):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return copy.deepcopy(x)


@dataclass
class LoadedCheckpoint:
    """A model restored from a checkpoint, with what the harness needs to know about its training."""

    path: str
    model: nn.Module
    model_cfg: dict[str, Any]
    data_cfg: dict[str, Any]
    seed: int
    hparams: dict[str, Any]

    @property
    def pe(self) -> str:
        return str(self.model_cfg.get("pe", ""))

    @property
    def train_len(self) -> int | tuple[int, int] | None:
        return train_length(self.data_cfg)


def train_length(data_cfg: dict[str, Any]) -> int | tuple[int, int] | None:
    """The training length from a data config: ``train_len`` (int, or ``[min, max]`` / ``{min:, max:}``)."""
    for key in ("train_len", "train_length", "block_size", "seq_len"):
        v = data_cfg.get(key) if isinstance(data_cfg, dict) else None
        if v is None:
            continue
        if isinstance(v, dict):
            lo, hi = v.get("min", v.get("low")), v.get("max", v.get("high"))
            return (int(lo), int(hi)) if lo is not None else int(hi)
        if isinstance(v, (list, tuple)):
            return (int(v[0]), int(v[-1])) if len(v) > 1 and v[0] != v[-1] else int(v[-1])
        return int(v)
    for lo_key, hi_key in (("train_min_len", "train_max_len"), ("min_len", "max_len")):
        if isinstance(data_cfg, dict) and data_cfg.get(hi_key) is not None:
            return (int(data_cfg.get(lo_key) or 1), int(data_cfg[hi_key]))
    return None


def _run_config(ckpt_path: Path) -> dict[str, Any]:
    """The training run's config (``<run>/config.yaml`` or ``<run>/.hydra/config.yaml``) as a dict, or {}."""
    run = ckpt_path.resolve().parent.parent
    for cand in (run / "config.yaml", run / ".hydra" / "config.yaml"):
        if cand.is_file():
            try:
                from omegaconf import OmegaConf

                cfg = OmegaConf.load(cand)
                try:
                    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
                except Exception:  # interpolations that need Hydra (.hydra/config.yaml)
                    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]
            except Exception:
                continue
    return {}


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu") -> LoadedCheckpoint:
    """Restore the model of a training checkpoint (a Lightning ``.ckpt``).

    The model config is read from the saved hyper-parameters (``model`` or ``cfg.model``); the weights
    are the ``state_dict`` entries under the LightningModule's ``model.`` prefix. The data config and
    seed come from the run directory's ``config.yaml`` (``<run>/checkpoints/x.ckpt`` -> ``<run>/config.yaml``)
    if there is one, else from the hyper-parameters.
    """
    from posformer.model import ModelConfig, build_model

    path = Path(path)
    ckpt = safe_load_checkpoint(path, map_location)  # weights_only=True; missing/corrupt -> CheckpointError
    hp = _plain(ckpt.get("hyper_parameters") or {})
    model_cfg = _get(hp, "model_cfg", "cfg.model", "config.model", "model")
    if not isinstance(model_cfg, dict):
        raise CheckpointError(
            f"checkpoint {str(path)!r} records no model config in its hyper_parameters (looked for model, "
            f"cfg.model); keys present: {sorted(hp)}."
        )
    run_cfg = _run_config(path)  # the run's resolved config.yaml (posformer-train writes it), if present
    data_cfg = (
        _get(run_cfg, "data") or _get(hp, "data_cfg", "cfg.data", "config.data", "data", default={}) or {}
    )
    seed = int(_get(run_cfg, "seed") or _get(hp, "seed", "cfg.seed", "config.seed", default=0) or 0)
    if train_length(data_cfg) is None and train_length(_get(hp, "data", default={}) or {}) is not None:
        data_cfg = {**data_cfg, "train_length": train_length(hp["data"])}
    known = set(ModelConfig.__dataclass_fields__)
    mc = ModelConfig(**{k: v for k, v in model_cfg.items() if k in known})
    model = build_model(mc)
    state = ckpt.get("state_dict") or {}
    prefix = next((p for p in ("model.", "net.", "") if any(k.startswith(p) for k in state)), "")
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model built from its config: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}."
        )
    model.eval()
    return LoadedCheckpoint(str(path), model, {**mc.to_dict()}, dict(data_cfg), seed, hp)
