"""Length-extrapolation harness: evaluate trained models at lengths beyond their training length.

:func:`evaluate_subjects` runs every :class:`~posformer.eval.settings.Subject` at every length and
writes the results after each (subject, mode, length) pair:

* **Language models** (``task_type == "lm"``): loss / perplexity per length on one token stream, in
  the ``nonoverlap`` and ``sliding`` modes, scoring the same number of tokens at every length
  (:mod:`posformer.eval.windows`).
* **Synthetic tasks** (``task_type == "task"``): exact match and token accuracy per problem length
  from the datamodule's ``eval_dataloaders(lengths)`` (:mod:`posformer.eval.tasks`), with the
  in-distribution (training) range marked.

Evaluation runs through Lightning Fabric, so ``trainer.accelerator/devices/precision`` mean the same as
in training. A PE that cannot represent a length (a learned table too short: ``PositionRangeError``) is
reported as ``n/a`` with the reason; the other lengths still run. Running out of memory records an
``oom`` row, saves and stops with a :class:`~posformer.errors.ResourceError` naming the fix. Peak
memory is measured per length (:class:`~posformer.utils.memory.MemoryMeter`).

Results go to ``extrapolation.{json,csv,md}`` (:mod:`posformer.eval.results`), PNG plots and
TensorBoard (:mod:`posformer.eval.plots`) under the output directory; an interrupted sweep re-run with
the same output directory skips the pairs already done. Rotary context extension is applied per
length (:mod:`posformer.eval.scaling`).

"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posformer.errors import ConfigError, PositionRangeError, ResourceError, is_out_of_memory
from posformer.eval.console import EvalProgress
from posformer.eval.plots import log_scalars, logging_failures, tensorboard_writer, write_plots
from posformer.eval.results import RESULTS_JSON
from posformer.eval.scaling import apply_length_scaling
from posformer.eval.settings import (
    TASK_MODES,
    EvalSettings,
    Subject,
    in_distribution,
)
from posformer.eval.store import Results

# task_batch_sums and score_lm_windows are looked up in this module at call time, so a test can
# replace them here (monkeypatch.setattr(harness, "task_batch_sums", ...)).
from posformer.eval.streaming import STREAMING, score_streaming
from posformer.eval.tasks import read_totals, task_batch_sums
from posformer.eval.windows import (
    DOCUMENT_NOTE,
    TOO_LONG,
    default_n_tokens,
    document_ends,
    document_windows,
    lm_stream,
    mode_windows,
    score_lm_windows,
    too_long_in_documents,
    too_long_reason,
)
from posformer.metrics import SUMS, names, reduce, table_metrics
from posformer.model.backends.flex import reset_compiled
from posformer.model.parallel import ContextParallel
from posformer.model.positions import randomized_positions
from posformer.utils.memory import MemoryMeter

__all__ = ["evaluate_subjects"]


# ---------------------------------------------------------------------------------------------- the run
def evaluate_subjects(
    subjects: Iterable[Subject],
    settings: EvalSettings,
    out_dir: Path | str,
    *,
    fabric: Any = None,
    meta: dict[str, Any] | None = None,
    tensorboard: bool = True,
    plots: bool = True,
    parallel: ContextParallel | None = None,
) -> Results:
    """Evaluate every subject at every length; write results after each (subject, length) pair.

    Pairs already in ``out_dir/extrapolation.json`` (status ok or n/a) are skipped; rows of a
    checkpoint file that has been rewritten since (another fingerprint) are dropped and redone.
    ``fabric`` (a ``lightning.Fabric``) places the models and sets the precision; ``None``: a CPU fp32
    Fabric. ``meta`` is merged into the results' metadata. ``parallel``: a group splitting every LM
    window (:mod:`posformer.eval.parallel`), each process of it calling alike; rank 0 alone writes.
    """
    out_dir = Path(out_dir)
    writes = parallel is None or parallel.rank == 0
    dest = out_dir if writes else None  # where rows are saved (the other ranks read out_dir only)
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
    if fabric is None:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    subjects = list(subjects)
    results = Results.load(out_dir)
    current = {(s.checkpoint, s.fingerprint) for s in subjects if s.checkpoint and s.fingerprint}
    if current:  # results of an older version of a checkpoint file are evaluated again
        results.meta["stale_rows_dropped"] = results.drop_stale(current)
    done = results.done_keys()
    results.meta.update(meta or {})
    results.meta["finished"] = False  # until every pair has run (an owner check lets others in till then)
    results.meta["settings"] = {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()
    }
    task_modes = [TASK_MODES[p] for p in settings.task_positions]
    n_pairs = sum(
        len(settings.lengths) * len(settings.modes if s.task_type == "lm" else task_modes) for s in subjects
    )
    skipped = 0
    with EvalProgress(settings.progress and writes, n_pairs) as progress:
        for subject in subjects:
            todo_modes = list(settings.modes) if subject.task_type == "lm" else task_modes
            pending = [(m, L) for m in todo_modes for L in settings.lengths if subject.key(m, L) not in done]
            n_done = len(todo_modes) * len(settings.lengths) - len(pending)
            skipped += n_done
            progress.skip(subject.label, n_done)
            if not pending:
                continue
            reset_compiled()  # each checkpoint's PE compiles (and counts) its own FlexAttention graphs
            raw = subject.model
            model = raw if hasattr(raw, "_forward_module") else fabric.setup_module(raw)
            raw.eval()
            run = functools.partial(_run_lm, parallel=parallel) if subject.task_type == "lm" else _run_tasks
            with _config_override(raw, settings.model_overrides()), torch.inference_mode():
                run(subject, model, raw, pending, settings, results, dest, progress, fabric)
    results.meta["skipped_pairs"] = skipped
    results.meta["finished"] = True
    if not writes:
        return results
    results.save(out_dir)
    if plots:
        with logging_failures(out_dir):  # a full disk there: one line, the results kept
            writer = None
            if tensorboard:
                writer = tensorboard_writer(out_dir)
                log_scalars(results, writer)
            write_plots(results, out_dir, writer)
            if writer is not None:
                writer.close()
    return results


def _run_lm(
    subject: Subject,
    model: Any,
    raw: nn.Module,
    pending: list[tuple[str, int]],
    settings: EvalSettings,
    results: Results,
    out_dir: Path | None,
    progress: EvalProgress,
    fabric: Any,
    parallel: ContextParallel | None = None,
) -> None:
    """Loss/perplexity of a language model at each pending (mode, length); one row each, saved to
    ``out_dir`` (``None``: not saved); ``parallel``: every window split across its processes."""
    stream, windows_of, n_tokens, notes = _lm_plan(subject, settings, pending)
    for note in notes:
        results.meta.setdefault("notes", []).append(f"{subject.label}: {note}")
    results.meta.setdefault("scored_tokens_per_length", {})[subject.label] = n_tokens
    for mode, L in pending:
        row = _base_row(subject, mode, L)
        windows, stride, reason = windows_of[(mode, L)]
        row["stride"] = stride
        if not windows:  # one window of L tokens needs L + 1: never a shorter window labelled L
            row.update(status=TOO_LONG, reason=reason)
            _finish_row(row, time.perf_counter(), results, out_dir, progress)
            continue
        batch = max(1, settings.batch_tokens // L)
        progress.start(f"{subject.label} {mode} L={L}", -(-len(windows) // batch))
        t0 = time.perf_counter()
        meter = MemoryMeter(fabric.device)
        try:
            apply_length_scaling(subject, raw, L)
            # streaming: each window read through a sinks + recent-window cache (eval.streaming)
            extra = {"spec": settings.streaming} if mode == STREAMING else {"parallel": parallel}
            with meter:
                out = (score_streaming if mode == STREAMING else score_lm_windows)(
                    model,
                    stream,
                    windows,
                    batch=batch,
                    **extra,
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
            _add_metrics(row, {"loss_sum": out["nll_sum"], "n_tokens": out["scored_tokens"]})
            row.update(
                scored_tokens=out["scored_tokens"],
                n_sequences=len(windows),
                peak_mem_mb=meter.peak_mb,
                peak_mem_delta_mb=meter.delta_mb,
            )
            if "position_nll" in out:
                cnt = out["position_count"].clamp(min=1).double()
                row["position_loss"] = [round(x, 5) for x in (out["position_nll"] / cnt).tolist()]
        _finish_row(row, t0, results, out_dir, progress, raw)


def _lm_plan(
    subject: Subject, settings: EvalSettings, pending: list[tuple[str, int]]
) -> tuple[torch.Tensor, dict[tuple[str, int], tuple[list[Any], int, str]], int, list[str]]:
    """The stream ``(N,)``, each pending (mode, length)'s ``(windows, stride, reason when none)``, the
    target count of scored tokens and the notes. Windows lie anywhere in the stream's first
    ``n_tokens + 1`` tokens, or inside documents (``data.eval_windows=documents``)."""
    want, _ = default_n_tokens(settings, sys.maxsize, subject.n_tokens)
    ends = document_ends(subject.data)  # None: windows anywhere in the stream
    stream = lm_stream(subject.data, want) if ends is None else None
    available = stream.numel() - 1 if stream is not None else max(0, int(ends[-1]) - 1 if len(ends) else 0)
    n_tokens, note = default_n_tokens(settings, available, subject.n_tokens)
    notes = [note] if note else []
    plan = {}
    for mode, L in pending:
        stride = settings.stride_for(L) if mode == "sliding" else L
        if ends is None:
            windows = mode_windows(mode, n_tokens, L, stride) if available >= L else []
            plan[(mode, L)] = (windows, stride, too_long_reason(L, available))
        else:
            windows = document_windows(mode, ends, n_tokens, L, stride)
            plan[(mode, L)] = (windows, stride, too_long_in_documents(L))
    if stream is None:  # read up to the last document a window needs
        notes.append(DOCUMENT_NOTE)
        last = max((w.start + w.length for p in plan.values() for w in p[0]), default=1)
        stream = lm_stream(subject.data, last)
    return stream, plan, n_tokens, notes


def _run_tasks(
    subject: Subject,
    model: Any,
    raw: nn.Module,
    pending: list[tuple[str, int]],
    settings: EvalSettings,
    results: Results,
    out_dir: Path | None,
    progress: EvalProgress,
    fabric: Any,
) -> None:
    """Exact match / token accuracy of a synthetic-task model at each pending length; one row each."""
    lengths = sorted({L for _, L in pending})
    loaders = subject.data.eval_dataloaders(lengths)
    for mode, L in pending:
        row = _base_row(subject, mode, L)
        loader = loaders.get(L) if hasattr(loaders, "get") else loaders[L]
        if loader is None:
            row.update(status="n/a", reason=f"the data module has no evaluation set for length {L}")
            results.add(row)
            if out_dir is not None:
                results.save(out_dir)
            progress.row(row)
            continue
        n_batches = len(loader) if hasattr(loader, "__len__") else 0
        if settings.max_batches:
            n_batches = min(n_batches, settings.max_batches) if n_batches else settings.max_batches
        progress.start(f"{subject.label} task L={L}", n_batches)
        sums: dict[str, torch.Tensor] = {}  # on the device: read once, after the length's last batch
        t0 = time.perf_counter()
        meter = MemoryMeter(fabric.device)
        # randomized: one generator per (subject, length), so a row does not depend on what ran before it
        randomized = mode == TASK_MODES["randomized"]
        gen = torch.Generator().manual_seed(settings.positions_seed) if randomized else None
        try:
            apply_length_scaling(subject, raw, L)
            with meter:
                for i, batch in enumerate(loader):
                    if settings.max_batches and i >= settings.max_batches:
                        break
                    pos = None if gen is None else _random_task_positions(subject, batch, gen)
                    for k, v in task_batch_sums(model, batch, positions=pos).items():
                        sums[k] = sums[k] + v if k in sums else v
                    progress.batch()
                totals = read_totals(sums) if sums else dict.fromkeys(SUMS, 0)
        except (PositionRangeError, ConfigError) as exc:
            row.update(status="n/a", reason=str(exc))
        except Exception as exc:  # out of memory: record it, keep the results so far, stop clearly
            if not is_out_of_memory(exc):
                raise
            _stop_on_oom(subject, row, settings, results, out_dir, exc)
        else:
            _add_metrics(row, totals)
            row.update(
                scored_tokens=totals["n_tokens"],
                n_sequences=totals["n_sequences"],
                peak_mem_mb=meter.peak_mb,
                peak_mem_delta_mb=meter.delta_mb,
            )
        _finish_row(row, t0, results, out_dir, progress, raw)


def _random_task_positions(subject: Subject, batch: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    """Randomized positions (B, T) of a decoder task batch: sorted random subsets of ``[0, n_max)``.

    Raises :class:`ConfigError` (the row becomes n/a with its message) when the checkpoint has no
    ``positions.n_max``, the batch is longer than ``n_max``, or the model is an encoder-decoder."""
    if "input_ids" not in batch:
        raise ConfigError("eval.task_positions=randomized covers decoder-only task models")
    if not subject.n_max:
        raise ConfigError("the checkpoint has no positions.n_max to sample randomized positions from")
    b, t = batch["input_ids"].shape
    return randomized_positions(b, t, subject.n_max, generator=gen)


# ---------------------------------------------------------------------------------------------- rows
def _base_row(subject: Subject, mode: str, length: int) -> dict[str, Any]:
    """The fields of a result row that do not depend on the outcome (status ``ok`` until changed)."""
    series = subject.label if subject.scaling_name == "none" else f"{subject.label} +{subject.scaling_name}"
    if mode == TASK_MODES["randomized"]:
        series += " [randomized positions]"
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
        **({"variant": subject.variant} if subject.variant else {}),  # none: the rows as before variants
    }


def _add_metrics(row: dict[str, Any], sums: Mapping[str, float]) -> None:
    """The row's metrics from its summed statistics (:func:`posformer.metrics.reduce`): those of its task
    type's tables that the sums give, in the order of posformer-eval's files."""
    values, shown = reduce(sums), table_metrics(row["task_type"])
    row.update({k: values[k] for k in names(lead="lm") if k in shown and k in values})


def _finish_row(
    row: dict[str, Any],
    t0: float,
    results: Results,
    out_dir: Path | None,
    progress: EvalProgress,
    model: Any = None,
) -> None:
    """Stamp the elapsed time (and ``attention_fallback`` when FlexAttention failed for ``model`` under
    ``auto``), add the row, save the results, report it (bar or line: :class:`EvalProgress`)."""
    row["seconds"] = round(time.perf_counter() - t0, 3)
    fallback = getattr(model, "attention_fallback", None)
    if fallback:
        row["attention_fallback"] = fallback
    results.add(row)
    if out_dir is not None:  # None: a process that does not write (context-parallel rank > 0)
        results.save(out_dir)
    progress.row(row)


def _stop_on_oom(
    subject: Subject,
    row: dict[str, Any],
    settings: EvalSettings,
    results: Results,
    out_dir: Path | None,
    exc: Exception,
) -> None:
    """Record an out-of-memory row (not 'done': a re-run retries it), save, raise a ResourceError."""
    length = row["length"]
    done = [r["length"] for r in results.rows if r.get("label") == row["label"] and r.get("status") == "ok"]
    row.update(status="oom", reason=f"out of memory: {str(exc).strip().splitlines()[0][:200]}")
    results.add(row)
    if out_dir is not None:
        results.save(out_dir)
    out_dir = out_dir or Path("<the output directory>")  # None: a process that does not write
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    raise ResourceError(
        f"out of memory evaluating {subject.label} at length {length} ({row['mode']}); the longest "
        f"length done is {max(done) if done else 'none'}. Results so far are in {out_dir / RESULTS_JSON}. "
        f"Fix: lower eval.batch_tokens (now {settings.batch_tokens}), set eval.attention_chunk_mb (e.g. 64), "
        f"split a language model's windows over P devices with eval.context_parallel=P, or drop lengths "
        f">= {length}; re-run with eval.output_dir={out_dir} to continue from this length."
    ) from None


# ---------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _config_override(model: nn.Module, values: Mapping[str, Any]) -> Iterator[None]:
    """Temporarily set fields of ``model.cfg`` (a ``None`` value: leave that field)."""
    cfg = getattr(model, "cfg", None)
    given = {k: v for k, v in values.items() if v is not None} if cfg is not None else {}
    old = {k: getattr(cfg, k) for k in given}
    for k, v in given.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(cfg, k, v)
