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
``beam_size``, ``alpha`` (length penalty), ``max_len_b`` (translation budget: source length + this),
``max_length`` (the most tokens, prompt + new, accepted: a refusal names the cost; null = no limit).
A key the chosen mode does not use (``beam_size`` with ``prompt=``, ``temperature`` with ``source=``,
``which`` with ``ckpt=``) is refused, not ignored.

A decoder-only run prints each sample as the prompt followed by its continuation (one per block,
separated by a ``---`` line when ``samples > 1``); an encoder-decoder run prints the translation. The
work is :class:`posformer.runs.Run` (``generate``, ``translate``), which calls
:mod:`posformer.eval.decoding`. Bad input (an unknown key, a bad value, a missing run) is one
``posformer-generate: error: ...`` line and exit status 2, before the checkpoint is loaded (the checks
are :mod:`posformer.runs`', shared with the Python API); what needs the model (ids outside its
vocabulary, the length cost) before the first step. Samples are printed as they finish; SIGINT/SIGTERM
prints the tokens of the sample in progress and one line saying how to generate the rest (exit 130/143).
"""

from __future__ import annotations

import ast
import difflib
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from posformer.cli.boundary import ErrorBoundary
from posformer.devices import torch_device
from posformer.errors import ConfigError, Interrupted, PosformerWarning
from posformer.runs import (
    MAX_GENERATE_LENGTH,
    Run,
    check_beam_settings,
    check_sampling,
    check_text,
    load_run,
)
from posformer.signals import Interrupts, signal_name

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
    "temperature": (1.0, "sampling temperature (0 = greedy, else 1e-4 .. 1e4)"),
    "top_k": (None, "sample among the k most likely tokens (>= 1; null = all)"),
    "samples": (1, "continuations of the prompt (>= 1)"),
    "seed": (0, "seed of the sampling (sample i uses seed + i; below 2**63)"),
    "max_length": (MAX_GENERATE_LENGTH, "the most tokens (prompt + new) accepted; null = no limit"),
    "device": ("auto", "auto (CUDA when there is a GPU, as train and eval) | cpu | cuda | cuda:N"),
    "beam_size": (4, "encoder-decoder: beam width (>= 1; 1 = greedy)"),
    "alpha": (0.6, "encoder-decoder: length-penalty exponent (>= 0)"),
    "max_len_b": (50, "encoder-decoder: at most source length + max_len_b output tokens (>= 1)"),
}
#: the keys only one mode uses: given with the other, they are refused (never silently ignored)
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "samples", "seed", "max_length")
BEAM_KEYS = ("beam_size", "alpha", "max_len_b")
TEXT_KEYS = ("prompt", "source", "run", "ckpt", "device")


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
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def parse(argv: Sequence[str]) -> dict[str, Any]:
    """``key=value`` arguments -> settings (defaults filled in, ``given``: the keys given), every value
    checked; one :class:`ConfigError` line for the first problem."""
    given: dict[str, Any] = {}
    for arg in argv:
        key, eq, raw = arg.partition("=")
        if not eq:
            raise ConfigError(f"{arg!r} is not key=value; e.g. {PROG} run=<run dir> prompt='the cat'.")
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{key} is not a {PROG} key; {hint}valid: {', '.join(KEYS)}.")
        check_text(key, raw)  # undecodable bytes on the command line: one line, not a traceback later
        given[key] = raw if key in TEXT_KEYS else _value(raw)
    s = {k: d for k, (d, _) in KEYS.items()} | given
    s["given"] = sorted(given)
    if (s["run"] is None) == (s["ckpt"] is None):
        raise ConfigError(
            f"give one of run=<run dir> or ckpt=<file.ckpt>; e.g. {PROG} run=outputs/train/runs/<time>."
        )
    if (s["prompt"] is None) == (s["source"] is None):
        raise ConfigError(
            "give one of prompt=<text> (a language model) or source=<text> (a translation model)."
        )
    if s["ckpt"] is not None and "which" in given:
        raise ConfigError(f"which={given['which']!r} picks a checkpoint of run=; with ckpt= drop it.")
    if s["which"] not in ("last", "best"):
        raise ConfigError(f"which={s['which']!r} is unknown; valid: last, best.")
    mode, unused = ("prompt", BEAM_KEYS) if s["prompt"] is not None else ("source", SAMPLING_KEYS)
    ignored = [k for k in unused if k in given]
    if ignored:
        what = "beam-search (translation)" if mode == "prompt" else "sampling (language-model)"
        raise ConfigError(
            f"{ignored[0]}={given[ignored[0]]!r} is a {what} setting, but {mode}= "
            f"{'continues a language model by sampling' if mode == 'prompt' else 'translates by beam search'}"
            f"; drop {', '.join(ignored)}"
            + (" (temperature=0 decodes greedily)." if mode == "prompt" else " (beam_size=1 is greedy).")
        )
    if mode == "prompt":
        check_sampling(
            max_new_tokens=s["max_new_tokens"],
            temperature=s["temperature"],
            top_k=s["top_k"],
            seed=s["seed"],
            samples=s["samples"],
        )
    else:
        check_beam_settings(beam_size=s["beam_size"], alpha=s["alpha"], max_len_b=s["max_len_b"])
    if s["max_length"] is not None and (
        isinstance(s["max_length"], bool) or not isinstance(s["max_length"], int) or s["max_length"] < 1
    ):
        raise ConfigError(
            f"max_length={s['max_length']!r} must be an integer >= 1 or null (no limit); "
            f"e.g. max_length={MAX_GENERATE_LENGTH}."
        )
    for key in ("prompt", "source"):
        if isinstance(s[key], str) and s[key].startswith("["):
            ids = _value(s[key])
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise ConfigError(f"{key}={s[key]!r}: a list holds token ids >= 0, e.g. {key}=[5,6,7].")
            s[key] = ids
    return s


class Progress:
    """What was generated so far (finished samples, the current one's tokens) and the line a signal
    prints: what was kept and the command that generates the rest."""

    def __init__(self, s: dict[str, Any], argv: Sequence[str]) -> None:
        self.s, self.argv = s, list(argv)
        self.done = 0
        self.tokens: list[int] = []
        self.run: Run | None = None
        self.shown = ""

    def partial(self) -> str:
        """The sample in progress: the prompt and its tokens so far ('' when there are none)."""
        if self.run is None or not self.tokens:
            return ""
        return f"{self.shown}{self.run.decode(self.tokens)}"

    def rest_command(self) -> str:
        keep = [a for a in self.argv if not a.startswith(("samples=", "seed="))]
        rest = self.s["samples"] - self.done
        return shlex.join([PROG, *keep, f"samples={rest}", f"seed={self.s['seed'] + self.done}"])

    def describe(self, signum: int) -> str:
        name = signal_name(signum)
        if self.run is None:
            return f"interrupted by {name} before generating; nothing was produced. Re-run the same command."
        if self.s["source"] is not None:
            return (
                f"interrupted by {name} during the beam search; nothing was produced. Re-run the same "
                "command."
            )
        total = self.s["samples"]
        return (
            f"interrupted by {name} during sample {self.done + 1} of {total} after {len(self.tokens)} of "
            f"{self.s['max_new_tokens']} new tokens; printed above: {self.done} finished sample(s) and the "
            f"tokens of sample {self.done + 1} so far. Generate the rest (the same samples, seed + i) with: "
            f"{self.rest_command()}"
        )


def prompt_notes(run: Run, prompt: str | list[int], max_new_tokens: int, max_length: int | None) -> list[str]:
    """One line each for what makes a sample less telling, checked before sampling: prompt characters a
    char tokenizer maps to ``<unk>``, and a prompt + ``max_new_tokens`` past the run's training length (a
    length ``max_length`` refuses is the error's, not a note)."""
    ids = run.encode(prompt)  # bad ids or text: the same error generation gives
    notes = []
    known = getattr(run.tokenizer, "chars", None)  # a char tokenizer's vocabulary
    unknown = sorted(set(prompt) - set(known)) if isinstance(prompt, str) and known is not None else []
    if unknown:
        notes.append(
            f"prompt characters {', '.join(map(repr, unknown))} are not in the run's vocabulary (its "
            "training text); each maps to <unk>."
        )
    trained = run.results.get("train_length")
    total = len(ids) + int(max_new_tokens)
    if isinstance(trained, int) and 0 < trained < total and (max_length is None or total <= max_length):
        notes.append(
            f"a prompt of {len(ids)} tokens and max_new_tokens={max_new_tokens} make {total} tokens, past "
            f"the run's training length {trained}: the tokens beyond it are extrapolation (pe={run.pe})."
        )
    return notes


def generate_text(s: dict[str, Any], emit: Callable[[str], None], progress: Progress | None = None) -> Run:
    """Generate what ``s`` asks for, handing each text to ``emit`` as it is finished: the samples of a
    language model, or the translation. Returns the run (``progress``: kept up to date)."""
    device = torch_device(str(s["device"]))  # a device this machine lacks: one line, before loading
    run = load_run(s["run"] or s["ckpt"], which=s["which"]).to(device)
    progress = progress or Progress(s, [])
    progress.run = run
    if s["source"] is not None:
        emit(
            run.translate(
                s["source"], beam_size=s["beam_size"], alpha=float(s["alpha"]), max_len_b=s["max_len_b"]
            )
        )
        return run
    if run.kind != "decoder":
        raise ConfigError(f"{run.checkpoint} is an {run.kind} model: give source=<text> to translate.")
    for note in prompt_notes(run, s["prompt"], s["max_new_tokens"], s["max_length"]):
        warnings.warn(note, PosformerWarning, stacklevel=2)
    shown = s["prompt"] if isinstance(s["prompt"], str) else run.decode(run.encode(s["prompt"])) + " |"
    progress.shown = shown
    for i in range(s["samples"]):
        progress.tokens = []
        text = run.generate(
            s["prompt"],
            s["max_new_tokens"],
            temperature=s["temperature"],
            top_k=s["top_k"],
            seed=s["seed"] + i,
            max_length=s["max_length"],
            on_token=progress.tokens.append,
        )
        emit(shown + text)
        progress.done = i + 1
    return run


def _one_line_warnings() -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints a :class:`PosformerWarning` as one ``<prog>: warning:``
    line (others as Python prints them)."""
    original = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, PosformerWarning):
            print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)
        else:
            original(message, category, *args, **kwargs)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``posformer-generate key=value ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    printed: list[str] = []

    def emit(text: str) -> None:
        print(("---\n" if printed else "") + text, flush=True)
        printed.append(text)

    with ErrorBoundary(PROG, EXIT_CODE), Interrupts() as interrupts, warnings.catch_warnings():
        warnings.showwarning = _one_line_warnings()
        warnings.simplefilter("always", PosformerWarning)
        s = parse(argv)
        progress = Progress(s, argv)
        interrupts.describe = progress.describe
        try:
            generate_text(s, emit, progress)
        except Interrupted:
            if progress.partial():  # the sample in progress: its tokens so far, marked
                emit(f"{progress.partial()} [interrupted]")
            raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
