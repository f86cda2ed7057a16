"""A trained run from its run dir or checkpoint: :func:`load_run` returns a :class:`Run` (the network in
eval mode, its tokenizer, config and results) that encodes, decodes, samples (:meth:`Run.generate`) and
translates with beam search (:meth:`Run.translate`).

The one loader of a finished run, below the entry points: :mod:`posformer.api` re-exports it,
``posformer-generate`` and ``posformer-inspect`` (``run=``) call it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posformer.checkpoints import LoadedCheckpoint, find_checkpoints, load_checkpoint, load_run_config
from posformer.data import load_tokenizer_dir
from posformer.devices import torch_device
from posformer.errors import CheckpointError, ConfigError, DataError
from posformer.eval.decoding import BOS_ID, EOS_ID, PAD_ID, beam_search, generate

__all__ = ["Run", "find_run_checkpoint", "load_run"]


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

    def encode(self, text: str | Sequence[int]) -> list[int]:
        """Token ids of ``text`` (a string needs the run's tokenizer; ids pass through)."""
        if not isinstance(text, str):
            return [int(t) for t in text]
        if self.tokenizer is None:
            raise DataError(
                f"run {str(self.run_dir)!r} has no tokenizer (a synthetic task): pass the prompt as a "
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
    ) -> str:
        """Continue ``prompt`` with the decoder-only model (:func:`posformer.eval.decoding.generate`);
        returns the continuation's text. ``temperature=0``: greedy; ``seed``: reproducible sampling."""
        if self.kind != "decoder":
            raise ConfigError(
                f"run {str(self.run_dir)!r} is a {self.kind} model; generate() continues decoder-only LMs, "
                "translate() decodes encoder-decoder runs."
            )
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("prompt is empty; give at least one token (e.g. a newline for a char LM).")
        if top_k is not None and top_k < 1:
            raise ConfigError(f"top_k={top_k} must be >= 1 (or None: the whole vocabulary).")
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
        )
        return self.decode(out[0, len(ids) :].tolist())

    def translate(
        self, source: str | Sequence[int], *, beam_size: int = 4, alpha: float = 0.6, max_len_b: int = 50
    ) -> str:
        """Translate ``source`` with beam search (:func:`posformer.eval.decoding.beam_search`; the
        encoder-decoder's training conventions: source ``x EOS``)."""
        if self.kind != "encoder_decoder":
            raise ConfigError(
                f"run {str(self.run_dir)!r} is a {self.kind} model; translate() needs an encoder-decoder "
                "run, generate() continues a decoder-only LM."
            )
        ids = self.encode(source)
        if not ids:
            raise ConfigError("source is empty; give a sentence to translate.")
        src = torch.tensor([[*ids, EOS_ID]], dtype=torch.long, device=self._device())  # (1, S)
        [tokens] = beam_search(
            self.model,
            src,
            torch.ones_like(src, dtype=torch.bool),
            beam_size=int(beam_size),
            alpha=alpha,
            max_len_b=int(max_len_b),
        )
        text = self.decode(tokens)
        return text.strip() if isinstance(text, str) else text


def find_run_checkpoint(run_dir: Path, which: str) -> Path:
    """The run's ``which`` checkpoint (last | best): the one its ``results.json`` records, else
    ``checkpoints/last.ckpt`` / the recorded best (:func:`posformer.checkpoints.find_checkpoints`)."""
    if which not in ("best", "last"):
        raise ConfigError(f"which={which!r} is unknown; valid: best, last.")
    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(
            f"{str(run_dir)!r} has no checkpoints/ folder; pass a run dir written by posformer-train "
            "(or a .ckpt file)."
        )
    results = run_dir / "results.json"
    if results.is_file():
        recorded = (json.loads(results.read_text(encoding="utf-8")).get("checkpoint") or {}).get(which)
        if recorded and Path(recorded).is_file():
            return Path(recorded)
    if which == "last" and (run_dir / "checkpoints" / "last.ckpt").is_file():
        return run_dir / "checkpoints" / "last.ckpt"
    return find_checkpoints(run_dir, which)[0]


def load_run(target: str | Path, *, which: str = "last", device: str = "cpu") -> Run:
    """A trained run: ``target`` is its run dir (``which`` checkpoint: last | best) or a ``.ckpt`` inside
    ``<run>/checkpoints/``. Loads the network (weights only, checked), the run's ``tokenizer/``, its
    ``config.yaml`` and ``results.json``."""
    path = Path(target).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"load_run({str(target)!r}): no such run dir or checkpoint; pass a posformer-train run dir."
        )
    ckpt = path if path.is_file() else find_run_checkpoint(path, which)
    run_dir = path if path.is_dir() else ckpt.resolve().parent.parent
    loaded = load_checkpoint(ckpt, map_location="cpu")
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_tokenizer_dir(tok_dir) if (tok_dir / "meta.json").is_file() else None
    results_file = run_dir / "results.json"
    results = json.loads(results_file.read_text(encoding="utf-8")) if results_file.is_file() else {}
    config = load_run_config(run_dir) or {}
    run = Run(run_dir, ckpt, loaded.model, tokenizer, config, results, loaded)
    return run.to(device)
