"""A trained run from its run dir or checkpoint: :func:`load_run` returns a :class:`Run` (the network in
eval mode, its tokenizer, config and results) that encodes, decodes, samples (:meth:`Run.generate`) and
translates with beam search (:meth:`Run.translate`).

The one loader of a finished run, below the entry points: :mod:`posformer.api` re-exports it,
``posformer-generate`` and ``posformer-inspect`` (``run=``) call it.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posformer.checkpoints import LoadedCheckpoint, find_checkpoints, load_checkpoint, load_run_config
from posformer.data import load_tokenizer_dir
from posformer.devices import torch_device
from posformer.errors import CheckpointError, ConfigError, DataError, PosformerWarning
from posformer.eval.decoding import BOS_ID, EOS_ID, PAD_ID, beam_search, generate
from posformer.utils.memory import window_cost_words

__all__ = [
    "MAX_GENERATE_LENGTH",
    "Run",
    "check_beam_settings",
    "check_sampling",
    "check_text",
    "find_run_checkpoint",
    "load_run",
]

#: the smallest sampling temperature above 0: below it ``logits / temperature`` overflows float32 for
#: ordinary logits, and sampling is greedy decoding already (use ``temperature=0``)
MIN_TEMPERATURE = 1e-4
#: the largest: above it every token is about equally likely, whatever the model says
MAX_TEMPERATURE = 1e4
#: ``torch.Generator.manual_seed`` takes a signed 64-bit integer; sample ``i`` uses ``seed + i``
SEED_LIMIT = 2**63
#: the default ``max_length`` of :meth:`Run.generate` (prompt + new tokens; ``None``: no limit)
MAX_GENERATE_LENGTH = 65_536


# ------------------------------------------------------------------------------------ shared checks
def _int(key: str, value: Any, minimum: int, example: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}; e.g. {key}={example}.")
    return int(value)


def check_sampling(*, max_new_tokens: Any, temperature: Any, top_k: Any, seed: Any, samples: Any = 1) -> None:
    """The sampling settings of :meth:`Run.generate` and ``posformer-generate``: one
    :class:`ConfigError` line naming the value, the limit and a fix."""
    _int("max_new_tokens", max_new_tokens, 1, 100)
    n = _int("samples", samples, 1, 3)
    if top_k is not None:
        _int("top_k", top_k, 1, 40)
    if seed is not None:
        _int("seed", seed, 0, 0)
        if seed + n - 1 >= SEED_LIMIT:
            uses = f"seed={seed}" if n == 1 else f"seed={seed} with samples={n} (seeds up to {seed + n - 1})"
            raise ConfigError(
                f"{uses} is too large: torch's generator takes seeds below 2**63 = {SEED_LIMIT}; use a "
                "smaller seed, e.g. seed=0."
            )
    t = temperature
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise ConfigError(
            f"temperature={t!r} must be a finite number >= 0 (0 = greedy); e.g. temperature=0.8."
        )
    if 0 < t < MIN_TEMPERATURE:
        raise ConfigError(
            f"temperature={t!r} is below {MIN_TEMPERATURE}, the smallest that samples (logits / temperature "
            "overflows float32, and the choice is the most likely token already): use temperature=0 "
            f"(greedy) or temperature >= {MIN_TEMPERATURE}."
        )
    if t > MAX_TEMPERATURE:
        raise ConfigError(
            f"temperature={t!r} is above {MAX_TEMPERATURE:g}: every token would be about equally likely, the "
            f"model ignored; use temperature <= {MAX_TEMPERATURE:g} (1.0 samples the model as trained)."
        )


def check_beam_settings(*, beam_size: Any, alpha: Any, max_len_b: Any) -> None:
    """The beam-search settings of :meth:`Run.translate` and ``posformer-generate source=...``."""
    _int("beam_size", beam_size, 1, 4)
    _int("max_len_b", max_len_b, 1, 50)
    a = alpha
    if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or a < 0:
        raise ConfigError(
            f"alpha={a!r} must be a finite number >= 0 (0 = no length penalty); e.g. alpha=0.6."
        )


def check_text(key: str, text: Any) -> None:
    """A prompt or source: a string that is valid UTF-8 (a command line's undecodable bytes arrive as
    lone surrogates) or a sequence of integer token ids."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raw = os_bytes(text[exc.start : exc.end])
            raise DataError(
                f"{key} is not valid UTF-8: byte {raw} at character {exc.start} ({text[: exc.start][-20:]!r} "
                "before it); pass UTF-8 text (e.g. convert it with iconv -t UTF-8)."
            ) from None
        return
    if isinstance(text, Sequence) and not isinstance(text, bytes | bytearray):
        bad = [t for t in text if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if not bad:
            return
        raise ConfigError(
            f"{key}={list(text)!r} holds {bad[:3]}; token ids are integers >= 0, e.g. [5, 6, 7]."
        )
    raise ConfigError(
        f"{key}={text!r} is a {type(text).__name__}; pass a string or a list of token ids, e.g. [5, 6, 7]."
    )


def os_bytes(surrogates: str) -> str:
    """``'\\udcff'`` (bytes a command line could not decode) -> ``0xff``."""
    try:
        raw = surrogates.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte maps to
        return ascii(surrogates)
    return " ".join(f"0x{b:02x}" for b in raw)


@dataclass
class Run:
    """A trained run loaded by :func:`load_run`: the network (eval mode), its tokenizer (``None`` for
    synthetic tasks: prompts are symbol ids), the run's config and results."""

    run_dir: Path
    checkpoint: Path
    model: torch.nn.Module = field(repr=False)
    tokenizer: Any = field(repr=False)
    config: dict[str, Any] = field(repr=False)
    results: dict[str, Any] = field(repr=False)
    loaded: LoadedCheckpoint = field(repr=False)

    @property
    def kind(self) -> str:
        return self.loaded.kind

    @property
    def pe(self) -> str:
        return self.loaded.pe

    @property
    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per evaluated length, the metrics training wrote (``results.json``); ``{}`` if none."""
        return {int(r["length"]): dict(r) for r in self.results.get("results") or []}

    def to(self, device: str | torch.device) -> Run:
        self.model.to(torch_device(str(device)))
        return self

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode(self, text: str | Sequence[int], key: str = "prompt") -> list[int]:
        """Token ids of ``text`` (a string needs the run's tokenizer; ids pass through), checked: valid
        UTF-8, ids inside the model's vocabulary (:func:`check_text`)."""
        check_text(key, text)
        if not isinstance(text, str):
            ids = [int(t) for t in text]
            vocab = int(self.loaded.model_cfg.get("vocab_size") or 0)
            outside = [i for i in ids if vocab and i >= vocab]
            if outside:
                raise DataError(
                    f"{key}={ids!r} holds ids {outside[:3]} outside the model's vocabulary "
                    f"(ids 0..{vocab - 1}, vocab_size={vocab}); use ids below {vocab}."
                )
            return ids
        if self.tokenizer is None:
            raise DataError(
                f"run {str(self.run_dir)!r} has no tokenizer (a synthetic task): pass the {key} as a "
                "list of symbol ids, e.g. [5, 6, 7]."
            )
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``: posformer's tokenizers drop PAD/BOS/EOS; a pretrained one skips its own special
        tokens (its ids 0-2 are ordinary tokens)."""
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        drop = () if self.tokenizer.kind == "pretrained" else (PAD_ID, BOS_ID, EOS_ID)
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in drop])

    @property
    def eos_id(self) -> int | None:
        """Where generation stops: the tokenizer's end-of-text id (a pretrained one may have none)."""
        return EOS_ID if self.tokenizer is None else getattr(self.tokenizer, "eos_id", EOS_ID)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 100,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = 0,
        stop_at_eos: bool = True,
        max_length: int | None = MAX_GENERATE_LENGTH,
        on_token: Callable[[int], None] | None = None,
    ) -> str:
        """Continue ``prompt`` with the decoder-only model (:func:`posformer.eval.decoding.generate`);
        returns the continuation's text. ``temperature=0``: greedy; ``seed``: reproducible sampling;
        ``max_length``: the most tokens (prompt + new) accepted (``None``: no limit); ``on_token``:
        called with each new token id as it is chosen. Every setting is checked before the first step
        (:func:`check_sampling`)."""
        if self.kind != "decoder":
            raise ConfigError(
                f"run {str(self.run_dir)!r} is a {self.kind} model; generate() continues decoder-only LMs, "
                "translate() decodes encoder-decoder runs."
            )
        check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("prompt is empty; give at least one token (e.g. a newline for a char LM).")
        self._check_length(len(ids), max_new_tokens, max_length)
        device = self._device()
        generator = torch.Generator(device=device).manual_seed(int(seed)) if seed is not None else None
        prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
        out = generate(
            self.model,
            prompt_ids,
            int(max_new_tokens),
            temperature=float(temperature),
            top_k=top_k,
            eos_id=self.eos_id if stop_at_eos else None,
            generator=generator,
            on_token=None if on_token is None else (lambda nxt: on_token(int(nxt[0]))),
        )
        return self.decode(out[0, len(ids) :].tolist())

    def _check_length(self, prompt: int, max_new_tokens: int, max_length: int | None) -> None:
        if max_length is not None:
            _int("max_length", max_length, 1, MAX_GENERATE_LENGTH)
        total = prompt + max_new_tokens
        if max_length is None or total <= max_length:
            return
        raise ConfigError(
            f"a prompt of {prompt} tokens and max_new_tokens={max_new_tokens} make {total} tokens, above "
            f"max_length={max_length}: generating them costs about one forward window of that length "
            f"({window_cost_words(total, [self.loaded.model_cfg])}); lower max_new_tokens, or raise "
            f"max_length={total} if you mean it."
        )

    def translate(
        self, source: str | Sequence[int], *, beam_size: int = 4, alpha: float = 0.6, max_len_b: int = 50
    ) -> str:
        """Translate ``source`` with beam search (:func:`posformer.eval.decoding.beam_search`; the
        encoder-decoder's training conventions: source ``x EOS``); settings checked first
        (:func:`check_beam_settings`)."""
        if self.kind != "encoder_decoder":
            raise ConfigError(
                f"run {str(self.run_dir)!r} is a {self.kind} model; translate() needs an encoder-decoder "
                "run, generate() continues a decoder-only LM."
            )
        check_beam_settings(beam_size=beam_size, alpha=alpha, max_len_b=max_len_b)
        ids = self.encode(source, "source")
        if not ids:
            raise ConfigError("source is empty; give a sentence to translate.")
        src = torch.tensor([[*ids, EOS_ID]], dtype=torch.long, device=self._device())  # (1, S)
        [tokens] = beam_search(
            self.model,
            src,
            torch.ones_like(src, dtype=torch.bool),
            beam_size=int(beam_size),
            alpha=float(alpha),
            max_len_b=int(max_len_b),
        )
        text = self.decode(tokens)
        return text.strip() if isinstance(text, str) else text


def read_results(run_dir: Path) -> dict[str, Any]:
    """The run's ``results.json`` (``{}`` if it has none); an unreadable one (truncated, not JSON, not
    UTF-8) is ignored with a :class:`~posformer.errors.PosformerWarning` naming it: it only records
    metrics and which checkpoint is best, and the checkpoints are found without it."""
    path = run_dir / "results.json"
    if not path.is_file():
        return {}
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        problem = str(exc).splitlines()[0][:120]
    else:
        if isinstance(results, dict):
            return results
        problem = f"a JSON {type(results).__name__}, not the results object"
    warnings.warn(
        f"{path} is unreadable ({problem}); ignoring it: the checkpoint is taken from checkpoints/ and "
        "the run's metrics are empty (restore the file from a backup, or re-run the evaluation).",
        PosformerWarning,
        stacklevel=3,
    )
    return {}


def _in_run_dir(recorded: str, run_dir: Path) -> Path:
    """A checkpoint path ``results.json`` records, taken in ``run_dir``: a copied or moved run dir reads
    its own ``checkpoints/<name>``, never the original's file through an absolute path."""
    path = Path(recorded)
    try:
        if path.resolve().is_relative_to(run_dir.resolve()):
            return path
    except OSError:
        pass
    return run_dir / "checkpoints" / path.name


def find_run_checkpoint(run_dir: Path, which: str, results: dict[str, Any] | None = None) -> Path:
    """The run's ``which`` checkpoint (last | best): the one its ``results.json`` records, else
    ``checkpoints/last.ckpt`` / the recorded best (:func:`posformer.checkpoints.find_checkpoints`)."""
    if which not in ("best", "last"):
        raise ConfigError(f"which={which!r} is unknown; valid: best, last.")
    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(
            f"{str(run_dir)!r} has no checkpoints/ folder; pass a run dir written by posformer-train "
            "(or a .ckpt file)."
        )
    checkpoint = (read_results(run_dir) if results is None else results).get("checkpoint")
    recorded = checkpoint.get(which) if isinstance(checkpoint, dict) else None
    if isinstance(recorded, str) and recorded and _in_run_dir(recorded, run_dir).is_file():
        return _in_run_dir(recorded, run_dir)
    if which == "last" and (run_dir / "checkpoints" / "last.ckpt").is_file():
        return run_dir / "checkpoints" / "last.ckpt"
    return find_checkpoints(run_dir, which)[0]


def load_run(target: str | Path, *, which: str = "last", device: str = "cpu") -> Run:
    """A trained run: ``target`` is its run dir (``which`` checkpoint: last | best) or a ``.ckpt`` inside
    ``<run>/checkpoints/``. Loads the network (weights only, checked), the run's ``tokenizer/``, its
    ``config.yaml`` and ``results.json``."""
    if not isinstance(target, str | Path):
        raise ConfigError(
            f"load_run({target!r}): target is a {type(target).__name__}; pass a run dir or .ckpt path (a str "
            "or pathlib.Path)."
        )
    path = Path(target).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"load_run({str(target)!r}): no such run dir or checkpoint; pass a posformer-train run dir."
        )
    run_dir = path if path.is_dir() else path.resolve().parent.parent
    results = read_results(run_dir)
    ckpt = path if path.is_file() else find_run_checkpoint(path, which, results)
    loaded = load_checkpoint(ckpt, map_location="cpu")
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_tokenizer_dir(tok_dir) if (tok_dir / "meta.json").is_file() else None
    config = load_run_config(run_dir) or {}
    run = Run(run_dir, ckpt, loaded.model, tokenizer, config, results, loaded)
    return run.to(device)
