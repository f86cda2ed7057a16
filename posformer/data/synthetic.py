"""Synthetic algorithmic tasks, generated locally (no download).

Every task maps an *instance length* ``n`` (the task size) to a ``(prompt, answer)`` pair of token ids:

==================  ==================================================  ===========================
task                prompt (n = instance length)                        answer
==================  ==================================================  ===========================
``copy``            n random symbols                                    the same symbols
``reverse``         n random symbols                                    the symbols reversed
``sort``            n random symbols (with repeats)                     the symbols sorted (by id)
``addition``        a ``+`` b, two n-digit numbers, most significant    a + b as n+1 digits (zero-
                    digit first (least first if ``reverse_operands``)   padded); least significant
                                                                        digit first when
                                                                        ``reverse_answer`` (default)
``recall``          n key-value pairs ``k v k v ...`` then a query key  the query key's value
                    (keys distinct, so n <= ``symbols``)
``passkey``         n filler tokens with ``<key> d1..dk`` hidden at a   the k digits (k = ``key_len``)
                    uniformly random place (:func:`passkey_prompt` at
                    a chosen depth: :mod:`posformer.eval.needle`)
``indirect_index``  n distinct symbols, then one of them ``X`` and a     the symbol k places left of
                    shift token ``-k`` (1 <= k <= ``max_shift``, k      ``X`` in the n symbols
                    places fit left of ``X``; n <= ``symbols``)
``multikey``,       RULER-style: ``needles`` items hidden in n filler   :mod:`posformer.data.ruler`
``multivalue``,     tokens, then a query
``vartrack``
==================  ==================================================  ===========================

Token ids: PAD=0, BOS=1, EOS=2, SEP=3, then the task's symbols. Sequences:
decoder-only ``[BOS] prompt SEP answer EOS`` (BOS only with ``bos: true``), loss on ``answer EOS``;
encoder-decoder ``src = prompt EOS``, ``tgt = BOS answer``, ``labels = answer EOS``.

Data is built with ``datasets.Dataset.from_generator``; the generator's keyword arguments hold the seed,
the split, the size, every task parameter and a hash of this file, so HF's cache (keyed by them) can
never serve stale data. Splits use independent random streams derived from ``(seed, split, lengths)``:
train and val are drawn from ``train_len``; each evaluation length ``L`` gets ``n_eval_per_length``
instances of exactly size ``L``. Small task spaces can make val/eval instances repeat training ones.

``data.pack=true`` (decoder-only): training rows hold several whole examples, packed in order into
``data.pack_length`` tokens (null: the longest training example), with ``segment_ids``
(:mod:`posformer.data.packing`); validation and evaluation stay one example per row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader

from posformer.data import ruler
from posformer.data.base import BaseDataModule, check_int, eval_batch_size
from posformer.data.cache import drop_damaged_generator_cache
from posformer.data.options import SyntheticOptions, read_options, span
from posformer.data.packing import PackedExamples
from posformer.data.tokenizers import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, SEP_ID, SPECIAL_TOKENS
from posformer.errors import ConfigError
from posformer.rules import raise_problems

N_SPECIAL = len(SPECIAL_TOKENS)
DIGITS = [str(d) for d in range(10)]
SPLIT_CODES = {"train": 1, "val": 2, "eval": 3}
N_FILLER = 5


def _symbol_names(count: int, prefix: str = "") -> list[str]:
    if count <= 26 and not prefix:
        return [chr(ord("a") + i) for i in range(count)]
    return [f"{prefix or 's'}{i}" for i in range(count)]


# ----------------------------------------------------------------------------------------------- tasks
def _copy(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    x = (rng.integers(0, o["symbols"], n) + N_SPECIAL).tolist()
    return x, list(x)


def _reverse(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    x = (rng.integers(0, o["symbols"], n) + N_SPECIAL).tolist()
    return x, x[::-1]


def _sort(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    x = (rng.integers(0, o["symbols"], n) + N_SPECIAL).tolist()
    return x, sorted(x)


def _addition(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    a = rng.integers(0, 10, n)  # most significant digit first
    b = rng.integers(0, 10, n)
    total = int("".join(map(str, a))) + int("".join(map(str, b)))
    s = [int(c) for c in str(total).zfill(n + 1)]
    plus = N_SPECIAL + 10
    if o["reverse_operands"]:
        a, b = a[::-1], b[::-1]
    if o["reverse_answer"]:
        s = s[::-1]
    prompt = [int(d) + N_SPECIAL for d in a] + [plus] + [int(d) + N_SPECIAL for d in b]
    return prompt, [d + N_SPECIAL for d in s]


def _recall(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    s = o["symbols"]
    keys = rng.choice(s, size=n, replace=False) + N_SPECIAL
    values = rng.integers(0, s, n) + N_SPECIAL + s
    q = int(rng.integers(0, n))
    prompt = np.stack([keys, values], axis=1).reshape(-1).tolist() + [int(keys[q])]
    return prompt, [int(values[q])]


def passkey_prompt(n: int, key: list[int], where: int) -> list[int]:
    """``n`` filler tokens with ``<key>`` and the ``key`` ids inserted after the first ``where`` of them."""
    filler = [N_SPECIAL + 11 + (i % N_FILLER) for i in range(n)]
    return filler[:where] + [N_SPECIAL + 10] + key + filler[where:]


def _passkey(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    key = (rng.integers(0, 10, o["key_len"]) + N_SPECIAL).tolist()
    where = int(rng.integers(0, n + 1))
    return passkey_prompt(n, key, where), key


def _indirect_index(rng: np.random.Generator, n: int, o: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Indirect indexing (Gopalakrishnan et al. 2025, PoPE): "which symbol is k to the left of X?".

    ``n`` distinct symbols (ids ``4 … 4+symbols-1``), then ``X`` (one of them, at index ``p >= k``), then
    the shift token ``-k`` (id ``4 + symbols + k - 1``); the answer is the symbol at index ``p - k``.
    The content names ``X``, the position finds its neighbour: a task of content and position together.
    """
    s = o["symbols"]
    seq = rng.choice(s, size=n, replace=False) + N_SPECIAL  # (n,) distinct: X occurs once
    k = int(rng.integers(1, min(o["max_shift"], n - 1) + 1))
    p = int(rng.integers(k, n))
    return [*seq.tolist(), int(seq[p]), N_SPECIAL + s + k - 1], [int(seq[p - k])]


TASKS: dict[str, Callable[[np.random.Generator, int, dict[str, Any]], tuple[list[int], list[int]]]] = {
    "copy": _copy,
    "reverse": _reverse,
    "sort": _sort,
    "addition": _addition,
    "recall": _recall,
    "passkey": _passkey,
    "indirect_index": _indirect_index,
    **ruler.TASKS,
}
TASK_PARAMS = {  # which options change a task's data (only these enter the cache key)
    "copy": ("symbols",),
    "reverse": ("symbols",),
    "sort": ("symbols",),
    "addition": ("reverse_answer", "reverse_operands"),
    "recall": ("symbols",),
    "passkey": ("key_len",),
    "indirect_index": ("symbols", "max_shift"),
    **{name: ruler.PARAMS for name in ruler.TASKS},
}


def task_vocab(task: str, options: dict[str, Any]) -> list[str]:
    """Token names (index = id) of a task: the 4 specials, then the task's symbols."""
    if task in ("copy", "reverse", "sort"):
        names = _symbol_names(options["symbols"])
    elif task == "addition":
        names = [*DIGITS, "+"]
    elif task == "recall":
        names = _symbol_names(options["symbols"], "k") + _symbol_names(options["symbols"], "v")
    elif task == "passkey":
        names = [*DIGITS, "<key>"] + [f"f{i}" for i in range(N_FILLER)]
    elif task == "indirect_index":
        names = _symbol_names(options["symbols"], "s") + [f"-{k}" for k in range(1, options["max_shift"] + 1)]
    elif task in ruler.TASKS:
        names = ruler.vocab(options)
    else:
        raise ConfigError(f"data.task={task!r} is unknown; valid tasks: {', '.join(TASKS)}.")
    return [*SPECIAL_TOKENS, *names]


@lru_cache(maxsize=1)
def _source_hash() -> str:
    sources = Path(__file__).read_bytes() + Path(ruler.__file__).read_bytes()  # the generators' code
    return hashlib.sha256(sources).hexdigest()[:16]


def generate_examples(
    task: str, count: int, len_lo: int, len_hi: int, seed: int, split: str, params: str, source: str
) -> Iterator[dict[str, Any]]:
    """Yield ``count`` instances; a pure function of its arguments (``params``: JSON task options).

    ``source`` (a hash of this file) is unused here but part of HF's cache key.
    """
    del source
    options = json.loads(params)
    rng = np.random.default_rng(
        np.random.SeedSequence([seed & 0xFFFFFFFF, SPLIT_CODES[split], len_lo, len_hi])
    )
    make = TASKS[task]
    for _ in range(count):
        n = int(rng.integers(len_lo, len_hi + 1))
        prompt, answer = make(rng, n, options)
        yield {"n": n, "prompt": prompt, "answer": answer}


FEATURES = datasets.Features(
    {
        "n": datasets.Value("int32"),
        "prompt": datasets.List(datasets.Value("int32")),
        "answer": datasets.List(datasets.Value("int32")),
    }
)


def build_split(
    task: str,
    count: int,
    lengths: tuple[int, int],
    seed: int,
    split: str,
    options: dict[str, Any],
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """One split as an HF dataset (cached by HF, keyed by every argument)."""
    params = json.dumps({k: options[k] for k in TASK_PARAMS[task]}, sort_keys=True)
    kwargs = {
        "task": task,
        "count": int(count),
        "len_lo": int(lengths[0]),
        "len_hi": int(lengths[1]),
        "seed": int(seed),
        "split": split,
        "params": params,
        "source": _source_hash(),
    }
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        try:
            return datasets.Dataset.from_generator(
                generate_examples, features=FEATURES, gen_kwargs=kwargs, cache_dir=cache_dir
            )
        except (ValueError, EOFError) as exc:  # pyarrow's ArrowInvalid is a ValueError: a damaged cache
            drop_damaged_generator_cache(generate_examples, FEATURES, kwargs, cache_dir, exc)
            return datasets.Dataset.from_generator(
                generate_examples, features=FEATURES, gen_kwargs=kwargs, cache_dir=cache_dir
            )
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


# -------------------------------------------------------------------------------------------- collation
def collate_decoder(rows: list[dict[str, Any]], bos: bool = False) -> dict[str, torch.Tensor]:
    """``[BOS] prompt SEP answer EOS`` -> input_ids / labels (shifted; answer+EOS scored) / attention_mask."""
    seqs, starts = [], []
    for r in rows:
        head = ([BOS_ID] if bos else []) + list(r["prompt"]) + [SEP_ID]
        seqs.append(head + list(r["answer"]) + [EOS_ID])
        starts.append(len(head))  # index (in the full sequence) of the first answer token
    width = max(len(s) for s in seqs) - 1
    b = len(seqs)
    input_ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    for i, (s, a) in enumerate(zip(seqs, starts)):
        t = torch.tensor(s, dtype=torch.long)
        m = len(s) - 1
        input_ids[i, :m] = t[:-1]
        mask[i, :m] = True
        labels[i, a - 1 : m] = t[a:]  # output t predicts token t+1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def decoder_example(row: dict[str, Any], bos: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One example's ``input_ids`` (n,) and ``labels`` (n,), as :func:`collate_decoder` makes them."""
    batch = collate_decoder([row], bos)
    return batch["input_ids"][0], batch["labels"][0]


def collate_encoder_decoder(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """``src = prompt EOS``, ``tgt = BOS answer``, ``labels = answer EOS``."""
    srcs = [list(r["prompt"]) + [EOS_ID] for r in rows]
    tgts = [[BOS_ID] + list(r["answer"]) for r in rows]
    b, s_len, t_len = len(rows), max(map(len, srcs)), max(map(len, tgts))
    src = torch.full((b, s_len), PAD_ID, dtype=torch.long)
    tgt = torch.full((b, t_len), PAD_ID, dtype=torch.long)
    labels = torch.full((b, t_len), IGNORE_INDEX, dtype=torch.long)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        src[i, : len(s)] = torch.tensor(s)
        tgt[i, : len(t)] = torch.tensor(t)
        labels[i, : len(t)] = torch.tensor(t[1:] + [EOS_ID])
    return {
        "src_ids": src,
        "src_mask": src != PAD_ID,
        "tgt_ids": tgt,
        "tgt_mask": tgt != PAD_ID,
        "labels": labels,
    }


class _Collate:
    """Picklable collate function (for DataLoader workers)."""

    def __init__(self, model_kind: str, bos: bool) -> None:
        self.model_kind, self.bos = model_kind, bos

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.model_kind == "decoder":
            return collate_decoder(rows, self.bos)
        return collate_encoder_decoder(rows)


# ------------------------------------------------------------------------------------------ datamodule
class SyntheticDataModule(BaseDataModule):
    """Algorithmic tasks. ``eval_dataloaders`` is keyed by instance length; ``train_length`` is the
    largest training instance length (``train_len[1]``)."""

    task_type = "task"
    name = "synthetic"
    Options = SyntheticOptions

    def __init__(self, cfg: SyntheticOptions | Mapping[str, Any], model_kind: str, seed: int) -> None:
        super().__init__()
        o = self.options = read_options(SyntheticOptions, cfg, model_kind)
        self.params = dataclasses.asdict(o)  # the generators' parameters (plain values)
        self.model_kind = model_kind
        self.task = task = o.task
        self.train_len = span(o.train_len)
        self.n_train, self.n_val, self.n_eval = o.n_train, o.n_val, o.n_eval_per_length
        self.batch_size = o.batch_size
        self._eval_batch = o.eval_batch_size
        self.num_workers = o.num_workers
        self.eval_lengths = o.eval_range()
        self.data_seed = int(o.seed if o.seed is not None else seed)
        self.shuffle_seed = int(seed)
        # HF's cache of the generated splits: <cache_dir>/hf_datasets (None: HF's default cache)
        self.cache_dir = str(Path(o.cache_dir).expanduser() / "hf_datasets") if o.cache_dir else None
        self.bos = bool(o.bos)
        self.vocab = task_vocab(task, self.params)
        self.vocab_size = len(self.vocab)
        self.pad_id = PAD_ID
        self.train_length = self.train_len[1]
        self.collate = _Collate(self.model_kind, self.bos)
        self._train = build_split(
            task, self.n_train, self.train_len, self.data_seed, "train", self.params, self.cache_dir
        )
        self._val: datasets.Dataset | None = None
        self._eval: dict[int, datasets.Dataset] = {}
        self.pack = o.pack
        self._packed = self._pack(o.pack_length) if self.pack else None

    def _pack(self, pack_length: Any) -> PackedExamples:
        """The training examples packed into rows of ``pack_length`` tokens (None: the longest example)."""
        if self.model_kind != "decoder":
            raise ConfigError(
                "data.pack=true packs decoder-only sequences; model.kind=encoder_decoder cannot take packed "
                "rows: set data.pack=false or use a decoder model."
            )
        extra = 2 if self.bos else 1  # [BOS] prompt SEP answer (EOS is a label only)
        sizes = [len(p) + len(a) + extra for p, a in zip(self._train["prompt"], self._train["answer"])]
        length = max(sizes) if pack_length is None else pack_length
        return PackedExamples(self._train, sizes, length, partial(decoder_example, bos=self.bos))

    def _check_lengths(self, lengths: list[int]) -> None:
        raise_problems(self.options.recall_problems(lengths))

    # ---- datasets
    def train_dataset(self) -> datasets.Dataset | PackedExamples:
        return self._train if self._packed is None else self._packed

    def val_dataset(self) -> datasets.Dataset:
        if self._val is None:
            self._val = build_split(
                self.task, self.n_val, self.train_len, self.data_seed, "val", self.params, self.cache_dir
            )
        return self._val

    def eval_dataset(self, length: int) -> datasets.Dataset:
        length = check_int("eval length", length)
        if length not in self._eval:
            self._check_lengths([length])
            self._eval[length] = build_split(
                self.task, self.n_eval, (length, length), self.data_seed, "eval", self.params, self.cache_dir
            )
        return self._eval[length]

    # ---- loaders
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset(), self._eval_batch or self.batch_size)

    def eval_dataloaders(self, lengths: list[int] | None = None) -> dict[int, DataLoader]:
        """One loader per instance length (default: the configured evaluation lengths)."""
        base = self._eval_batch or self.batch_size
        out = {}
        for length in sorted(set(lengths if lengths is not None else self.eval_lengths)):
            bs = eval_batch_size(length, base * self.train_length, base)
            out[int(length)] = self._loader(self.eval_dataset(length), bs)
        return out

    # ---- misc
    def decode(self, ids: Any) -> str:
        """Token ids -> space-separated symbols (PAD and -100 dropped)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return " ".join(
            self.vocab[i] if 0 <= i < self.vocab_size else f"<{i}?>"
            for i in ids
            if i not in (PAD_ID, IGNORE_INDEX)
        )

    def config_summary(self) -> dict[str, Any]:
        params = {k: self.params[k] for k in TASK_PARAMS[self.task]}
        return {
            "name": "synthetic",
            "task": self.task,
            **params,
            "model_kind": self.model_kind,
            "vocab_size": self.vocab_size,
            "train_len": list(self.train_len),
            "train_length": self.train_length,
            "eval_lengths": self.eval_lengths,
            "n_train": self.n_train,
            "n_val": self.n_val,
            "n_eval_per_length": self.n_eval,
            "batch_size": self.batch_size,
            "data_seed": self.data_seed,
            "shuffle_seed": self.shuffle_seed,
            "bos": self.bos,
            "pack": self.pack,
        }


def build_synthetic(cfg: dict[str, Any], model_kind: str, seed: int) -> SyntheticDataModule:
    return SyntheticDataModule(cfg, model_kind, seed)
