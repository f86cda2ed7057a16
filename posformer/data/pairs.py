"""Parallel corpora read in batches of sentence pairs and tokenised into token stores.

Nothing holds a split's sentences: WMT14 en-de (4.5M pairs) loads with the memory of its per-pair index
(lengths and offsets: ~40 bytes a pair), not of its text.

- :func:`file_pairs`: aligned batches of lines from ``{split}.{src}`` / ``{split}.{tgt}`` (plain or
  gzip, UTF-8, universal newlines); :func:`hub_pairs`: the same from a hub dataset's ``translation``
  column (:func:`load_hub_pairs` loads it memory-mapped, with its fingerprint).
- :func:`check_pairs`: one pass before anything is written: the two sides have as many lines, and at
  least one pair has text on both sides (the errors of :func:`~posformer.data.files.read_parallel`).
- :func:`encode_split`: both sides of a split tokenised in order (``num_proc`` worker processes,
  :func:`~posformer.data.building.encoded`) into ``<folder>/src`` and ``<folder>/tgt`` shards, one
  document per sentence, then ``<folder>/meta.json``; :func:`open_split` reads them back as
  ``(flat, offsets)`` per side.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from posformer.data.building import encoded
from posformer.data.cache import cache_write_error
from posformer.data.files import human_size
from posformer.data.sources import read_text_chunks
from posformer.data.store import ShardWriter, check_shards, document_ends, remove_tree, token_dtype
from posformer.errors import DataError
from posformer.io import atomic_write_json

Pairs = Iterator[tuple[list[str], list[str]]]
#: sentence pairs per batch
BATCH_PAIRS = 10_000


# ------------------------------------------------------------------------------------------- reading
def lines_of(path: Path) -> Iterator[str]:
    """The lines of a plain or gzip UTF-8 file, without their line ends (universal newlines)."""
    if not path.is_file():
        raise DataError(
            f"translation data file {str(path)!r} does not exist; check data.path and the split/language "
            "names (files are {path}/{split}.{lang} or {path}/{split}.{lang}.gz)."
        )
    where = f"translation data file {str(path)!r}"
    rest = ""
    for chunk in read_text_chunks(path, where, replace_option=False):
        lines = (rest + chunk).split("\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def file_pairs(src: Path, tgt: Path, limit: int | None = None) -> Pairs:
    """Batches of aligned lines of ``src`` and ``tgt`` (the first ``limit`` pairs); a line without its
    partner ends the shorter side (:func:`check_pairs` refuses that before)."""
    pairs = itertools.islice(zip(lines_of(src), lines_of(tgt), strict=False), limit)
    while batch := list(itertools.islice(pairs, BATCH_PAIRS)):
        yield [s for s, _ in batch], [t for _, t in batch]


def read_parallel(src: Path, tgt: Path) -> tuple[list[str], list[str]]:
    """Aligned source/target sentences as lists (a small split: the references of val/test), checked
    as :func:`check_pairs` does."""
    check_pairs(Path(src), Path(tgt))
    return list(lines_of(Path(src))), list(lines_of(Path(tgt)))


def check_pairs(src: Path, tgt: Path) -> int:
    """The number of pairs, read once before anything is written; different line counts or no pair with
    text on both sides is a :class:`DataError` naming both files (with their sizes)."""
    n_src = n_tgt = 0
    usable = False
    for s, t in itertools.zip_longest(lines_of(src), lines_of(tgt)):
        n_src += s is not None
        n_tgt += t is not None
        usable = usable or bool(s and t and s.strip() and t.strip())
    if n_src != n_tgt:
        raise DataError(
            f"parallel files are not aligned: {str(src)!r} has {n_src} lines but {str(tgt)!r} has {n_tgt}; "
            "both sides need one sentence per line, in order."
        )
    if not usable:
        sizes = ", ".join(f"{str(p)!r} {n_src} lines / {human_size(p.stat().st_size)}" for p in (src, tgt))
        raise DataError(
            f"parallel files hold no sentence pair ({sizes}); a split needs at least 1 line with text on "
            "both sides: fill the files or map the split to other files with data.splits."
        )
    return n_src


def load_hub_pairs(name: str, config: str | None, split: str, revision: str | None = None) -> tuple[Any, str]:
    """``(dataset, fingerprint)`` of a hub translation split (downloaded once, memory-mapped)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, revision=revision)
    except Exception as exc:  # noqa: BLE001 - network, missing dataset, missing split: all one message
        raise DataError(
            f"could not load the Hugging Face dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(exc).__name__}: {str(exc)[:300]}. The hub is needed the first time (it is then cached in "
            "HF_DATASETS_CACHE); offline, use data.source=local with data.path pointing at parallel text "
            "files."
        ) from None
    if "translation" not in ds.column_names:
        raise DataError(f"hub dataset {name!r} has columns {ds.column_names}, not a 'translation' column.")
    return ds, str(getattr(ds, "_fingerprint", ""))


def hub_pairs(ds: Any, src_lang: str, tgt_lang: str, where: str, limit: int | None = None) -> Pairs:
    """Batches of ``(source, target)`` sentences of a dataset's ``translation`` column."""
    seen = 0
    for batch in ds.iter(batch_size=BATCH_PAIRS):
        rows = batch["translation"][: None if limit is None else limit - seen]
        try:
            yield [r[src_lang] for r in rows], [r[tgt_lang] for r in rows]
        except KeyError as exc:
            raise DataError(
                f"{where} has no language {exc}; languages: {sorted(rows[0]) if rows else []}. Fix "
                "data.src_lang/tgt_lang."
            ) from None
        seen += len(rows)
        if limit is not None and seen >= limit:
            return


# ------------------------------------------------------------------------------------------- encoding
class SentenceEncoder:
    """A ``tokenizers.Tokenizer`` as the store's tokenizer: sentences -> id lists (no special tokens)."""

    kind = "sentences"

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]


def encode_split(folder: Path, tokenizer: Any, pairs: Callable[[], Pairs], num_proc: int = 1) -> None:
    """Tokenise a split's pairs into ``folder`` (built in ``<folder>.partial``, renamed when complete)."""
    partial = folder.with_name(folder.name + ".partial")
    remove_tree(partial)
    encoder = SentenceEncoder(tokenizer)
    dtype = token_dtype(encoder.vocab_size)
    try:
        partial.mkdir(parents=True)
        writers = {side: ShardWriter(partial, side, dtype) for side in ("src", "tgt")}

        def batches() -> Iterator[tuple[int, list[tuple[str, int, str, bool]]]]:
            start = 0
            for src, tgt in pairs():
                pieces = [("src", start + i, s, True) for i, s in enumerate(src)]
                yield 0, pieces + [("tgt", start + i, t, True) for i, t in enumerate(tgt)]
                start += len(src)

        for (_, pieces), ids in encoded(encoder, batches(), num_proc):
            for (side, index, text, _), piece_ids in zip(pieces, ids, strict=True):
                writers[side].add(piece_ids, (0, index), len(text), True)
        for writer in writers.values():
            writer.close_shard()
        meta = {"dtype": dtype.str, **{side: w.summary() for side, w in writers.items()}}
        atomic_write_json(partial / "meta.json", meta)
        remove_tree(folder)
        os.replace(partial, folder)
    except OSError as exc:
        raise cache_write_error(folder.parent.parent, exc) from None


def open_split(folder: Path) -> dict[str, tuple[Any, np.ndarray]]:
    """``{"src": (flat, offsets (n + 1,)), "tgt": ...}`` of an encoded split; a damaged file raises
    ``ValueError`` naming it."""
    from posformer.data.store import TokenStream

    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    out = {}
    for side in ("src", "tgt"):
        records = meta[side]["shards"]
        check_shards(folder / side, records, np.dtype(meta["dtype"]), f"{folder.name}/{side}")
        stream = TokenStream(folder / side, records, meta["dtype"])
        out[side] = (stream, np.concatenate([[0], document_ends(folder / side, records)]))
    if len(out["src"][1]) != len(out["tgt"][1]):
        n_src, n_tgt = len(out["src"][1]) - 1, len(out["tgt"][1]) - 1
        raise ValueError(f"{folder.name}: {n_src} source but {n_tgt} target sentences")
    return out
