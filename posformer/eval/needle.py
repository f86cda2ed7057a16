"""Needle-in-a-haystack grid for passkey models: exact match per (haystack length × needle depth).

A model trained on ``data=passkey`` sees ``n`` filler tokens with ``<key> d1..dk`` hidden after the
first ``where`` of them (:func:`posformer.data.synthetic.passkey_prompt`, the training layout); each
cell holds ``n_per_cell`` random keys, collated as in training and scored by the harness's task scorer
(:func:`posformer.eval.tasks.score_task_batch`: exact match = every key digit and EOS right).

Depths are **sampled** by default: ``bins`` equal depth bins over ``[0, 1]``, each key of a cell at a
position drawn uniformly from its bin's positions (``where`` in ``0 … n``, as in training). Fixed depths
(``--depths 0 0.25 …``) put every key of a cell at the same ``round(depth · n)``: at lengths that are
multiples of 4 those are multiples of ``n/4``, which line up with a chunked or windowed layer's chunk
starts and can score 1.0 where keys straddling a boundary score 0.2. Sampled bins average over every
position, so their mean estimates what the harness measures (training's uniform ``where``).

:func:`harness_exact_match` scores the same checkpoint at the same lengths through ``posformer-eval``'s
code path (:func:`posformer.eval.harness.evaluate_subjects` on the data the checkpoint was trained on);
:func:`compare_with_harness` sets the grid's mean per length beside it with the binomial standard error
of the difference and says, in one line each, where the two disagree by more than ``Z_DISAGREE`` of it.

``posformer-needle <checkpoint> --lengths 32 64 128 256 --bins 10 --out <dir>``
(:mod:`posformer.cli.needle`) writes ``needle.{json,csv,md}`` and the heat map ``needle.{png,svg}``
(lengths down, depth bins across, the training range marked). ``--mode passkey`` scores a language
model instead (:mod:`posformer.eval.passkey`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from posformer.checkpoints import load_checkpoint
from posformer.data.synthetic import N_SPECIAL, collate_decoder, passkey_prompt
from posformer.errors import ConfigError
from posformer.eval.harness import evaluate_subjects
from posformer.eval.run import build_data
from posformer.eval.settings import EvalSettings, Subject, file_fingerprint
from posformer.eval.tasks import score_task_batch
from posformer.metrics import names, reduce
from posformer.model.config import describe_schedule
from posformer.utils.figures import new_figure, write_figure
from posformer.utils.format import markdown_table, write_tables

#: the task metrics, each cell's
TASK_METRICS = names(kinds=("task",))
FIELDS = ("length", "depth", "depth_lo", "depth_hi", *TASK_METRICS, "n_sequences", "in_distribution")
COMPARE_FIELDS = ("length", "grid_mean", "grid_n", "harness", "harness_n", "diff", "se", "agree")
#: a grid mean and the harness disagree when they differ by more than this many standard errors
Z_DISAGREE = 3.0
#: depth bins of the default grid
DEFAULT_BINS = 10


def check_grid(
    lengths: Sequence[int], depths: Sequence[float] | None, n_per_cell: int, bins: int | None = None
) -> None:
    """One line for a bad grid, before any work."""
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ConfigError(f"needle lengths={list(lengths)!r} must be integers >= 1 (filler tokens)")
    if depths is not None and (not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths)):
        raise ConfigError(f"needle depths={list(depths)!r} must be in [0, 1] (0: needle first, 1: last).")
    if n_per_cell < 1:
        raise ConfigError(f"needle n_per_cell={n_per_cell!r} must be >= 1 (keys per grid cell).")
    if depths is None:
        if bins is None or bins < 1:
            raise ConfigError(f"needle bins={bins!r} must be >= 1 (depth bins; or give --depths).")
        if min(lengths) + 1 < bins:
            raise ConfigError(
                f"needle bins={bins} needs lengths >= {bins - 1} (a position per bin), got length "
                f"{min(lengths)}; use fewer --bins or longer --lengths."
            )


def cell_rows(length: int, depth: float, n: int, key_len: int, seed: int) -> list[dict[str, Any]]:
    """``n`` passkey examples of ``length`` filler tokens with the key after ``round(depth · length)``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, length, int(round(depth * 1e6))]))
    where = int(round(depth * length))
    rows = []
    for _ in range(n):
        key = (rng.integers(0, 10, key_len) + N_SPECIAL).tolist()
        rows.append({"prompt": passkey_prompt(length, key, where), "answer": key})
    return rows


def bin_positions(length: int, index: int, bins: int) -> range:
    """The key positions ``where`` (``0 … length``) of depth bin ``index`` of ``bins``: the ``length + 1``
    positions split into ``bins`` runs of (nearly) equal size."""
    n = length + 1
    return range(-(-index * n // bins), -(-(index + 1) * n // bins))


def binned_rows(length: int, index: int, bins: int, n: int, key_len: int, seed: int) -> list[dict[str, Any]]:
    """``n`` passkey examples of ``length`` fillers, each key at a uniform random position of the bin."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, length, bins, index]))
    where = bin_positions(length, index, bins)
    rows = []
    for _ in range(n):
        key = (rng.integers(0, 10, key_len) + N_SPECIAL).tolist()
        at = int(rng.integers(where.start, where.stop))
        rows.append({"prompt": passkey_prompt(length, key, at), "answer": key, "where": at})
    return rows


def _cells_of(
    length: int, depths: Sequence[float] | None, bins: int | None
) -> list[tuple[float, float, float]]:
    """``(depth, lo, hi)`` of each column at ``length``: a fixed depth, or a bin's centre and range."""
    if depths is not None:
        return [(float(d), float(d), float(d)) for d in depths]
    assert bins is not None
    out = []
    for b in range(bins):
        where = bin_positions(length, b, bins)
        out.append(((b + 0.5) / bins, where.start / length, (where.stop - 1) / length))
    return out


@torch.inference_mode()
def needle_grid(
    model: nn.Module,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    *,
    bins: int | None = None,
    n_per_cell: int = 32,
    key_len: int = 5,
    bos: bool = False,
    seed: int = 0,
    train_len: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """One dict per cell (keys :data:`FIELDS`), lengths outer, depths inner. ``depths``: fixed depths;
    ``None``: ``bins`` sampled depth bins (default :data:`DEFAULT_BINS`)."""
    if depths is None and bins is None:
        bins = DEFAULT_BINS
    check_grid(lengths, depths, n_per_cell, bins)
    model.eval()
    lo, hi = (train_len[0], train_len[-1]) if train_len is not None else (0, 0)
    cells = []
    for length in lengths:
        for j, (depth, d_lo, d_hi) in enumerate(_cells_of(length, depths, bins)):
            if depths is not None:
                rows = cell_rows(length, depth, n_per_cell, key_len, seed)
            else:
                rows = binned_rows(length, j, int(bins), n_per_cell, key_len, seed)
            s = score_task_batch(model, collate_decoder(rows, bos))
            values = reduce(s)
            cells.append(
                {
                    "length": int(length),
                    "depth": depth,
                    "depth_lo": d_lo,
                    "depth_hi": d_hi,
                    **{k: values[k] for k in TASK_METRICS},
                    "n_sequences": s["n_sequences"],
                    "in_distribution": None if train_len is None else bool(lo <= length <= hi),
                }
            )
    return cells


# ------------------------------------------------------------------------------------ the harness beside it
def harness_exact_match(
    model: nn.Module,
    data: Any,
    lengths: Sequence[int],
    out_dir: Path | str,
    *,
    train_len: Any = None,
    checkpoint: str | Path | None = None,
) -> dict[int, dict[str, Any]]:
    """Exact match per length of ``model`` on ``data`` (the task data module it was trained on) as
    ``posformer-eval`` measures it (:func:`~posformer.eval.harness.evaluate_subjects`, its rows kept in
    ``out_dir``): ``{length: {"exact_match", "n_sequences", "status"}}``."""
    subject = Subject(
        label="harness",
        model=model,
        task_type="task",
        data=data,
        train_len=tuple(train_len) if isinstance(train_len, list) else train_len,
        checkpoint=str(checkpoint or ""),
        fingerprint=file_fingerprint(checkpoint) if checkpoint else "",
    )
    settings = EvalSettings(lengths=list(lengths), progress=False)
    results = evaluate_subjects([subject], settings, out_dir, tensorboard=False, plots=False)
    return {
        int(r["length"]): {
            "exact_match": r.get("exact_match"),
            "n_sequences": r.get("n_sequences", 0),
            "status": r.get("status"),
        }
        for r in results.rows
    }


def _compare(length: Any, p1: float, n1: int, p2: float | None, n2: int, z: float) -> tuple[dict, str | None]:
    """One comparison row (two binomial rates, pooled standard error of the difference) and its
    disagreement line, if any."""
    row: dict[str, Any] = {"length": length, "grid_mean": p1, "grid_n": n1, "harness": p2, "harness_n": n2}
    if p2 is None or n1 == 0 or n2 == 0:
        row.update(diff=None, se=None, agree=None)
        return row, None
    pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    diff = p1 - p2
    agree = abs(diff) <= z * se if se > 0 else diff == 0
    row.update(diff=diff, se=se, agree=agree)
    where = "over all lengths" if length == "all" else f"at length {length}"
    line = (
        f"needle grid and harness disagree {where}: grid mean {p1:.3f} (n={n1}) vs harness exact match "
        f"{p2:.3f} (n={n2}), difference {diff:+.3f} > {z:g} x standard error {se:.3f}"
    )
    return row, None if agree else line


def compare_with_harness(
    cells: list[dict[str, Any]], harness: dict[int, dict[str, Any]], z: float = Z_DISAGREE
) -> tuple[list[dict[str, Any]], list[str]]:
    """The grid's mean exact match per length (over its cells, weighted by keys) beside the harness's,
    with the binomial standard error of the difference (pooled rate); then the same over every length
    the two share (``length`` ``"all"``: a bias too small to show at one length shows there); and one
    line per comparison where they differ by more than ``z`` of it."""
    rows, lines = [], []
    total = [0.0, 0, 0.0, 0]  # hits and keys of the grid, of the harness, over the shared lengths
    for length in sorted({c["length"] for c in cells}):
        mine = [c for c in cells if c["length"] == length]
        n1 = sum(c["n_sequences"] for c in mine)
        hits = sum(c["exact_match"] * c["n_sequences"] for c in mine)
        h = harness.get(length, {})
        p2, n2 = h.get("exact_match"), int(h.get("n_sequences") or 0)
        row, line = _compare(length, hits / max(n1, 1), n1, p2, n2, z)
        rows.append(row)
        lines += [line] if line else []
        if row["agree"] is not None:
            total = [total[0] + hits, total[1] + n1, total[2] + p2 * n2, total[3] + n2]
    if len([r for r in rows if r["agree"] is not None]) > 1:
        row, line = _compare("all", total[0] / total[1], total[1], total[2] / total[3], total[3], z)
        rows.append(row)
        lines += [line] if line else []
    return rows, lines


def heat_map(
    cells: list[dict[str, Any]],
    path: Path,
    title: str,
    *,
    metric: str = "exact_match",
    ylabel: str = "haystack length, filler tokens (* = trained)",
) -> Path:
    """``metric`` as a lengths × depths heat map, each cell annotated; PNG + SVG."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.full((len(lengths), len(depths)), np.nan)
    for c in cells:
        grid[lengths.index(c["length"]), depths.index(c["depth"])] = c[metric]
    fig, ax = new_figure(title)
    image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(lengths)):
        for j in range(len(depths)):
            v = grid[i, j]
            color = "black" if v > 0.6 else "white"
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    trained = {c["length"] for c in cells if c.get("in_distribution")}
    ax.set_yticks(range(len(lengths)), [f"{n}*" if n in trained else str(n) for n in lengths])
    binned = any(c["depth_lo"] != c["depth_hi"] for c in cells)
    ax.set_xlabel(f"needle depth{' bin centre' if binned else ''} (0 = first, 1 = last)")
    ax.set_ylabel(ylabel)
    fig.colorbar(image, ax=ax, label=metric.replace("_", " "))
    out = write_figure(fig, path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def depth_table(cells: list[dict[str, Any]], metric: str = "exact_match") -> str:
    """A lengths × depths Markdown table of ``metric``."""
    depths = sorted({c["depth"] for c in cells})
    table = []
    for length in sorted({c["length"] for c in cells}):
        row: dict[str, Any] = {"length": length}
        row.update({f"{c['depth']:g}": c[metric] for c in cells if c["length"] == length})
        table.append(row)
    columns = [("length", "length"), *((f"{d:g}", f"depth {d:g}") for d in depths)]
    return markdown_table(table, columns, digits={"length": 0})


def _compare_markdown(rows: list[dict[str, Any]], lines: list[str]) -> list[str]:
    columns = [
        ("length", "length"),
        ("grid_mean", "grid mean"),
        ("grid_n", "keys"),
        ("harness", "harness exact match"),
        ("harness_n", "harness n"),
        ("diff", "difference"),
        ("se", "standard error"),
        ("agree", f"within {Z_DISAGREE:g} SE"),
    ]
    return [
        "",
        "## Grid mean vs posformer-eval",
        "",
        "The grid's mean per length beside the harness's exact match for the same checkpoint and lengths "
        "(`posformer-eval`'s task scoring on the data it was trained on); standard error: binomial, pooled.",
        "",
        markdown_table(rows, columns, digits={"length": 0, "grid_n": 0, "harness_n": 0}),
        "",
        *(lines or ["The grid mean and the harness agree at every length."]),
    ]


def write_needle(
    cells: list[dict[str, Any]],
    out_dir: Path | str,
    meta: dict[str, Any],
    compare: tuple[list[dict[str, Any]], list[str]] | None = None,
) -> dict[str, Path]:
    """``needle.json`` (meta + cells [+ the harness comparison]), ``needle.csv``, ``needle.md`` (a
    lengths × depths table [+ the comparison]) and the heat map ``needle.png``/``.svg`` in ``out_dir``;
    returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    binned = any(c["depth_lo"] != c["depth_hi"] for c in cells)
    how = (
        "keys at uniform random positions of each depth bin (column: bin centre)"
        if binned
        else "fixed depths"
    )
    md = [
        f"# Needle grid: {meta.get('label', '')}",
        "",
        f"Exact match per haystack length (rows) and needle depth (columns), {cells[0]['n_sequences']} keys "
        f"per cell, {how}.",
        "",
        depth_table(cells),
    ]
    document: dict[str, Any] = {"meta": meta, "cells": cells}
    if compare is not None:
        md += _compare_markdown(*compare)
        document["harness"] = {"rows": compare[0], "disagreements": compare[1], "z": Z_DISAGREE}
    paths = write_tables(out, "needle", cells, FIELDS, "\n".join(md) + "\n", document)
    paths["png"] = heat_map(cells, out / "needle.png", f"Passkey retrieval: {meta.get('label', '')}")
    paths["svg"] = paths["png"].with_suffix(".svg")
    return paths


def print_comparison(rows: list[dict[str, Any]], lines: list[str]) -> None:
    """The grid mean beside the harness per length, then the disagreement lines (or that they agree)."""
    for r in rows:
        h = "n/a" if r["harness"] is None else f"{r['harness']:.3f} (n={r['harness_n']})"
        se = "" if r["se"] is None else f", standard error {r['se']:.3f}"
        print(f"length {r['length']}: grid mean {r['grid_mean']:.3f} (n={r['grid_n']}), harness {h}{se}")
    print(
        "\n".join(lines)
        if lines
        else "needle grid and harness agree within sampling error at every length and over all of them"
    )


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint trained on data=passkey (--mode passkey: any LM)")
    p.add_argument("--mode", choices=("task", "passkey"), default="task", help="passkey: a language model")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="filler tokens (default per mode)")
    p.add_argument("--depths", type=float, nargs="+", default=None, help="fixed depths instead of bins")
    p.add_argument("--bins", type=int, default=DEFAULT_BINS, help="sampled depth bins (default)")
    p.add_argument("--n", type=int, default=32, help="keys per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--key-len", type=int, default=5, help="passkey mode: digits of the key")
    p.add_argument(
        "--harness",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score the same lengths through posformer-eval and compare (task mode)",
    )
    p.add_argument("--out", default="needle", help="output directory")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "posformer-needle") -> dict[str, Path]:
    """``posformer-needle CHECKPOINT --lengths ... --bins|--depths ... --out DIR`` for a passkey-task model
    (without the error boundary; ``--mode passkey`` is :func:`posformer.eval.passkey.main_passkey`)."""
    return run_grid(parser(prog).parse_args(argv))


def run_grid(a: argparse.Namespace) -> dict[str, Path]:
    """The needle grid of the parsed command line ``a`` (task mode)."""
    if a.mode != "task":
        raise ConfigError(
            f"needle --mode={a.mode!r}: this is the task grid; posformer-needle dispatches modes."
        )
    a.lengths = a.lengths or [32, 64, 128, 256, 512]
    check_grid(a.lengths, a.depths, a.n, a.bins)
    ck = load_checkpoint(a.checkpoint)
    if ck.data_cfg.get("task") != "passkey" or ck.kind != "decoder":
        raise ConfigError(
            f"{a.checkpoint} was trained on data task {ck.data_cfg.get('task')!r} ({ck.kind}); the needle "
            "grid needs a decoder-only model trained with data=passkey (a language model: --mode passkey)."
        )
    train = ck.data_cfg.get("train_len")
    key_len, bos = int(ck.data_cfg.get("key_len", 5)), bool(ck.data_cfg.get("bos", False))
    cells = needle_grid(
        ck.model,
        a.lengths,
        a.depths,
        bins=a.bins,
        n_per_cell=a.n,
        key_len=key_len,
        bos=bos,
        seed=a.seed,
        train_len=train,
    )
    compare = None
    if a.harness:
        data = build_data(ck, {})
        harness = harness_exact_match(
            ck.model, data, a.lengths, Path(a.out) / "harness", train_len=train, checkpoint=a.checkpoint
        )
        compare = compare_with_harness(cells, harness)
        print_comparison(*compare)
    name = ck.variant or describe_schedule(ck.model_cfg)  # a named variant: its name
    label = f"{name} [{Path(a.checkpoint).resolve().parent.parent.name}]"
    meta = {
        "label": label,
        "checkpoint": str(a.checkpoint),
        "pe": ck.pe,
        "train_len": train,
        "seed": a.seed,
        "depths": a.depths if a.depths is not None else f"{a.bins} sampled bins",
    }
    if ck.variant:
        meta["variant"] = ck.variant
    paths = write_needle(cells, a.out, meta, compare)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    return paths
