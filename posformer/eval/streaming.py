"""StreamingLLM-style language-model scoring (Xiao et al. 2024, "Efficient Streaming Language Models
with Attention Sinks"), for any PE: ``eval.streaming={sink: 4, window: 256}``.

Each length-``L`` window of the ``nonoverlap``/``sliding`` modes is read as a stream through a bounded
KV cache that keeps the first ``sink`` tokens (the attention sinks) and the ``window`` most recent
tokens, the current one included. The token at window offset ``t`` is predicted from

- ``t < sink + window``: the whole prefix ``0 … t`` (the cache is not full yet), one forward for all;
- otherwise: tokens ``0 … sink-1`` and ``t-window+1 … t``, one forward per scored token.

Positions (``positions``):

- ``cache`` (default, as StreamingLLM): the positions *inside the cache*, ``0 … sink+window-1``, so a
  PE never sees a position past ``sink + window - 1`` however long the stream (StreamingLLM stores
  keys before rotation and rotates them at their cache slot; a bias PE likewise sees cache distances).
  Recent tokens keep their true distances to the query, the sinks look ``window`` tokens away.
- ``original``: each kept token keeps its position in the window, ``0 … sink-1`` and
  ``t-window+1 … t``: the attention pattern of sinks + a sliding window, without re-positioning.

With ``sink + window >= L`` both equal the ``nonoverlap`` score bit for bit (one full forward per
window). The cost is one forward of ``sink + window`` tokens per scored token past the cache size:
about ``(sink + window)`` times that of ``nonoverlap``, batched ``eval.batch_tokens`` tokens at a time.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.devices import module_device
from posformer.errors import ConfigError

#: the LM mode name of streaming rows
STREAMING = "streaming"
#: how kept tokens are positioned: in the cache (StreamingLLM) or at their place in the window
POSITIONS = ("cache", "original")


@dataclass(frozen=True)
class StreamingSpec:
    """``sink`` first tokens kept (>= 0), ``window`` most recent ones (>= 1), their ``positions``."""

    sink: int
    window: int
    positions: str = "cache"

    @property
    def budget(self) -> int:
        """Cache entries: ``sink + window`` (the longest forward)."""
        return self.sink + self.window

    def label(self) -> str:
        return f"sink {self.sink} + window {self.window}, {self.positions} positions"


def parse_streaming(value: Any) -> StreamingSpec | None:
    """``eval.streaming`` -> a spec, ``None`` when off (null or ``{}``); one-line errors for bad values."""
    if value is None or isinstance(value, StreamingSpec):
        return value
    example = "eval.streaming={sink: 4, window: 256}"
    if not isinstance(value, Mapping):
        raise ConfigError(f"eval.streaming={value!r} must be a mapping or null, e.g. {example}.")
    if not value:
        return None
    unknown = sorted(set(value) - {"sink", "window", "positions"})
    if unknown:
        raise ConfigError(
            f"eval.streaming has unknown key(s) {unknown}; valid: sink, window, positions ({example})."
        )
    sink, window = value.get("sink", 4), value.get("window")

    def is_int(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if not is_int(sink) or sink < 0:
        raise ConfigError(
            f"eval.streaming.sink={sink!r} must be an integer >= 0 (first tokens kept), e.g. {example}."
        )
    if not is_int(window) or window < 1:
        raise ConfigError(
            f"eval.streaming.window={window!r} must be an integer >= 1 (recent tokens kept), e.g. {example}."
        )
    positions = value.get("positions", "cache")
    if positions not in POSITIONS:
        raise ConfigError(
            f"eval.streaming.positions={positions!r} must be one of {', '.join(POSITIONS)} (cache: positions "
            "inside the rolling cache, as StreamingLLM; original: each token's place in the window)."
        )
    return StreamingSpec(int(sink), int(window), positions)


@dataclass(frozen=True)
class _View:
    """One forward: ``length`` inputs of the window at stream index ``start``; ``t`` is the offset of the
    one scored token (its target is ``start + t + 1``), or ``-1`` for the prefix view that scores its
    offsets ``>= first``."""

    start: int
    length: int
    t: int = -1
    first: int = 0


def streaming_views(windows: list[Any], spec: StreamingSpec) -> list[_View]:
    """The forwards that score ``windows`` (``start``, ``length``, ``n_scored``: the last ``n_scored``
    targets of each window) as streams through a cache of ``spec.budget`` entries."""
    out: list[_View] = []
    for w in windows:
        first = w.length - w.n_scored  # offsets >= first are scored
        prefix = min(w.length, spec.budget)
        if first < prefix:
            out.append(_View(w.start, prefix, -1, first))
        out.extend(_View(w.start, spec.budget, t) for t in range(max(first, prefix), w.length))
    return out


def _batches(views: list[_View], size: int) -> list[list[_View]]:
    """Consecutive views of one kind and length, at most ``size`` per batch."""
    out: list[list[_View]] = []
    for v in views:
        last = out[-1] if out else None
        if last and len(last) < size and last[0].length == v.length and (last[0].t < 0) == (v.t < 0):
            last.append(v)
        else:
            out.append([v])
    return out


def _offsets(group: list[_View], spec: StreamingSpec, device: torch.device) -> Tensor:
    """Window offsets (B, T) of the inputs of ``group``: the prefix, or sinks + the recent window."""
    T = group[0].length
    if group[0].t < 0:
        return torch.arange(T, device=device).expand(len(group), T)
    t = torch.tensor([v.t for v in group], device=device).unsqueeze(1)  # (B, 1)
    recent = t - spec.window + 1 + torch.arange(spec.window, device=device)  # (B, W)
    sinks = torch.arange(spec.sink, device=device).expand(len(group), spec.sink)  # (B, S)
    return torch.cat((sinks, recent), dim=1)  # (B, S + W)


def score_streaming(
    model: nn.Module,
    stream: Tensor,
    windows: list[Any],
    *,
    spec: StreamingSpec,
    batch: int,
    curve_len: int | None = None,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Sum of next-token NLL over the scored targets of ``windows``, each window read as a stream
    through the cache of ``spec``; the signature and result of
    :func:`posformer.eval.windows.score_lm_windows` (``batch`` windows of ``windows[0].length`` tokens
    per forward becomes the same token budget in views of ``spec.budget`` tokens; ``curve_len`` unused).
    """
    device = module_device(model)
    views = streaming_views(windows, spec)
    tokens_per_forward = batch * max((w.length for w in windows), default=1)
    size = max(1, tokens_per_forward // spec.budget)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)  # read once, after the last batch
    scored = torch.zeros((), dtype=torch.long, device=device)
    for group in _batches(views, size):
        offsets = _offsets(group, spec, stream.device)  # (B, T)
        starts = torch.tensor([v.start for v in group], device=stream.device).unsqueeze(1)  # (B, 1)
        inputs = stream[starts + offsets].to(device)  # (B, T)
        targets = stream[starts + offsets + 1].to(device)  # (B, T); only the scored ones are used
        B, T = inputs.shape
        if group[0].t < 0:  # prefix: every offset >= first of its window
            first = torch.tensor([v.first for v in group], device=device).unsqueeze(1)  # (B, 1)
            keep = torch.arange(T, device=device).unsqueeze(0) >= first  # (B, T)
        else:  # one token per view: the last input
            keep = torch.zeros(B, T, dtype=torch.bool, device=device)
            keep[:, -1] = True
        positions = offsets.to(device) if spec.positions == "original" else None  # None: 0 … T-1
        logits = model(inputs, positions=positions)  # (B, T, V)
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(B, T)
        nll_sum += nll.masked_fill(~keep, 0.0).double().sum()
        scored += keep.sum()
        if on_batch is not None:
            on_batch()
    return {"nll_sum": float(nll_sum), "scored_tokens": int(scored), "n_forwards": len(views)}
