"""Find the failures that exit 0 in the logs of a ``scripts/gpu_check.sh`` stage.

A stage of the GPU check fails even when its command succeeded if its output shows one of:

* a **device mismatch** (``Expected all tensors to be on the same device``): a tensor made on the CPU
  met a CUDA one (caught and reported by a callback, a multirun job or a retry, the run still ends 0);
* **posformer's graph limit** (``FlexRecompileError``: "FlexAttention compiled more than N graphs"):
  a model needed more compiled Flex graphs (kernels or block masks) than
  ``posformer.model.backends.flex.RECOMPILE_LIMIT``. Torch's own recompile-limit lines are not
  counted: posformer keeps its kernels and block masks inside its own limit, and a line of torch's
  about another function (a compiled model's) is a slower run, not a wrong one;
* a **Flex fallback** ("FlexAttention failed in the ... backend"): under ``attention_backend=auto``
  a run went on without FlexAttention after a compile failure (right results, slower; the run's
  ``results.json`` has ``attention_fallback``);
* the **eager FlexAttention** warning (``flex_attention called without torch.compile``, ``materializes
  the full scores``): attention ran the unfused reference implementation.

Usage (``gpu_check.sh`` calls it after every stage)::

    python scripts/gpu_check_scan.py LOG_OR_DIR...   # one line per finding; exit 1 if any, else 0

Folders are searched recursively for text logs (``*.log``, ``*.txt``, ``*.err``, ``*.out``); other
files (checkpoints, event files, figures) are skipped. Matching ignores case. Standard library only.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

#: failure kind -> the texts (any case) that reveal it
PATTERNS: dict[str, tuple[str, ...]] = {
    "device mismatch": ("Expected all tensors to be on the same device",),
    # posformer's own stop at flex.RECOMPILE_LIMIT graphs (one line; under auto, a fallback instead)
    "graph limit": ("FlexRecompileError", "FlexAttention compiled more than"),
    "Flex fallback": ("FlexAttention failed in the",),
    "eager FlexAttention": ("flex_attention called without torch.compile", "materializes the full scores"),
}
#: file suffixes read when a folder is scanned
LOG_SUFFIXES = (".log", ".txt", ".err", ".out")
#: longest excerpt of a matching line in a finding
EXCERPT = 160


def scan_text(text: str) -> list[tuple[str, int, str]]:
    """``(kind, line number, excerpt)`` of the first line that shows each failure kind in ``text``."""
    found: dict[str, tuple[str, int, str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        low = line.lower()
        for kind, needles in PATTERNS.items():
            if kind not in found and any(n.lower() in low for n in needles):
                found[kind] = (kind, number, line.strip()[:EXCERPT])
        if len(found) == len(PATTERNS):
            break
    return [found[k] for k in PATTERNS if k in found]


def log_files(paths: Iterable[Path]) -> Iterator[Path]:
    """The files named, and the text logs inside the folders named (sorted); missing paths are skipped."""
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)
        elif path.is_file():
            yield path


def scan_paths(paths: Iterable[Path]) -> list[str]:
    """One line per (file, failure kind): ``kind: file:line: excerpt``."""
    lines = []
    for path in log_files(paths):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines += [f"{kind}: {path}:{number}: {excerpt}" for kind, number, excerpt in scan_text(text)]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    findings = scan_paths(Path(a) for a in args)
    for line in findings:
        print(line)
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
