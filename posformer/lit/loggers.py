"""What the loggers and a sweeper take from a training run's results: the hyper-parameters with the
headline metrics (:func:`headline`) and the metric-vs-length curves for every logger
(:func:`log_hparams`), and the value an Optuna sweep optimises (:func:`objective`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from posformer.metrics import names


def headline(rows: list[dict[str, Any]], metric: str = "exact_match") -> dict[str, float]:
    """``metric`` (exact match; a language model's: perplexity) at the training length, at the longest
    length and over all longer lengths."""
    out = {}
    ind = [r for r in rows if r["in_distribution"] and r["n_sequences"]]
    ood = [r for r in rows if not r["in_distribution"] and r["n_sequences"]]
    if ind:
        out[f"hp/{metric}_train_len"] = ind[-1][metric]
    if ood:
        out[f"hp/{metric}_longest"] = ood[-1][metric]
        out[f"hp/{metric}_ood_mean"] = sum(r[metric] for r in ood) / len(ood)
    return out


def curve_metrics(task_type: str) -> list[str]:
    """The metric-vs-length curves of a run: a task's metrics (exact match, token accuracy) for a
    synthetic task; a language model's (loss, perplexity) for an LM or translation, no task metric."""
    return names(kinds=("lm",)) if task_type in ("lm", "translation") else names(kinds=("task",))


def objective(results: dict[str, Any]) -> float:
    """The value a sweeper optimises (the train main returns it; ``hydra/sweeper=optuna``).

    Language models and translation: the final ``val/loss`` (minimise; without a validation, the loss
    at the training length). Synthetic tasks: exact match at the training length (maximise). NaN when
    the run has no such number, so an Optuna study records a failed trial and goes on.
    """
    rows = [r for r in results.get("results", []) if r["in_distribution"] and r["n_sequences"]]
    if results.get("data", {}).get("task_type", "task") == "task":
        value = headline(results.get("results", [])).get("hp/exact_match_train_len")
    else:
        value = results.get("val", {}).get("val/loss", rows[-1]["loss"] if rows else None)
    return float("nan") if value is None else float(value)


def log_hparams(
    trainer: Any, container: Mapping[str, Any], rows: list[dict[str, Any]], results: dict[str, Any]
) -> None:
    """Hyper-parameters with the headline metrics, and metric-vs-length curves, to every logger.

    Through the generic Lightning logger API: ``log_hyperparams(params, metrics)`` where the logger
    takes the metrics with the hyper-parameters (TensorBoard's HParams tab), else
    ``log_hyperparams(params)`` and ``log_metrics(metrics)`` (CSV, Weights & Biases, MLflow); the
    curves ``eval/<metric>_vs_length`` with the length as the step (:func:`curve_metrics`: perplexity
    and loss for a language model, exact match and token accuracy for a task). ``container``: the run's
    settings as plain values."""
    params = {
        k: container[k] for k in ("model", "optim", "schedule", "loss", "positions", "seed") if k in container
    }
    params["data"] = results["data"]
    params["trainer"] = {
        k: container["trainer"].get(k) for k in ("max_steps", "precision", "accumulate_grad_batches")
    }
    if results.get("precision"):  # the precision used (trainer.precision=auto resolved), not the request
        params["trainer"]["precision"] = results["precision"]
    task_type = str(results["data"].get("task_type", "task"))
    metrics = headline(rows, "ppl" if task_type in ("lm", "translation") else "exact_match")
    for key, value in results["val"].items():
        metrics[f"hp/{key.replace('/', '_')}"] = value
    for logger in trainer.loggers:
        if "metrics" in inspect.signature(logger.log_hyperparams).parameters:
            logger.log_hyperparams(params, metrics=metrics or None)
        else:
            logger.log_hyperparams(params)
            if metrics:
                logger.log_metrics(metrics, step=int(trainer.global_step))
        for r in rows:
            if r["n_sequences"]:
                shown = [k for k in curve_metrics(task_type) if r.get(k) is not None]
                curves = {f"eval/{k}_vs_length": r[k] for k in shown}
                logger.log_metrics(curves, step=int(r["length"]))
        logger.save()
