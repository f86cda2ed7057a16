"""Language-model scoring on one token stream: the windows of each mode and their summed loss.

Every length ``L`` scores the *same* number of targets ``n_tokens`` (targets ``1 .. n_tokens`` of the
stream, each exactly once):

- ``nonoverlap``: consecutive length-``L`` chunks; every token of every chunk is scored (early tokens
  of a chunk have little context).
- ``sliding``: windows of length ``L`` moved by a stride ``S``; the first window scores all of its
  tokens, every later one only its last ``S`` (the last window is moved back to end at the stream
  end). With ``S = L`` this equals ``nonoverlap``.

Data with ``data.eval_windows=documents`` (long-document corpora) keeps every window inside one
document (:func:`document_windows`): ``nonoverlap`` takes the whole windows of each document in turn
(the training run's own evaluation takes the same), ``sliding`` slides within each; documents shorter
than ``L + 1`` tokens are skipped, so a length scores up to ``n_tokens`` targets, as many as its
documents hold (each row states its ``scored_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posformer.data.lm import document_starts
from posformer.devices import module_device
from posformer.errors import ConfigError
from posformer.eval.parallel import combine, counts_here, split_window
from posformer.eval.settings import EvalSettings
from posformer.model.parallel import ContextParallel

#: the status of a row whose length the evaluation stream cannot fill with one window (retried on a re-run)
TOO_LONG = "too_long"


def too_long_reason(length: int, available: int) -> str:
    """Why a length was not evaluated: the stream holds ``available`` targets, one window needs ``length``."""
    return (
        f"the evaluation stream has {available + 1} tokens, and one window of length {length} needs "
        f"{length + 1}; evaluate lengths <= {available}, or give more validation data (e.g. "
        "eval.data={val_fraction: 0.2} or a longer data file)"
    )


#: the note of an evaluation whose windows stay inside documents
DOCUMENT_NOTE = (
    "windows inside documents (data.eval_windows=documents): each length scores up to the target count, as "
    "many as documents of at least length + 1 tokens hold (scored_tokens per row)"
)


def too_long_in_documents(length: int) -> str:
    """Why a length has no window inside one document."""
    return (
        f"no validation document holds {length + 1} tokens, and data.eval_windows=documents keeps windows "
        "inside one document; evaluate shorter lengths, use a corpus of longer documents, or score windows "
        "anywhere in the stream with eval.data={eval_windows: stream}"
    )


@dataclass
class Window:
    """One forward window: inputs ``stream[start : start+length]``, scoring its last ``n_scored`` targets."""

    start: int
    length: int
    n_scored: int


def nonoverlap_windows(n_tokens: int, length: int) -> list[Window]:
    """Consecutive chunks covering targets 1..n_tokens (the last one shorter if needed)."""
    return [
        Window(s, min(length, n_tokens - s), min(length, n_tokens - s)) for s in range(0, n_tokens, length)
    ]


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


def mode_windows(mode: str, n_tokens: int, length: int, stride: int) -> list[Window]:
    """The windows of ``mode`` (``nonoverlap`` or ``sliding``) over targets ``1..n_tokens``."""
    if mode == "nonoverlap":
        return nonoverlap_windows(n_tokens, length)
    return sliding_windows(n_tokens, length, stride)


def document_ends(data: Any) -> np.ndarray | None:
    """``(D,)`` where each validation document ends, when ``data`` keeps evaluation windows inside
    documents (``data.eval_windows=documents``); ``None`` otherwise."""
    if getattr(data, "eval_windows", "stream") != "documents":
        return None
    return np.asarray(data.val_stream.documents(), dtype=np.int64)


def document_windows(mode: str, ends: np.ndarray, n_tokens: int, length: int, stride: int) -> list[Window]:
    """The windows of ``mode`` inside each document (``ends``: ``(D,)``), in order, scoring at most
    ``n_tokens`` targets; documents under ``length + 1`` tokens have none."""
    if mode == "nonoverlap":
        return [Window(int(s), length, length) for s in document_starts(ends, length, n_tokens)]
    out: list[Window] = []
    have, begin = 0, 0
    for end in ends.tolist():
        if end - begin - 1 >= length:
            for w in sliding_windows(end - begin - 1, length, stride):
                n = min(w.n_scored, n_tokens - have)
                if n <= 0:
                    break
                out.append(Window(begin + w.start, w.length, n))
                have += n
        begin = end
        if have >= n_tokens:
            break
    return out


def window_batches(windows: list[Window], batch: int) -> Iterator[list[Window]]:
    """Group consecutive windows of equal length into batches of at most ``batch``."""
    group: list[Window] = []
    for w in windows:
        if group and (len(group) == batch or group[0].length != w.length):
            yield group
            group = []
        group.append(w)
    if group:
        yield group


def score_lm_windows(
    model: nn.Module,
    stream: Tensor,
    windows: list[Window],
    *,
    batch: int,
    curve_len: int | None = None,
    on_batch: Callable[[], None] | None = None,
    parallel: ContextParallel | None = None,
) -> dict[str, Any]:
    """Sum of next-token NLL over the scored targets of ``windows``.

    ``stream`` (N,) long; window ``w`` feeds ``stream[w.start : w.start + w.length]`` and scores targets
    ``stream[w.start + 1 : ...]`` of its last ``w.n_scored`` positions. Returns ``nll_sum``,
    ``scored_tokens`` and (with ``curve_len``) ``position_nll`` / ``position_count`` (curve_len,).
    ``on_batch`` is called after every forward pass. With ``parallel`` (a context-parallel group, every
    process of it calling with the same arguments) each window is split across the group
    (:mod:`posformer.eval.parallel`) and the returned sums are the whole windows', on every rank.
    """
    device = module_device(model)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)  # read once, after the last batch
    scored = torch.zeros((), dtype=torch.long, device=device)
    pos_sum = torch.zeros(curve_len or 0, dtype=torch.float64, device=device)  # summed on the device
    pos_cnt = torch.zeros(curve_len or 0, dtype=torch.long, device=device)
    for group in window_batches(windows, batch):
        T = group[0].length
        starts = torch.tensor([w.start for w in group], device=stream.device)  # (B,)
        idx = starts.unsqueeze(1) + torch.arange(T + 1, device=stream.device)  # (B, T+1)
        tokens = stream[idx].to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
        n_scored = torch.tensor([w.n_scored for w in group], device=device)  # (B,)
        keep = torch.arange(T, device=device).unsqueeze(0) >= (T - n_scored).unsqueeze(1)  # (B, T)
        split, s, e, (inputs, targets, keep) = split_window(parallel, inputs, targets, keep)  # (B, e-s)
        if counts_here(parallel, split):  # a window not split is scored by rank 0 alone
            logits = model(inputs, parallel=parallel) if split else model(inputs)  # (B, e-s, V)
            nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(
                len(group), e - s
            )  # (B, e-s)
            nll = nll.masked_fill(~keep, 0.0)
            nll_sum += nll.double().sum()
            scored += keep.sum()
            if curve_len:
                pos_sum[s:e] += nll.double().sum(0)
                pos_cnt[s:e] += keep.sum(0)
        if on_batch is not None:
            on_batch()
    nll_sum, scored, pos_sum, pos_cnt = combine(parallel, nll_sum, scored, pos_sum, pos_cnt)
    out: dict[str, Any] = {"nll_sum": float(nll_sum), "scored_tokens": int(scored)}
    if curve_len:
        out["position_nll"], out["position_count"] = pos_sum.cpu(), pos_cnt.cpu()
    return out


def lm_stream(data: Any, n_tokens: int) -> Tensor:
    """A 1-D long token stream ``(N,)`` of at least ``n_tokens + 1`` tokens if the data has them (else all).

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


def training_scored_tokens(data: Any) -> int | None:
    """The tokens the training run scored per length in its own final evaluation (``results.md``), or
    ``None`` when the data does not say (no ``eval_tokens``: a bare tensor, a task).

    The rule of :meth:`posformer.data.lm.LMDataModule.eval_dataloaders` over the training's lengths
    (``data.eval_lengths`` and the training length): ``min(eval_tokens, validation tokens - 1)``, rounded
    down to a multiple of the longest of those lengths.
    """
    eval_tokens = getattr(data, "eval_tokens", None)
    stream = getattr(data, "val_stream", None)
    if eval_tokens is None or stream is None:
        return None
    lengths = {int(v) for v in getattr(data, "eval_lengths", None) or []}
    lengths |= {int(getattr(data, "train_length", 0) or 0)} - {0}
    n = min(int(eval_tokens), len(stream) - 1)
    longest = max(lengths, default=0)
    if longest and n >= longest:
        n -= n % longest
    return n


def default_n_tokens(settings: EvalSettings, available: int, trained: int | None = None) -> tuple[int, str]:
    """Scored tokens per length, and a note (empty unless the count differs from what was asked).

    ``settings.n_tokens`` when set; else ``trained`` (:func:`training_scored_tokens`: the same tokens as
    the training run's ``results.md``), raised to the longest length so that it fills one window; else
    ``windows_at_max`` windows of the longest length. Capped to the ``available`` targets of the stream.
    """
    longest = settings.lengths[-1]
    notes = []
    if settings.n_tokens:
        want = settings.n_tokens
    elif trained:
        want = max(trained, longest)
        if want != trained:
            notes.append(
                f"raised from the training run's {trained} scored tokens to the longest length {longest}"
            )
    else:
        want = settings.wanted_tokens()
    if want > available:
        notes.append(f"capped from {want} to the {available} tokens available in the evaluation stream")
        want = available
    return want, "; ".join(notes)
