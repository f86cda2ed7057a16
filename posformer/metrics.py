"""The metrics: what each one is computed from, how it reads in a table and a figure, and how seeds are
aggregated — the one registry every results file, table, figure and logger reads.

A :class:`Metric` names the summed statistics it is computed from (:data:`SUMS`, added over batches,
lengths and ranks before dividing; :func:`sequence_stats` makes them for a teacher-forced batch), its
reduction, whether higher is better, its header, decimals and axis label, and the task types whose
results tables show it. :data:`REGISTRY` holds them in their file order; :func:`names` and
:func:`table_metrics` are the lists of names everything else takes:

    names()                  # exact_match, token_acc, loss, ppl: training's results files
    names(lead="lm")         # loss, ppl, exact_match, token_acc: posformer-eval's files
    table_metrics("lm")      # loss, ppl, token_acc: an LM's results table
    reduce(stats)            # summed statistics -> every metric computed from them

:func:`aggregate` is the one mean ± std over seeds: a pandas ``groupby(...).agg`` of the mean, the
sample standard deviation and the count per group, groups in first-seen order. A value that is
missing (``None``, NaN: a row that did not run) counts in no mean; the standard deviation of a single
value is undefined (NaN, an empty cell — never 0.0). The mean is :func:`statistics.fmean` (a correctly
rounded sum) and the standard deviation :func:`statistics.stdev`, so the figures do not depend on the
order of the seeds' values; pandas' own ``mean``/``std`` (Kahan and Welford) differ from them in the
last bit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch.nn.functional as F
from torch import Tensor

#: the summed statistics of a scored batch (:func:`sequence_stats`), in the order they are reduced
SUMS = ("loss_sum", "n_tokens", "n_correct_tokens", "n_sequences", "n_exact")
#: the loss past which perplexity is not computed (``exp`` stays within float64)
PPL_MAX_LOSS = 700.0


def perplexity(loss: float) -> float:
    """``exp(loss)``, the loss capped at :data:`PPL_MAX_LOSS` (NaN stays NaN)."""
    return math.exp(min(loss, PPL_MAX_LOSS))


@dataclass(frozen=True)
class Metric:
    """One metric: its computation, its place in tables and figures."""

    name: str
    #: the metric in prose, titles and axis labels (``token accuracy``)
    title: str
    #: the unit of a figure's axis (``"token accuracy (fraction of tokens)"``)
    unit: str
    #: decimals in a results table; ``brief``: in a table of this metric alone (console, over seeds)
    digits: int
    brief: int
    #: ``True``: higher is better; ``False``: lower; ``None``: a count
    higher_is_better: bool | None
    #: the task type the metric belongs to (``task``, ``lm``), or ``count`` / ``cost``
    kind: str
    #: the task types whose results tables show it
    tables: tuple[str, ...] = ()
    #: the summed statistics it is computed from (one: a count; two: their ratio, NaN over 0; none:
    #: measured, not computed) and ``exp`` of that ratio (perplexity)
    sums: tuple[str, ...] = ()
    exp: bool = False
    #: the metric a task type's one-metric tables and figures show
    headline: bool = False
    #: the column header of a results table (default: the title)
    header: str = ""
    #: figures draw it on a log axis
    log_axis: bool = False
    #: training's progress bar shows it
    progress: bool = False

    def __post_init__(self) -> None:
        if not self.header:
            object.__setattr__(self, "header", self.title)

    def reduce(self, stats: Mapping[str, float]) -> float:
        """The metric from summed statistics holding its :attr:`sums`."""
        if len(self.sums) == 1:
            return int(stats[self.sums[0]])
        den = float(stats[self.sums[1]])
        ratio = float(stats[self.sums[0]]) / den if den else float("nan")
        return perplexity(ratio) if self.exp else ratio

    @property
    def axis(self) -> str:
        """The axis label with its unit."""
        return f"{self.title} ({self.unit})"

    @property
    def fraction(self) -> bool:
        """Whether the values lie in [0, 1] (figures draw them so)."""
        return self.unit.startswith("fraction")


_LM = ("lm", "translation")
_ALL = ("task", *_LM)
_TASK: dict[str, Any] = {"higher_is_better": True, "kind": "task", "digits": 4, "brief": 3}
_COUNT: dict[str, Any] = {"higher_is_better": None, "kind": "count", "digits": 0, "brief": 0}
REGISTRY: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "exact_match",
            "exact match",
            "fraction of sequences",
            **_TASK,
            tables=("task",),
            sums=("n_exact", "n_sequences"),
            headline=True,
            progress=True,
        ),
        Metric(
            "token_acc",
            "token accuracy",
            "fraction of tokens",
            **_TASK,
            tables=_ALL,
            sums=("n_correct_tokens", "n_tokens"),
            header="token acc",
        ),
        Metric(
            "loss", "loss", "nats / token", 4, 3, False, "lm", _ALL, ("loss_sum", "n_tokens"), progress=True
        ),
        Metric(
            "ppl",
            "perplexity",
            "log scale",
            3,
            2,
            False,
            "lm",
            _LM,
            ("loss_sum", "n_tokens"),
            exp=True,
            headline=True,
            header="ppl",
            log_axis=True,
        ),
        Metric("n_sequences", "sequences", "count", **_COUNT, sums=("n_sequences",)),
        Metric("n_tokens", "tokens", "count", **_COUNT, sums=("n_tokens",)),
        Metric("peak_mem_mb", "peak memory", "MiB", 0, 0, False, "cost"),
    )
}


def names(lead: str = "task", kinds: Sequence[str] = ("task", "lm")) -> list[str]:
    """The metrics of ``kinds`` in file order, those of the ``lead`` task type first (training's files
    lead with the task metrics, posformer-eval's with the language-model ones)."""
    chosen = [m for m in REGISTRY.values() if m.kind in kinds]
    return [m.name for m in chosen if m.kind == lead] + [m.name for m in chosen if m.kind != lead]


def _kind(task_type: str) -> str:
    """The metrics' kind of a task type: ``lm`` for language models and translation, else ``task``."""
    return "lm" if task_type in _LM else "task"


def table_metrics(task_type: str) -> list[str]:
    """The metric columns of ``task_type``'s results tables: its own metrics first."""
    known = task_type if task_type in _ALL else "task"
    return [n for n in names(_kind(known)) if known in REGISTRY[n].tables]


def headline(task_type: str) -> Metric:
    """The one metric of ``task_type``'s one-metric tables and figures (exact match, perplexity)."""
    return next(m for m in REGISTRY.values() if m.headline and m.kind == _kind(task_type))


def reduce(stats: Mapping[str, float]) -> dict[str, float]:
    """Summed statistics -> every metric computed from the ones ``stats`` holds."""
    return {m.name: m.reduce(stats) for m in REGISTRY.values() if m.sums and all(s in stats for s in m.sums)}


def sequence_stats(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Summed statistics of one teacher-forced batch — the one scorer of training-time evaluation and
    ``posformer-eval``'s tasks.

    ``logits`` (B, T, V), ``labels`` (B, T) with ``-100`` unscored. Returns 0-d float64 tensors (keys
    :data:`SUMS`): ``loss_sum`` (cross-entropy summed over scored tokens, no label smoothing),
    ``n_tokens``, ``n_correct_tokens`` (argmax == label), ``n_sequences`` (rows with at least one scored
    token) and ``n_exact`` (rows whose scored tokens are all correct). Nothing is read back to the host.
    """
    scored = labels != -100  # (B, T)
    loss_sum = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    correct = (logits.argmax(-1) == labels) & scored
    has = scored.any(1)
    exact = (correct.sum(1) == scored.sum(1)) & has
    out = {
        "loss_sum": loss_sum,
        "n_tokens": scored.sum(),
        "n_correct_tokens": correct.sum(),
        "n_sequences": has.sum(),
        "n_exact": exact.sum(),
    }
    return {k: v.detach().double() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------- seeds
def _mean(values: pd.Series) -> float:
    present = values.dropna().tolist()
    return statistics.fmean(present) if present else float("nan")


def _std(values: pd.Series) -> float:
    present = values.dropna().tolist()
    return statistics.stdev(present) if len(present) > 1 else float("nan")


#: the statistics of every aggregated value: mean, sample standard deviation, number of values
STATS: dict[str, Any] = {"mean": _mean, "std": _std, "n": "count"}


def aggregate(
    rows: pd.DataFrame | Iterable[Mapping[str, Any]],
    by: Sequence[str],
    values: Sequence[str],
    *,
    sort_rest: bool = False,
    **extra: Any,
) -> pd.DataFrame:
    """One row per group of ``by`` (first-seen order; ``sort_rest``: first-seen order of ``by[0]``, then
    sorted by the other keys): ``<value>_mean``, ``<value>_std``, ``<value>_n`` for each of ``values``
    (absent or ``None``: missing), after ``extra`` (pandas named aggregations, ``pe=("pe", first)``)."""
    frame = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    for v in values:
        frame[v] = pd.to_numeric(frame[v], errors="coerce") if v in frame else float("nan")
    stats = {f"{v}_{s}": (v, f) for v in values for s, f in STATS.items()}
    out = frame.groupby(list(by), sort=False, dropna=False).agg(**extra, **stats).reset_index()
    if sort_rest:
        first = {g: i for i, g in enumerate(out[by[0]].unique())}
        out = out.sort_values(list(by[1:])).sort_values(by[0], key=lambda s: s.map(first), kind="stable")
    return out


def first(values: pd.Series) -> Any:
    """A group's first value, missing or not (an ``extra`` aggregation of :func:`aggregate`)."""
    return values.iloc[0]


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    """:data:`STATS`' mean and sample standard deviation of ``values`` (NaN, NaN for none)."""
    series = pd.Series(list(values), dtype="float64")
    return _mean(series), _std(series)


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """``frame``'s rows as dicts of Python values, missing values (NaN) as ``None``."""
    return frame.astype(object).where(frame.notna(), None).to_dict("records")
