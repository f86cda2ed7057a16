"""``posformer-generate``: sample from a trained LM, or translate with a trained encoder-decoder.

The ``key=value`` grammar of the other mains (no config files: every key is below)::

    posformer-generate run=<run dir> prompt="ROMEO:" max_new_tokens=200 temperature=0.8 top_k=40
    posformer-generate ckpt=<run>/checkpoints/last.ckpt prompt="the cat" temperature=0     # greedy
    posformer-generate run=<run> prompt="the cat" samples=3 seed=1 device=cuda
    posformer-generate run=<multi30k run> source="Ein Hund läuft im Park." beam_size=4     # translation
    posformer-generate run=<synthetic task run> prompt=[5,6,7]      # symbol ids (source=[5,6,7] too)

Keys: ``run`` (a posformer-train run dir) or ``ckpt`` (a ``.ckpt`` in ``<run>/checkpoints/``),
``which`` (last | best checkpoint of a run), ``prompt`` (text, or ``[ids]`` for runs without a
tokenizer) or ``source`` (the sentence to translate), ``max_new_tokens``, ``temperature`` (0 = greedy),
``top_k`` (null = the whole vocabulary), ``samples``, ``seed``, ``device`` (auto | cpu | cuda | cuda:N),
``beam_size``, ``alpha`` (length penalty), ``max_len_b`` (translation budget: source length + this).

A decoder-only run prints each sample as the prompt followed by its continuation (one per block,
separated by a ``---`` line when ``samples > 1``); an encoder-decoder run prints the translation. The
work is :class:`posformer.runs.Run` (``generate``, ``translate``), which calls
:mod:`posformer.eval.decoding`. Bad input (an unknown key, a bad value, a missing run) is one
``posformer-generate: error: ...`` line and exit status 2, before the checkpoint is loaded.
"""

from __future__ import annotations

import ast
import difflib
import sys
from collections.abc import Sequence
from typing import Any

from posformer.cli.boundary import ErrorBoundary
from posformer.devices import torch_device
from posformer.errors import ConfigError
from posformer.runs import load_run

PROG = "posformer-generate"
EXIT_CODE = 2
#: every key, its default and what it takes (the --help text)
KEYS: dict[str, tuple[Any, str]] = {
    "run": (None, "a posformer-train run dir"),
    "ckpt": (None, "a checkpoint file (<run>/checkpoints/*.ckpt); instead of run"),
    "which": ("last", "which checkpoint of run: last | best"),
    "prompt": (None, "decoder-only: the text to continue ([ids] for a run without a tokenizer)"),
    "source": (None, "encoder-decoder: the sentence to translate"),
    "max_new_tokens": (100, "tokens to generate (>= 1)"),
    "temperature": (1.0, "sampling temperature (>= 0; 0 = greedy)"),
    "top_k": (None, "sample among the k most likely tokens (>= 1; null = all)"),
    "samples": (1, "continuations of the prompt (>= 1)"),
    "seed": (0, "seed of the sampling (sample i uses seed + i)"),
    "device": ("auto", "auto (CUDA when there is a GPU, as train and eval) | cpu | cuda | cuda:N"),
    "beam_size": (4, "encoder-decoder: beam width (>= 1; 1 = greedy)"),
    "alpha": (0.6, "encoder-decoder: length-penalty exponent (>= 0)"),
    "max_len_b": (50, "encoder-decoder: at most source length + max_len_b output tokens (>= 1)"),
}


def usage() -> str:
    lines = [f"usage: {PROG} run=<run dir>|ckpt=<file> prompt=<text>|source=<text> [key=value ...]", ""]
    lines += [f"  {k:<15} {help_} (default: {d})" for k, (d, help_) in KEYS.items()]
    return "\n".join(lines)


def _value(text: str) -> Any:
    """``null`` -> None, numbers and ``[lists]`` as Python literals, anything else the string itself."""
    if text.lower() in ("null", "none"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse(argv: Sequence[str]) -> dict[str, Any]:
    """``key=value`` arguments -> settings (defaults filled in), every value checked; one
    :class:`ConfigError` line for the first problem."""
    given: dict[str, Any] = {}
    for arg in argv:
        key, eq, raw = arg.partition("=")
        if not eq:
            raise ConfigError(f"{arg!r} is not key=value; e.g. {PROG} run=<run dir> prompt='the cat'.")
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{key} is not a {PROG} key; {hint}valid: {', '.join(KEYS)}.")
        given[key] = raw if key in ("prompt", "source", "run", "ckpt", "device") else _value(raw)
    s = {k: d for k, (d, _) in KEYS.items()} | given
    if (s["run"] is None) == (s["ckpt"] is None):
        raise ConfigError(
            f"give one of run=<run dir> or ckpt=<file.ckpt>; e.g. {PROG} run=outputs/train/runs/<time>."
        )
    if (s["prompt"] is None) == (s["source"] is None):
        raise ConfigError(
            "give one of prompt=<text> (a language model) or source=<text> (a translation model)."
        )
    if s["which"] not in ("last", "best"):
        raise ConfigError(f"which={s['which']!r} is unknown; valid: last, best.")
    for key, minimum in (
        ("max_new_tokens", 1),
        ("samples", 1),
        ("beam_size", 1),
        ("max_len_b", 1),
        ("seed", 0),
    ):
        _check_int(key, s[key], minimum)
    if s["top_k"] is not None:
        _check_int("top_k", s["top_k"], 1)
    for key in ("temperature", "alpha"):
        v = s[key]
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ConfigError(f"{key}={v!r} must be a number >= 0; e.g. {key}={KEYS[key][0]}.")
    for key in ("prompt", "source"):
        if isinstance(s[key], str) and s[key].startswith("["):
            ids = _value(s[key])
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ConfigError(f"{key}={s[key]!r}: a list holds token ids >= 0, e.g. {key}=[5,6,7].")
            s[key] = ids
    return s


def _check_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{key}={value!r} must be an integer >= {minimum}; e.g. {key}={KEYS[key][0] or minimum}."
        )


def generate_text(s: dict[str, Any]) -> list[str]:
    """The texts ``s`` asks for: the samples of a language model, or the translation."""
    device = torch_device(str(s["device"]))  # a device this machine lacks: one line, before loading
    run = load_run(s["run"] or s["ckpt"], which=s["which"]).to(device)
    if s["source"] is not None:
        return [
            run.translate(
                s["source"], beam_size=s["beam_size"], alpha=float(s["alpha"]), max_len_b=s["max_len_b"]
            )
        ]
    if run.kind != "decoder":
        raise ConfigError(f"{run.checkpoint} is an {run.kind} model: give source=<text> to translate.")
    shown = s["prompt"] if isinstance(s["prompt"], str) else run.decode(s["prompt"]) + " |"
    return [
        shown
        + run.generate(
            s["prompt"],
            s["max_new_tokens"],
            temperature=float(s["temperature"]),
            top_k=s["top_k"],
            seed=s["seed"] + i,
        )
        for i in range(s["samples"])
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``posformer-generate key=value ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    with ErrorBoundary(PROG, EXIT_CODE):
        texts = generate_text(parse(argv))
        print("\n---\n".join(texts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
