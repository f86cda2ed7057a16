"""Each dataset's options, declared once (fields, defaults, rules, :meth:`problems` for checks that
combine fields), and :data:`DATASETS`, the one table of datasets. Light: Hydra reads it to compose."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import OmegaConf

from posformer.conform import conform
from posformer.data import ruler
from posformer.model.config import MODEL_KINDS
from posformer.rules import (
    POSITIVE_INT,
    Rule,
    at_least,
    is_int,
    one_of,
    raise_problems,
    rule_problems,
    ruled,
    seed,
    worded,
)

__all__ = ["DATASETS", "Dataset", "lengths", "read_options", "span"]

#: data=synthetic's tasks (posformer.data.synthetic.TASKS generates them; the RULER ones are ruler's)
TASKS = ("copy", "reverse", "sort", "addition", "recall", "passkey", "indirect_index", *ruler.TASKS)
#: tasks whose instances are ``n`` distinct symbols (or keys): ``n <= data.symbols``
DISTINCT = {"recall": "keys", "indirect_index": "symbols"}


def range_rule(minimum: int = 1) -> Rule:
    """``[min, max]`` (or one integer ``n`` = ``[n, n]``) of integers with ``minimum <= min <= max``."""

    def line(key: str, value: Any) -> str | None:
        pair = [value, value] if is_int(value) else value
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            return f"{key}={value!r} must be [min, max] (two integers) or one integer."
        bad = next((i for i, v in enumerate(pair) if not (is_int(v) and v >= minimum)), None)
        if bad is not None:
            return f"{key}[{bad}]={pair[bad]!r} must be an integer >= {minimum}."
        lo, hi = pair
        return (
            f"{key}={list(pair)}: min {lo} is greater than max {hi}; write [{hi}, {lo}]." if lo > hi else None
        )

    return Rule(line=line)


def _lengths_line(key: str, value: Any) -> str | None:
    if not isinstance(value, list | tuple) or not all(is_int(v) for v in value):
        return f"{key}={value!r} must be a list of integers, e.g. [16, 32, 64]."
    bad = [v for v in value if v < 1]
    return f"{key}={list(value)} contains non-positive lengths {bad}; lengths must be >= 1." if bad else None


SEED = seed(" or null (null: the run seed)")
LENGTHS, RANGE = Rule(line=_lengths_line), range_rule()
TASKS_RULE = worded(
    lambda v: v in TASKS, lambda k, v: f"{k}={v!r} is unknown; valid tasks: {', '.join(TASKS)}."
)
SYMBOLS = at_least(1, limit="an integer >= 2 (>= 1 for data.task=recall)")


def span(value: Any) -> tuple[int, int]:
    """A checked ``[min, max]`` or ``n`` (:class:`RangeRule`) as ``(min, max)``."""
    return (int(value), int(value)) if is_int(value) else (int(value[0]), int(value[1]))


def lengths(value: Any) -> list[int]:
    """Checked evaluation lengths (null or empty: ``[]``), sorted, each once."""
    return sorted({int(v) for v in value or ()})


@dataclass(frozen=True)
class SyntheticOptions:
    """``data=synthetic``: algorithmic tasks (posformer/data/synthetic.py documents each)."""

    model_kinds: ClassVar[tuple[str, ...]] = MODEL_KINDS  # the model kinds it feeds
    name: str = "synthetic"
    task: str = ruled("reverse", TASKS_RULE)
    train_len: Any = ruled([1, 8], RANGE)  # instance lengths [min, max] (or one length)
    eval_len: Any = ruled(None, RANGE)  # [min, max]: every length in the range (instead of eval_lengths)
    eval_lengths: Any = ruled([4, 8, 10, 12, 16, 24, 32, 48, 64], LENGTHS)
    # alphabet size: >= 2, but recall's keys and values are two alphabets (problems)
    symbols: int = ruled(16, SYMBOLS)
    n_train: int = ruled(20000, at_least(1))
    n_val: int = ruled(512, at_least(1))
    n_eval_per_length: int = ruled(256, at_least(1))
    batch_size: int = ruled(64, POSITIVE_INT)
    eval_batch_size: int | None = ruled(None, POSITIVE_INT)  # null: batch_size, shrunk at long lengths
    num_workers: int = ruled(0, at_least(0))
    seed: int | None = ruled(None, SEED)  # the data's seed; null: the run seed
    cache_dir: str | None = None
    bos: bool = False  # decoder-only: start sequences with BOS
    reverse_answer: bool = True  # addition: sum written least significant digit first
    reverse_operands: bool = False  # addition: operands written least significant digit first
    key_len: int = ruled(5, at_least(1))  # passkey: digits of the key
    max_shift: int = ruled(8, at_least(1))  # indirect_index: the largest shift k asked for
    needles: int = ruled(4, at_least(1))  # RULER tasks: items hidden per instance (posformer.data.ruler)
    pack: bool = False  # several whole examples per training row (decoder-only)
    pack_length: int | None = ruled(None, at_least(1, null="the longest training example"))

    def eval_range(self) -> list[int]:
        """The evaluation lengths: ``eval_len``'s range, else ``eval_lengths``, else every training length."""
        if self.eval_len is not None:
            lo, hi = span(self.eval_len)
            return list(range(lo, hi + 1))
        lo, hi = span(self.train_len)
        return lengths(self.eval_lengths) or list(range(lo, hi + 1))

    def problems(self) -> list[str]:
        """The task's alphabet against its lengths and needles."""
        if self.task != "recall" and self.symbols < 2:  # the field's rule holds for recall's 1
            return [SYMBOLS.message("data.symbols", self.symbols)]
        need = ruler.names_needed(self.task, self.needles) if self.task in ruler.TASKS else 0
        if need > self.symbols:
            return [
                f"data.task={self.task} with data.needles={self.needles} draws {need} distinct names, but "
                f"data.symbols={self.symbols}; set data.symbols>={need} or fewer needles."
            ]
        return self.recall_problems([*span(self.train_len), *self.eval_range()])

    def recall_problems(self, lengths: list[int]) -> list[str]:
        """``data.task=recall`` (``indirect_index``) draws distinct keys (symbols): every instance length
        must be ``<= data.symbols``; ``indirect_index`` asks for a left neighbour, so also ``>= 2``."""
        what = DISTINCT.get(self.task)
        if what is None:
            return []
        if self.task == "indirect_index" and min(lengths) < 2:
            return [
                f"data.task=indirect_index needs a symbol left of X: instance length {min(lengths)} is "
                "below 2; set data.train_len and the evaluation lengths >= 2."
            ]
        if max(lengths) <= self.symbols:
            return []
        return [
            f"data.task={self.task} needs distinct {what}: instance length {max(lengths)} exceeds "
            f"data.symbols={self.symbols}; set data.symbols>={max(lengths)} or shorten the lengths."
        ]


TOKENIZER = Rule(
    limit="char, byte, bpe, or a pretrained tokenizer: a tokenizer.json, an HF tokenizer folder or a hub id",
    test=lambda v: bool(v.strip()),
)


@dataclass(frozen=True)
class LMOptions:
    """The options of every language-model dataset (``data=text``, ``hub``, ``corpus``)."""

    model_kinds: ClassVar[tuple[str, ...]] = ("decoder",)
    name: str = "lm"
    tokenizer: str = ruled("char", TOKENIZER)  # char | byte | bpe | tokenizer.json | folder | hub id
    vocab_size: int | None = 4096  # bpe only
    block_size: int = ruled(256, at_least(1))  # training length (tokens per training window)
    val_fraction: float = ruled(0.1, Rule(limit="a number in (0, 1), e.g. 0.1", test=lambda v: 0 < v < 1))
    eval_lengths: Any = ruled([64, 128, 256, 512, 1024], LENGTHS)
    eval_tokens: int = ruled(16384, at_least(1))  # scored tokens per evaluation length
    # stream: windows anywhere in the validation stream | documents: each window inside one document
    eval_windows: str = ruled("stream", one_of("stream", "documents"))
    val_tokens: int | None = ruled(None, at_least(1, null="the whole validation split"))  # validation's cap
    eval_batch_size: int | None = ruled(None, POSITIVE_INT)  # null: batch_size, shrunk at long lengths
    batch_size: int = ruled(32, POSITIVE_INT)
    num_workers: int = ruled(0, at_least(0))
    # processes that tokenise while the store is built (null: one per CPU core this process may use)
    num_proc: int | None = ruled(1, at_least(1, null="one per available CPU core"))
    max_tokens: int | None = ruled(None, at_least(1, null="the whole source"))  # the first max_tokens tokens
    encoding_errors: str = ruled("strict", one_of("strict", "replace"))
    seed: int | None = ruled(None, SEED)
    cache_dir: str | None = None
    pack: bool = False  # packed documents per training row
    doc_separator: str = "\n\n"  # where the training text is cut into documents (pack=true)

    def problems(self) -> list[str]:
        """Options read only in some settings: the BPE vocabulary, the separator of packed documents."""
        out = []
        if self.tokenizer == "bpe" and (self.vocab_size or 0) < 1:  # typed int or null
            out.append(f"data.vocab_size={self.vocab_size!r} must be an integer >= 1.")
        if self.pack and not self.doc_separator:
            out.append(
                f"data.doc_separator={self.doc_separator!r} must be a non-empty string, e.g. '\\n\\n' "
                "(a blank line)."
            )
        return out


@dataclass(frozen=True)
class TextOptions(LMOptions):
    """``data=text``: a local UTF-8 text file (the datamodule checks the path)."""

    name: str = "text"
    path: str | None = None


@dataclass(frozen=True)
class HubOptions(LMOptions):
    """``data=hub``: a text column of an HF dataset (the hub, a local file or a saved folder)."""

    name: str = "hub"
    dataset: str | None = None
    config: str | None = None
    revision: str | None = None
    text_column: str = "text"
    train_split: str = "train"
    val_split: str | None = "validation"  # null: the last val_fraction of the training split
    data_files: Any = None  # HF's data_files: a path, a list of paths, or {split: path(s)}
    streaming: bool = False  # hub datasets: read the rows as a stream (no download)
    sample_by: str = ruled("line", one_of("line", "paragraph", "document"))  # text files: one row per ...


@dataclass(frozen=True)
class CorpusOptions(LMOptions):
    """``data=corpus``: the English-like text posformer generates (posformer/data/corpus.py)."""

    name: str = "corpus"
    n_chars: int = ruled(200_000, at_least(1000))  # characters generated (train + validation)
    corpus_seed: int = 0  # the generator's seed (one corpus for every run seed)


SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class TranslationOptions:
    """``data.name=translation``: a parallel corpus with a joint BPE (posformer/data/translation.py)."""

    model_kinds: ClassVar[tuple[str, ...]] = ("encoder_decoder",)
    name: str = "translation"
    source: str = ruled("local", one_of("local", "hub", note="(local: data.path, hub: data.hub_name)"))
    path: str | None = None  # local: directory holding {split}.{lang}[.gz]
    src_lang: str = "de"
    tgt_lang: str = "en"
    splits: dict[str, str] = ruled({"train": "train", "val": "val", "test": "test_2016_flickr"})
    hub_name: str | None = None  # hub: e.g. wmt14
    hub_config: str | None = None  # hub: e.g. de-en
    hub_revision: str | None = None
    vocab_size: int = ruled(8000, at_least(260))  # joint BPE vocabulary (the 4 specials + 256 bytes at least)
    min_frequency: int = 2
    max_len: int = ruled(256, at_least(2))  # drop training pairs with a side longer than this (tokens + EOS)
    n_train: int | None = ruled(None, at_least(1, null="every training pair"))  # the first n training pairs
    max_tokens: int = ruled(4096, at_least(1))  # padded tokens per batch, per side
    eval_max_tokens: int | None = ruled(None, at_least(1, null="data.max_tokens"))
    max_sentences: int | None = ruled(None, at_least(1, null="no cap"))  # pairs per batch
    eval_lengths: Any = ruled(None, LENGTHS)  # the test set bucketed by source length (upper bounds)
    num_workers: int = ruled(0, at_least(0))
    num_proc: int = ruled(1, at_least(1))  # processes that tokenise while a split is encoded
    seed: int | None = ruled(0, SEED)
    cache_dir: str | None = None

    def problems(self) -> list[str]:
        """Where the corpus is, two languages, three splits, a batch that holds the longest pair."""
        out = []
        if self.source == "local" and not self.path:
            out.append("data.source=local needs data.path: the directory holding {split}.{lang}[.gz].")
        if self.source == "hub" and not self.hub_name:
            out.append("data.source=hub needs data.hub_name (e.g. wmt14) and data.hub_config (e.g. de-en).")
        if self.src_lang == self.tgt_lang:
            out.append(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}; pick two languages.")
        missing = [s for s in SPLITS if s not in self.splits]
        if missing:
            out.append(
                f"data.splits={self.splits} lacks {missing}; map each of train/val/test to a split name."
            )
        if self.max_tokens < self.max_len:
            out.append(
                f"data.max_tokens={self.max_tokens} is smaller than data.max_len={self.max_len}: the longest "
                f"training pair would not fit a batch; raise max_tokens to >= {self.max_len}."
            )
        return out


@dataclass(frozen=True)
class Dataset:
    """One entry of :data:`DATASETS`: the options class (``None``: a plugin checks its own) and the
    datamodule: ``module:Class``, or a plugin's builder ``(options, model_kind, seed) -> datamodule``."""

    options: type | None
    datamodule: str | Callable[[Any, str, int], Any]


#: every built-in dataset: ``data.name`` -> its options and datamodule
DATASETS: dict[str, Dataset] = {
    "synthetic": Dataset(SyntheticOptions, "posformer.data.synthetic:SyntheticDataModule"),
    "text": Dataset(TextOptions, "posformer.data.text:TextDataModule"),
    "hub": Dataset(HubOptions, "posformer.data.hub:HubDataModule"),
    "corpus": Dataset(CorpusOptions, "posformer.data.corpus:CorpusDataModule"),
    "translation": Dataset(TranslationOptions, "posformer.data.translation:TranslationDataModule"),
}


def _plain(value: Any) -> Any:
    """numpy scalars (and lists of them) as Python values: OmegaConf takes Python values only."""
    if hasattr(value, "item") and not isinstance(value, list | tuple | Mapping):
        return value.item()
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def option_problems(cls: type, given: Mapping[str, Any] | Any) -> tuple[Any, list[str]]:
    """``(options, problems)`` of ``given`` (a mapping, or already an instance of ``cls``): unknown keys,
    types and each option's rule, then :meth:`problems` when every option keeps its type and rule
    (``options`` is ``None`` if a type or key is wrong)."""
    if isinstance(given, cls):
        return given, []
    node, problems = conform(cls, {k: _plain(v) for k, v in dict(given).items()}, "data.")
    if problems:
        return None, problems
    options = OmegaConf.to_object(node)
    problems = rule_problems(options, "data.")
    return options, problems or (options.problems() if hasattr(options, "problems") else [])


def read_options(cls: type, given: Mapping[str, Any] | Any, model_kind: str | None = None) -> Any:
    """The checked options of a ``cls`` dataset from a mapping (``name`` allowed) or an instance, or one
    :class:`~posformer.errors.ConfigError` listing every problem; ``model_kind``: refused if the
    dataset cannot feed it. Called first in a datamodule's constructor."""
    options, problems = option_problems(cls, given)
    kinds = getattr(cls, "model_kinds", MODEL_KINDS)  # a plugin's own options class: any kind
    if model_kind is not None and model_kind not in kinds:
        valid = ", ".join(kinds)
        problems.append(f"model kind {model_kind!r} is not supported for data={cls.name}; valid: {valid}.")
    raise_problems(problems)
    return options
