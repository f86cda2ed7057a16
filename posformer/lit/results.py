"""What a training run reports: the results files, the console summary and the TensorBoard hparams.

One result row per evaluated length (``RESULT_COLUMNS``). :func:`write_results` writes
``results.json`` (strict JSON), ``results.csv`` and ``results.md`` atomically into the run directory;
:func:`report` prints the table and the output paths; :func:`log_hparams` gives TensorBoard the
headline metrics (:func:`headline`) next to the hyper-parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posformer.eval.format import csv_table, fmt, markdown_table
from posformer.io import atomic_write_json, atomic_write_text

#: metrics of one evaluated length, as logged by the module's test step (``eval/len_<n>/<key>``)
EVAL_KEYS = ("exact_match", "token_acc", "loss", "ppl", "n_sequences", "n_tokens")
RESULT_COLUMNS = (
    "length",
    "in_distribution",
    "exact_match",
    "token_acc",
    "loss",
    "ppl",
    "n_sequences",
    "n_tokens",
    "note",
)
#: (key, header) of the results.md table, its alignments and decimals
_MD_COLUMNS = (
    ("length", "length"),
    ("in_distribution", "in-dist"),
    ("exact_match", "exact match"),
    ("token_acc", "token acc"),
    ("loss", "loss"),
    ("ppl", "ppl"),
    ("n_sequences", "sequences"),
    ("note", "note"),
)
_MD_ALIGN = {"in_distribution": "c", "note": ""}
_DIGITS = {"exact_match": 4, "token_acc": 4, "loss": 4, "ppl": 3}


def _cell(row: dict[str, Any], key: str) -> str:
    """One cell of the results tables: fixed-point floats, ``nan`` as such, no note as empty."""
    return fmt(row.get(key), _DIGITS.get(key, 4), sci_from=None, missing="")


def nan_row(length: int, in_distribution: bool) -> dict[str, Any]:
    """A result row for a length that was not evaluated: NaN metrics, zero counts."""
    counts = ("n_sequences", "n_tokens")
    metrics = {k: 0 if k in counts else float("nan") for k in EVAL_KEYS}
    return {"length": length, "in_distribution": in_distribution, **metrics}


# ------------------------------------------------------------------------------------------ files
def results_markdown(rows: list[dict[str, Any]], title: str = "") -> str:
    table = markdown_table(
        [{**r, "note": r.get("note") or ""} for r in rows],
        _MD_COLUMNS,
        digits=_DIGITS,
        align=_MD_ALIGN,
        sci_from=None,
        missing="",
    )
    return (f"## {title}\n\n" if title else "") + table


def results_csv(rows: list[dict[str, Any]]) -> str:
    return csv_table(rows, RESULT_COLUMNS)


def write_results(out_dir: Path, results: dict[str, Any]) -> None:
    """``results.{json,csv,md}`` in ``out_dir``, each written atomically."""
    atomic_write_json(out_dir / "results.json", results, indent=2)
    atomic_write_text(out_dir / "results.csv", results_csv(results["results"]))
    title = f"{results['task_name']}: {results['model_kind']}, pe={results['pe']}, seed={results['seed']}"
    atomic_write_text(out_dir / "results.md", results_markdown(results["results"], title))


# ------------------------------------------------------------------------------------------ console
def _console() -> Any:
    try:
        from rich.console import Console

        return Console()
    except ModuleNotFoundError:  # pragma: no cover
        return None


def print_results(rows: list[dict[str, Any]], title: str) -> None:
    console = _console()
    if console is None:
        print(results_markdown(rows, title))
        return
    from rich.table import Table

    table = Table(title=title)
    columns = (
        ("length", "length", "right"),
        ("in_distribution", "in-dist", "center"),
        ("exact_match", "exact match", "right"),
        ("token_acc", "token acc", "right"),
        ("loss", "loss", "right"),
        ("note", "note", "left"),
    )
    for _, header, just in columns:
        table.add_column(header, justify=just)
    for r in rows:
        table.add_row(*(_cell({**r, "note": r.get("note") or ""}, key) for key, _, _ in columns))
    console.print(table)


def report(trainer: Any, results: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> None:
    """The results table and the paths of the checkpoint, logs and result files, on stdout."""
    if rows:
        print_results(
            rows,
            f"{results['model_kind']} / pe={results['pe']} / seed={results['seed']} — "
            f"trained on lengths <= {results['train_length']}",
        )
    tb = [lg.log_dir for lg in trainer.loggers if type(lg).__name__ == "TensorBoardLogger"]
    lines = [
        f"checkpoint : {results['checkpoint']['best'] or results['checkpoint']['last'] or 'none saved'}",
        f"tensorboard: {tb[0] if tb else 'disabled'}" + (f"  (tensorboard --logdir {out_dir})" if tb else ""),
        f"results    : {out_dir / 'results.md'} (.json, .csv)",
        f"wall time  : {results['wall_time_s']:.1f} s ({results['global_step']} steps)",
    ]
    for line in lines:
        print(line, flush=True)


# ------------------------------------------------------------------------------------------ tensorboard
def headline(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Exact match at the training length, at the longest length and over all longer lengths."""
    out = {}
    ind = [r for r in rows if r["in_distribution"] and r["n_sequences"]]
    ood = [r for r in rows if not r["in_distribution"] and r["n_sequences"]]
    if ind:
        out["hp/exact_match_train_len"] = ind[-1]["exact_match"]
    if ood:
        out["hp/exact_match_longest"] = ood[-1]["exact_match"]
        out["hp/exact_match_ood_mean"] = sum(r["exact_match"] for r in ood) / len(ood)
    return out


def log_hparams(trainer: Any, cfg: DictConfig, rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    """Hyper-parameters with the headline metrics, and metric-vs-length curves, to TensorBoard."""
    from lightning.pytorch.loggers import TensorBoardLogger

    container = OmegaConf.to_container(cfg, resolve=True)
    params = {
        k: container[k] for k in ("model", "optim", "schedule", "loss", "positions", "seed") if k in container
    }
    params["data"] = results["data"]
    params["trainer"] = {
        k: container["trainer"].get(k) for k in ("max_steps", "precision", "accumulate_grad_batches")
    }
    metrics = headline(rows)
    for key, value in results["val"].items():
        metrics[f"hp/{key.replace('/', '_')}"] = value
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.log_hyperparams(params, metrics=metrics or None)
            for r in rows:
                if r["n_sequences"]:
                    logger.experiment.add_scalar("eval/exact_match_vs_length", r["exact_match"], r["length"])
                    logger.experiment.add_scalar("eval/token_acc_vs_length", r["token_acc"], r["length"])
            logger.experiment.flush()
