"""Passkey retrieval for any language model (Mohtashami & Jaggi 2023): accuracy per prompt length ×
needle depth, zero-shot.

A haystack of filler sentences (:data:`FILLER`, repeated) encoded by the run's own tokenizer, with the
needle :data:`NEEDLE` (``The pass key is 48213. Remember it. 48213 is the pass key.``) inserted at a word
boundary at the cell's depth, then :data:`QUESTION` (``What is the pass key? The pass key is``); the model
greedily continues, and a key counts as retrieved when the first number it writes is the key. Each piece
is encoded on its own and the ids joined (a BPE tokenizer may merge differently across a seam than in one
text), and the filler is cut at word boundaries, so a prompt is within a word of its nominal length.

Depths are sampled as in the needle grid (:mod:`posformer.eval.needle`): ``bins`` equal bins over the
haystack, each key at a uniform random word boundary of its bin; ``depths`` gives fixed depths instead.
A tokenizer that cannot encode the filler, the digits or the question (a character vocabulary without
them) is refused in one line before any decoding.

``posformer-needle <run>/checkpoints/last.ckpt --mode passkey --lengths 256 512 1024 --out passkey/``
writes ``passkey.{json,csv,md}`` and the heat map ``passkey.{png,svg}``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from posformer.checkpoints import load_checkpoint
from posformer.data import load_tokenizer_dir
from posformer.errors import ConfigError, PositionRangeError
from posformer.eval.decoding import generate
from posformer.eval.needle import bin_positions, check_grid, depth_table, heat_map
from posformer.model.config import describe_schedule
from posformer.utils.format import write_tables

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
FIELDS = (
    "length",
    "depth",
    "depth_lo",
    "depth_hi",
    "accuracy",
    "n_sequences",
    "mean_tokens",
    "in_distribution",
)


def check_passkey_grid(
    lengths: Sequence[int], depths: Sequence[float] | None, n_per_cell: int, bins: int | None
) -> None:
    """One line for a bad grid (depth bins are fractions of the haystack: any length takes any count)."""
    if depths is None and (bins is None or bins < 1):
        raise ConfigError(f"passkey bins={bins!r} must be >= 1 (depth bins; or give --depths).")
    check_grid(lengths, depths, n_per_cell, None if depths is not None else 1)


def _encode(tok: Any, text: str) -> list[int]:
    return [int(i) for i in tok.encode(text)]


def check_tokenizer(tok: Any, vocab_size: int, key_len: int) -> None:
    """One line when ``tok`` cannot encode (and decode back) the filler, the needle with every digit, or
    the question, or gives ids past the model's vocabulary."""
    digits = "0123456789"
    for what, text in (
        ("the filler", FILLER),
        ("the digits", NEEDLE.format(key=digits[:key_len] + digits[key_len:])),
        ("the question", QUESTION),
    ):
        ids = _encode(tok, text)
        back = tok.decode(ids)
        if back != text:
            missing = sorted({c for c in text if c not in back}) or ["(a round trip changes the text)"]
            raise ConfigError(
                f"passkey: the run's {getattr(tok, 'kind', '?')} tokenizer cannot encode {what} "
                f"({''.join(missing)!r} missing: {text!r} decodes as {back!r}); the passkey test needs a "
                "tokenizer whose vocabulary holds English letters, digits and punctuation (train on such "
                "text, or use a byte/bpe tokenizer)."
            )
        if ids and max(ids) >= vocab_size:
            raise ConfigError(
                f"passkey: the tokenizer gives id {max(ids)} >= the model's vocab_size={vocab_size}; pass "
                "the run's own tokenizer."
            )


class Haystack:
    """The filler ids of a tokenizer, with the word boundaries a needle or the question may sit at."""

    def __init__(self, tok: Any, n_tokens: int):
        self.tok = tok
        piece = _encode(tok, FILLER)
        reps = -(-(n_tokens + 1) // max(1, len(piece))) + 1
        self.ids = piece * reps  # (N,) the filler sentences, encoded once and repeated
        pieces = [tok.decode([i]) for i in self.ids]
        # a boundary i: the filler before it ends with a space, or the token at i starts with one
        self.space_before = np.array([p.startswith(" ") for p in pieces])
        self.space_after = np.array([False, *(p.endswith(" ") for p in pieces[:-1])])  # the token before
        self.boundaries = np.flatnonzero(self.space_after | self.space_before | (np.arange(len(pieces)) == 0))

    def snap(self, i: int) -> int:
        """The last word boundary at or before filler position ``i``."""
        return int(self.boundaries[np.searchsorted(self.boundaries, i, side="right") - 1])

    def glued(self, text: str, i: int) -> list[int]:
        """``text`` encoded to sit before filler position ``i`` (a space on the side the filler lacks)."""
        return _encode(self.tok, (" " + text) if i > 0 and self.space_before[i] else (text + " "))

    def prompt(self, length: int, where: float, key: str) -> list[int]:
        """About ``length`` ids: the filler with the needle at depth ``where`` (a fraction of the filler),
        then the question."""
        needle = self.glued(NEEDLE.format(key=key), 1)
        question = _encode(self.tok, " " + QUESTION)
        n_fill = self.snap(max(0, length - len(needle) - len(question)))
        at = self.snap(int(round(where * n_fill)))
        needle = self.glued(NEEDLE.format(key=key), at)
        if n_fill == 0 or self.space_after[n_fill]:  # the filler kept ends with a space
            question = _encode(self.tok, QUESTION)
        return self.ids[:at] + needle + self.ids[at:n_fill] + question


def retrieved(tok: Any, continuation: Sequence[int], key: str) -> bool:
    """Whether the first number in the decoded continuation is ``key``."""
    m = re.search(r"\d+", tok.decode([int(i) for i in continuation]))
    return m is not None and m.group(0) == key


@torch.inference_mode()
def passkey_grid(
    model: nn.Module,
    tok: Any,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    *,
    bins: int | None = 10,
    n_per_cell: int = 16,
    key_len: int = 5,
    seed: int = 0,
    train_len: int | None = None,
) -> list[dict[str, Any]]:
    """One dict per (length, depth) cell (keys :data:`FIELDS`): greedy passkey accuracy of ``model``."""
    check_passkey_grid(lengths, depths, n_per_cell, bins)
    vocab = int(getattr(getattr(model, "cfg", None), "vocab_size", 0) or 1 << 62)
    check_tokenizer(tok, vocab, key_len)
    model.eval()
    device = next(model.parameters()).device
    hay = Haystack(tok, max(lengths))
    max_new = len(_encode(tok, " " + "9" * key_len)) + 2
    cells = []
    for length in lengths:
        n_cols = len(depths) if depths is not None else int(bins)
        for j in range(n_cols):
            rng = np.random.default_rng(np.random.SeedSequence([seed, length, n_cols, j]))
            if depths is not None:
                d = lo = hi = float(depths[j])
            else:
                span = bin_positions(1000, j, n_cols)  # the bin as a fraction, on a fine grid
                d, lo, hi = (j + 0.5) / n_cols, span.start / 1000, (span.stop - 1) / 1000
            hits, sizes, reason = 0, [], None
            for _ in range(n_per_cell):
                key = str(int(rng.integers(10 ** (key_len - 1), 10**key_len)))
                where = d if depths is not None else float(rng.uniform(lo, hi))
                ids = torch.tensor([hay.prompt(length, where, key)], device=device)
                sizes.append(ids.shape[1])
                try:
                    out = generate(model, ids, max_new, use_cache=False)
                except PositionRangeError as exc:
                    reason = str(exc)
                    break
                hits += retrieved(tok, out[0, ids.shape[1] :].tolist(), key)
            cells.append(
                {
                    "length": int(length),
                    "depth": d,
                    "depth_lo": lo,
                    "depth_hi": hi,
                    "accuracy": float("nan") if reason else hits / n_per_cell,
                    "n_sequences": 0 if reason else n_per_cell,
                    "mean_tokens": float(np.mean(sizes)),
                    "in_distribution": None if train_len is None else bool(length <= train_len),
                    **({"reason": reason} if reason else {}),
                }
            )
    return cells


def write_passkey(cells: list[dict[str, Any]], out_dir: Path | str, meta: dict[str, Any]) -> dict[str, Path]:
    """``passkey.{json,csv,md}`` and the heat map ``passkey.{png,svg}`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = [
        f"# Passkey retrieval: {meta.get('label', '')}",
        "",
        f"Greedy retrieval accuracy per prompt length in tokens (rows) and needle depth (columns), "
        f"{cells[0]['n_sequences']} keys of {meta.get('key_len', 5)} digits per cell; filler "
        f"{FILLER.strip()!r}, the run's tokenizer.",
        "",
        depth_table(cells, "accuracy"),
        "",
    ]
    paths = write_tables(out, "passkey", cells, FIELDS, "\n".join(md), {"meta": meta, "cells": cells})
    title = f"Passkey retrieval (zero-shot): {meta.get('label', '')}"
    paths["png"] = heat_map(
        cells, out / "passkey.png", title, metric="accuracy", ylabel="prompt length, tokens (* = trained)"
    )
    paths["svg"] = paths["png"].with_suffix(".svg")
    return paths


def main_passkey(a: argparse.Namespace) -> dict[str, Path]:
    """``posformer-needle CHECKPOINT --mode passkey ...``: a language model's passkey grid."""
    check_passkey_grid(a.lengths or [1], a.depths, a.n, a.bins)
    if a.key_len < 1:
        raise ConfigError(f"passkey --key-len={a.key_len} must be >= 1 (digits of the key).")
    ck = load_checkpoint(a.checkpoint)
    tok_dir = Path(a.checkpoint).resolve().parent.parent / "tokenizer"
    if ck.kind != "decoder" or not (tok_dir / "meta.json").is_file():
        raise ConfigError(
            f"{a.checkpoint} is a {ck.kind} model without a run tokenizer ({tok_dir} holds none; data task "
            f"{ck.data_cfg.get('task')!r}); --mode passkey needs a decoder-only language model run "
            "(trained on text, with <run>/tokenizer/)."
        )
    tok = load_tokenizer_dir(tok_dir)
    block = ck.data_cfg.get("block_size")
    lengths = a.lengths or ([int(block) * m for m in (1, 2, 4)] if block else None)
    if not lengths:
        raise ConfigError(f"{a.checkpoint}: no data.block_size in its config; pass --lengths.")
    check_passkey_grid(lengths, a.depths, a.n, a.bins)
    check_tokenizer(tok, int(ck.model_cfg.get("vocab_size", 1 << 62)), a.key_len)
    cells = passkey_grid(
        ck.model,
        tok,
        lengths,
        a.depths,
        bins=a.bins,
        n_per_cell=a.n,
        key_len=a.key_len,
        seed=a.seed,
        train_len=int(block) if block else None,
    )
    label = f"{describe_schedule(ck.model_cfg)} [{Path(a.checkpoint).resolve().parent.parent.name}]"
    meta = {
        "label": label,
        "checkpoint": str(a.checkpoint),
        "pe": ck.pe,
        "train_len": block,
        "seed": a.seed,
        "key_len": a.key_len,
        "tokenizer": getattr(tok, "kind", None),
        "depths": a.depths if a.depths is not None else f"{a.bins} sampled bins",
    }
    paths = write_passkey(cells, a.out, meta)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    return paths
