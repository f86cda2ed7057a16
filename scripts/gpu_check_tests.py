"""Stage h of the GPU check: the listed CUDA test cases, one pytest process per test module.

Each module's cases run in a pytest process of their own (``--jobs`` at once), with ``-v`` (one line
per test as it ends) into ``OUT/<module>.log`` and a junit file ``OUT/<module>.xml``, so a stage
killed at its budget keeps the report of every module that finished and the passed lines of the
ones still running. One line is printed per module as it ends, and a total at the end. Standard
library only.

    python scripts/gpu_check_tests.py OUT --cases scripts/gpu_check_cases.txt [--jobs 4] [-- PYTEST_ARGS]

Exit status 0 when every module's pytest passed (its tests passed or were skipped), else 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_cases(path: Path) -> list[str]:
    """The node ids of a cases file (one a line; ``#`` comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def by_module(cases: list[str]) -> dict[str, list[str]]:
    """The cases grouped by their test module, in the order the modules first appear."""
    groups: dict[str, list[str]] = {}
    for case in cases:
        groups.setdefault(case.split("::", 1)[0], []).append(case)
    return groups


def junit_counts(path: Path) -> dict[str, int]:
    """``tests``, ``failures``, ``errors`` and ``skipped`` of a junit file (all 0 when it is missing)."""
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def start(module: str, cases: list[str], out: Path, extra: list[str]) -> subprocess.Popen:
    """A pytest process for one module's cases: ``-v`` into ``OUT/<module>.log``, junit into ``.xml``."""
    name = Path(module).stem
    command = [sys.executable, "-m", "pytest", *cases, "-v", "-p", "no:cacheprovider", "-p", "no:xdist"]
    command += ["-o", "addopts=--strict-markers -ra", "--tb=short", "--junitxml", str(out / f"{name}.xml")]
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the lane's cores, shared by its jobs
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": threads}
    with open(out / f"{name}.log", "w", encoding="utf-8") as log:
        return subprocess.Popen([*command, *extra], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def report(name: str, proc: subprocess.Popen, seconds: float, counts: dict[str, int]) -> bool:
    """Print one module's line; whether it passed (its tests passed or were skipped)."""
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = proc.returncode in (0, 5) and not counts["failures"] and not counts["errors"]
    print(
        f"{name}: {'passed' if ok else 'FAILED'} ({passed} passed, {counts['failures']} failed, "
        f"{counts['errors']} errors, {counts['skipped']} skipped; exit {proc.returncode}; {seconds:.0f} s)",
        flush=True,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for each module's log and junit file")
    parser.add_argument("--cases", type=Path, required=True, help="the node ids, one a line")
    parser.add_argument("--jobs", type=int, default=4, help="pytest processes at once")
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)  # after --: passed to every pytest
    args.out.mkdir(parents=True, exist_ok=True)
    pending = list(by_module(read_cases(args.cases)).items())
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failed, totals = [], dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    while pending or running:
        while pending and len(running) < args.jobs:
            module, cases = pending.pop(0)
            running[Path(module).stem] = (start(module, cases, args.out, extra), time.monotonic())
        time.sleep(0.2)
        for name, (proc, started) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            counts = junit_counts(args.out / f"{name}.xml")
            totals = {key: totals[key] + counts[key] for key in totals}
            if not report(name, proc, time.monotonic() - started, counts):
                failed.append(name)
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    print(
        f"tests={totals['tests']} passed={passed} failures={totals['failures']} errors={totals['errors']} "
        f"skipped={totals['skipped']}; modules failed: {', '.join(failed) or 'none'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
