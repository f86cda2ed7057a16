"""Needle-in-a-haystack grid for passkey models: exact match per (haystack length × needle depth).

A model trained on ``data=passkey`` sees ``n`` filler tokens with ``<key> d1..dk`` hidden after the
first ``round(depth · n)`` of them (:func:`posformer.data.synthetic.passkey_prompt`, the training
layout); each cell holds ``n_per_cell`` random keys, collated as in training and scored by the
harness's task scorer (:func:`posformer.eval.tasks.score_task_batch`: exact match = every key digit
and EOS right). Depth 0 puts the needle first, depth 1 last (next to the question).

``posformer-needle <checkpoint> --lengths 32 64 128 256 --depths 0 0.25 0.5 0.75 1 --out <dir>``
(:mod:`posformer.cli.needle`) writes ``needle.{json,csv,md}`` and the heat map ``needle.{png,svg}``
(lengths down, depths across, the training range marked).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from posformer.checkpoints import load_checkpoint
from posformer.data.synthetic import N_SPECIAL, collate_decoder, passkey_prompt
from posformer.errors import ConfigError
from posformer.eval.tasks import score_task_batch
from posformer.metrics import names, reduce
from posformer.utils.figures import new_figure, write_figure
from posformer.utils.format import markdown_table, write_tables

#: the task metrics, each cell's
TASK_METRICS = names(kinds=("task",))
FIELDS = ("length", "depth", *TASK_METRICS, "n_sequences", "in_distribution")


def check_grid(lengths: Sequence[int], depths: Sequence[float], n_per_cell: int) -> None:
    """One line for a bad grid, before any work."""
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ConfigError(f"needle lengths={list(lengths)!r} must be integers >= 1 (filler tokens)")
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise ConfigError(f"needle depths={list(depths)!r} must be in [0, 1] (0: needle first, 1: last).")
    if n_per_cell < 1:
        raise ConfigError(f"needle n_per_cell={n_per_cell!r} must be >= 1 (keys per grid cell).")


def cell_rows(length: int, depth: float, n: int, key_len: int, seed: int) -> list[dict[str, Any]]:
    """``n`` passkey examples of ``length`` filler tokens with the key after ``round(depth · length)``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, length, int(round(depth * 1e6))]))
    where = int(round(depth * length))
    rows = []
    for _ in range(n):
        key = (rng.integers(0, 10, key_len) + N_SPECIAL).tolist()
        rows.append({"prompt": passkey_prompt(length, key, where), "answer": key})
    return rows


@torch.inference_mode()
def needle_grid(
    model: nn.Module,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    n_per_cell: int = 32,
    key_len: int = 5,
    bos: bool = False,
    seed: int = 0,
    train_len: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """One dict per cell (keys :data:`FIELDS`), lengths outer, depths inner."""
    check_grid(lengths, depths, n_per_cell)
    model.eval()
    lo, hi = (train_len[0], train_len[-1]) if train_len is not None else (0, 0)
    cells = []
    for length in lengths:
        for depth in depths:
            batch = collate_decoder(cell_rows(length, float(depth), n_per_cell, key_len, seed), bos)
            s = score_task_batch(model, batch)
            values = reduce(s)
            cells.append(
                {
                    "length": int(length),
                    "depth": float(depth),
                    **{k: values[k] for k in TASK_METRICS},
                    "n_sequences": s["n_sequences"],
                    "in_distribution": None if train_len is None else bool(lo <= length <= hi),
                }
            )
    return cells


def heat_map(cells: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Exact match as a lengths × depths heat map, each cell annotated; PNG + SVG."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.full((len(lengths), len(depths)), np.nan)
    for c in cells:
        grid[lengths.index(c["length"]), depths.index(c["depth"])] = c["exact_match"]
    fig, ax = new_figure(title)
    image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(lengths)):
        for j in range(len(depths)):
            v = grid[i, j]
            color = "black" if v > 0.6 else "white"
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    trained = {c["length"] for c in cells if c["in_distribution"]}
    ax.set_yticks(range(len(lengths)), [f"{n}*" if n in trained else str(n) for n in lengths])
    ax.set_xlabel("needle depth (0 = first, 1 = last)")
    ax.set_ylabel("haystack length, filler tokens (* = trained)")
    fig.colorbar(image, ax=ax, label="exact match")
    out = write_figure(fig, path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def write_needle(cells: list[dict[str, Any]], out_dir: Path | str, meta: dict[str, Any]) -> dict[str, Path]:
    """``needle.json`` (meta + cells), ``needle.csv``, ``needle.md`` (a lengths × depths table) and the
    heat map ``needle.png``/``.svg`` in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    depths = sorted({c["depth"] for c in cells})
    table = []
    for length in sorted({c["length"] for c in cells}):
        row: dict[str, Any] = {"length": length}
        row.update({f"{c['depth']:g}": c["exact_match"] for c in cells if c["length"] == length})
        table.append(row)
    columns = [("length", "length"), *((f"{d:g}", f"depth {d:g}") for d in depths)]
    md = [
        f"# Needle grid: {meta.get('label', '')}",
        "",
        f"Exact match per haystack length (rows) and needle depth (columns), {cells[0]['n_sequences']} keys "
        "per cell.",
        "",
        markdown_table(table, columns, digits={"length": 0}),
    ]
    paths = write_tables(out, "needle", cells, FIELDS, "\n".join(md), {"meta": meta, "cells": cells})
    paths["png"] = heat_map(cells, out / "needle.png", f"Passkey retrieval: {meta.get('label', '')}")
    paths["svg"] = paths["png"].with_suffix(".svg")
    return paths


def main(argv: Sequence[str] | None = None, prog: str = "posformer-needle") -> dict[str, Path]:
    """``posformer-needle CHECKPOINT --lengths ... --depths ... --out DIR`` (without the error boundary)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint trained on data=passkey")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512], help="filler tokens")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--n", type=int, default=32, help="keys per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="needle", help="output directory")
    a = p.parse_args(argv)
    check_grid(a.lengths, a.depths, a.n)
    ck = load_checkpoint(a.checkpoint)
    if ck.data_cfg.get("task") != "passkey" or ck.kind != "decoder":
        raise ConfigError(
            f"{a.checkpoint} was trained on data task {ck.data_cfg.get('task')!r} ({ck.kind}); the needle "
            "grid needs a decoder-only model trained with data=passkey."
        )
    train = ck.data_cfg.get("train_len")
    key_len, bos = int(ck.data_cfg.get("key_len", 5)), bool(ck.data_cfg.get("bos", False))
    cells = needle_grid(
        ck.model, a.lengths, a.depths, n_per_cell=a.n, key_len=key_len, bos=bos, seed=a.seed, train_len=train
    )
    label = f"{ck.variant or ck.pe} [{Path(a.checkpoint).name}]"  # a named variant: its name
    meta = {"label": label, "checkpoint": str(a.checkpoint), "pe": ck.pe, "train_len": train, "seed": a.seed}
    if ck.variant:
        meta["variant"] = ck.variant
    paths = write_needle(cells, a.out, meta)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    return paths
