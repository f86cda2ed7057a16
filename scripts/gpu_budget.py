"""The GPU check's cold-start budget model: each stage's expected time on a fresh GPU machine, from the CPU.

On a cold machine the GPU check (``scripts/gpu_check.sh``) spends most of its time compiling: every
distinct FlexAttention graph is a dynamo trace, an inductor lowering and Triton kernels, and every
compiled block mask one more graph. Their number is a property of the code, not of the GPU, so it is
counted here, on the CPU: each stage's jobs (the commands of the check's dry run) run a few steps
in-process with CUDA's attention decisions (``tests/flex_lowering.py::as_on_cuda``), Flex and block
masks compiled by a backend that counts graphs instead of generating code; each of stage h's test
cases runs its body the same way (``scripts/rehearse_cuda_tests.py``). A stage's estimate is then

    processes x COST["process"]  +  jobs x COST["job"]  +  steps x COST["step"]
      + forward graphs x COST["graph"]  +  graphs with a backward x (COST["graph"] + COST["backward"])
      + block-mask graphs x COST["mask"]  +  test cases x COST["test"]

(stage h's work divided among its parallel pytest processes), and a stage whose estimate exceeds its
budget fails ``tests/project/test_gpu_check.py``. The per-graph costs are stated, not measured here (no GPU):
they reproduce the estimates made of the previous plan from the last H200 run (stage h 300-500 s, a
270-500 s, b 190-350 s, c 130-290 s: this script on that plan, ``--script``), and the next GPU window
measures them (the check's table gives each stage's seconds next to this estimate).

    python scripts/gpu_budget.py                   # count (about 3 minutes), print the table
    python scripts/gpu_budget.py --write FILE      # count, save the counts (tests/fixtures/gpu_budget.json)
    python scripts/gpu_budget.py --counts FILE     # the table from saved counts (seconds)
    python scripts/gpu_budget.py --script OLD.sh   # another version of the check (its dry run)

Exit status 1 when a stage's estimate exceeds its budget or a lane's budgets exceed the global one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_check_tests import by_module, read_cases

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TESTS = ROOT / "tests"

#: seconds on a cold H100/H200 machine (torch 2.11, inductor, Triton; one lane's share of the cores)
COST: dict[str, float] = {
    "process": 25.0,  # python, torch, Lightning, Hydra, posformer imported; CUDA context; inductor's start
    "job": 4.0,  # one training job besides its steps: data, model, Trainer, checkpoints, results
    "step": 0.03,  # one step of a tiny model (d_model <= 128) in Lightning
    "graph": 8.0,  # one Flex forward graph: trace, lowering, Triton compile and autotuning of its kernel
    "backward": 14.0,  # the backward of a graph that has one (a second, larger kernel)
    "mask": 3.0,  # one compiled create_block_mask graph
    "test": 3.0,  # one CUDA test case's own work besides its compiles (references, float64)
    "cached": 1.5,  # a graph compiled before in the stage's process: a hit of inductor's caches
}
#: training steps each job runs here to meet its call kinds (a graph per kind, then dynamic lengths)
STEPS_HERE = 6
#: the setup stage: ~50 MB of wheels installed into a folder, posformer installed, imports checked
SETUP_S = 60.0


@dataclass
class Counts:
    """The compiled graphs of one job, test case or stage, each by a key of its code and inputs' dtypes
    (the same graph compiled again is a hit of inductor's caches: :data:`COST` ``cached``)."""

    forward: list[str] = field(default_factory=list)  # graphs without gradients
    backward: list[str] = field(default_factory=list)  # graphs with gradients (a backward compiled too)
    masks: list[str] = field(default_factory=list)  # compiled block masks

    def __iadd__(self, other: Counts) -> Counts:
        self.forward += other.forward
        self.backward += other.backward
        self.masks += other.masks
        return self

    def cost(self) -> float:
        """Seconds of compiling: each distinct graph in full, each repeat as a cache hit."""
        total = 0.0
        for keys, full in (
            (self.forward, COST["graph"]),
            (self.backward, COST["graph"] + COST["backward"]),
            (self.masks, COST["mask"]),
        ):
            distinct = len(set(keys))
            total += distinct * full + (len(keys) - distinct) * COST["cached"]
        return total


def graph_key(gm: Any, example_inputs: list) -> str:
    """What inductor's graph cache keys a graph by, in short: its code (with its submodules': the
    ``score_mod`` and ``mask_mod`` graphs) and its inputs' dtypes and ranks."""
    import hashlib

    inputs = [(str(t.dtype), t.dim()) for t in example_inputs if hasattr(t, "dtype")]
    code = "".join(m.code for _, m in gm.named_modules() if hasattr(m, "code"))  # score_mod, mask_mod too
    return hashlib.sha1(f"{code}{inputs}".encode()).hexdigest()[:12]


@dataclass
class Stage:
    """One stage of the check's plan, from its dry run."""

    id: str
    budget: int
    lane: int
    words: list[str]
    jobs: list[list[str]] = field(default_factory=list)  # Hydra jobs (a multirun expanded)
    steps: int = 0  # training steps per job on the GPU
    cases: list[str] = field(default_factory=list)  # stage h: pytest node ids
    workers: int = 1  # stage h: pytest processes at once


# ------------------------------------------------------------------------------------------ the plan
def dry_run(script: Path = SCRIPT, **env: str) -> str:
    """The check's ``--dry-run`` output (CUDA's commands; nothing runs)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    done = subprocess.run(
        ["bash", str(script), "--dry-run", "/tmp/gpu_budget_dry_run"],
        capture_output=True,
        text=True,
        env={**base, "PYTHON": sys.executable, **env},
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    return done.stdout


def stage_commands(text: str) -> dict[str, tuple[int, list[str]]]:
    """Stage id -> (budget, command words), from the dry run's ``== ID (N s): title`` and ``   $ cmd``."""
    stages: dict[str, tuple[int, list[str]]] = {}
    current: tuple[str, int] | None = None
    lines = iter(text.splitlines())
    for line in lines:
        m = re.match(r"^== (\S+) \((\d+) s\): ", line)
        if m:
            current = (m.group(1), int(m.group(2)))
        elif line.startswith("   $ ") and current is not None:
            command = line[5:]
            while True:  # a quoted argument may span lines (the setup script)
                try:
                    stages[current[0]] = (current[1], shlex.split(command))
                    break
                except ValueError:
                    command += "\n" + next(lines)
            current = None
    return stages


def lanes(text: str) -> dict[str, int]:
    """Stage id -> lane, from the dry run's ``lane N: a, c`` lines (one lane for all without them)."""
    found = {}
    for m in re.finditer(r"^lane (\d+): (.+)$", text, flags=re.M):
        for item in m.group(2).split(","):
            found[item.strip().split()[0]] = int(m.group(1))
    return found


def console_args(words: list[str]) -> tuple[str, list[str]] | None:
    """(console script, its arguments) of a stage command (``posformer-x`` or ``-m posformer.cli.x``)."""
    modules = {"posformer.cli.train": "posformer-train", "posformer.cli.evaluate": "posformer-eval"}
    modules |= {"posformer.cli.inspect": "posformer-inspect", "posformer.cli.bench": "posformer-bench"}
    for i, word in enumerate(words):
        if Path(word).name.startswith("posformer-"):
            return Path(word).name, words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i + 1] in modules:
            return modules[words[i + 1]], words[i + 2 :]
    return None


def expand_jobs(overrides: list[str]) -> Iterator[list[str]]:
    """Every job of a multirun: sweeps (``pe=a,b``) expanded into their product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            choices.append([f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    yield from (list(job) for job in itertools.product(*choices))


def plan(text: str) -> list[Stage]:
    """The stages of a dry run, with their jobs, steps, test cases and lanes."""
    where = lanes(text)
    stages = []
    for sid, (budget, words) in stage_commands(text).items():
        stage = Stage(sid, budget, where.get(sid, 0), words)
        found = console_args(words)
        if found is not None and found[0] in ("posformer-train", "posformer-eval", "posformer-inspect"):
            stage.jobs = list(expand_jobs(found[1]))
            steps = [int(o.split("=")[1]) for o in found[1] if o.startswith("trainer.max_steps=")]
            stage.steps = steps[0] if steps else 0
        if "--cases" in words:
            cases = Path(words[words.index("--cases") + 1])
            stage.cases = read_cases(cases if cases.is_absolute() else ROOT / cases)
            stage.workers = int(words[words.index("--jobs") + 1]) if "--jobs" in words else 1
        elif "pytest" in words:  # a plain pytest selection (an older plan): its collected ids
            stage.cases = collect(words[words.index("pytest") + 1 :])
            stage.workers = int(words[words.index("-n") + 1]) if "-n" in words else 1
        stages.append(stage)
    return stages


def collect(args: list[str]) -> list[str]:
    """The node ids a pytest selection collects."""
    keep, it = [], iter(args)
    for arg in it:
        if arg in ("--junitxml", "-n"):
            next(it)
        elif arg not in ("-q", "-v"):
            keep.append(arg)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p", "no:xdist", *keep],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return [line for line in done.stdout.splitlines() if "::" in line]


# ------------------------------------------------------------------------------------------ counting
@contextlib.contextmanager
def counting(counts: Counts) -> Iterator[None]:
    """CUDA's attention paths on the CPU (``as_on_cuda``), with Flex and block masks compiled by backends
    that count graphs into ``counts`` and run them as traced."""
    import torch
    from _pytest.monkeypatch import MonkeyPatch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    sys.path.insert(0, str(ROOT))
    from posformer.model.backends import flex
    from tests.flex_lowering import as_on_cuda

    def kernel_backend(gm: Any, example_inputs: list) -> Callable[..., Any]:
        grads = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in example_inputs)
        (counts.backward if grads else counts.forward).append(graph_key(gm, example_inputs))
        return gm.forward

    def mask_backend(gm: Any, example_inputs: list) -> Callable[..., Any]:
        counts.masks.append(graph_key(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    patch = MonkeyPatch()
    try:
        as_on_cuda(patch)
        kernel = torch.compile(flex_attention, backend=kernel_backend, dynamic=True)
        masks = torch.compile(create_block_mask, backend=mask_backend)
        patch.setattr(flex, "kernel", lambda device_type, compiled: kernel)

        def build(mask_mod: Any, rows: int | None, tq: int, tk: int, device: Any) -> Any:
            what = f"a block mask of {tq} x {tk}"
            with torch.no_grad():  # as flex.build_block_mask
                return flex._within_budget(masks, what, mask_mod, rows, None, tq, tk, device=device)

        patch.setattr(flex, "build_block_mask", build)
        flex.causal_block_mask.cache_clear()
        flex.span_block_mask.cache_clear()
        yield
    finally:
        patch.undo()
        torch._dynamo.reset()
        flex.causal_block_mask.cache_clear()
        flex.span_block_mask.cache_clear()


def count_training(overrides: list[str], tmp: Path) -> Counts:
    """The graphs of one ``posformer-train`` job run :data:`STEPS_HERE` steps with CUDA's decisions on
    the CPU, validated twice and evaluated at its lengths (a GPU job's precision kept)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from posformer.training import run

    gpu = "trainer=gpu" in overrides
    own = [o for o in overrides if not o.startswith(("hydra.", "trainer.max_steps", "trainer.val_check"))]
    own = ["trainer=cpu" if o == "trainer=gpu" else o for o in own]
    if gpu and not any(o.startswith("trainer.precision=") for o in own):
        own.append("trainer.precision=bf16-mixed")  # trainer=gpu's
    own += [
        f"trainer.max_steps={STEPS_HERE}",
        f"trainer.val_check_interval={STEPS_HERE // 2}",
        "logger=none",
        "callbacks.pe_heatmap=null",
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
        f"paths.output_dir={tmp / 'run'}",
        f"paths.cache_dir={tmp / 'cache'}",
    ]
    counts = Counts()
    GlobalHydra.instance().clear()
    with initialize_config_module("posformer.configs", version_base="1.3"):
        cfg = compose("train", overrides=own)
    if cfg.data.name == "text":  # the check writes its text when it runs: one stands in
        tmp.mkdir(parents=True, exist_ok=True)
        text = tmp / "lm.txt"
        text.write_text((ROOT / "README.md").read_text(encoding="utf-8") * 4, encoding="utf-8")
        cfg.data.path = str(text)
    with counting(counts):
        run(cfg)
    return counts


def count_case(nodeid: str) -> Counts:
    """The graphs of one CUDA test case, its body run on the CPU as ``rehearse_cuda_tests.py`` does."""
    sys.path[:0] = [str(ROOT), str(TESTS), str(ROOT / "scripts")]
    import importlib

    import pytest
    from _pytest.monkeypatch import MonkeyPatch
    from rehearse_cuda_tests import on_the_cpu

    from tests.conftest import _tiny_model

    path, _, name = nodeid.partition("::")
    func, _, _ = name.partition("[")
    module = importlib.import_module(".".join(Path(path).with_suffix("").parts))  # tests.model.test_x
    params = case_params(nodeid)
    body = on_the_cpu(module, func, getattr(module, func))
    counts = Counts()
    patch = MonkeyPatch()
    fixtures = {"tiny_model": _tiny_model, "monkeypatch": patch, "fresh_compiles": None}
    wanted = set(body.__code__.co_varnames[: body.__code__.co_argcount])
    try:
        with counting(counts):
            body(**params, **{k: v for k, v in fixtures.items() if k in wanted})
    except (Exception, pytest.skip.Exception) as exc:  # noqa: BLE001 - the counts up to it still stand
        warnings.warn(f"{nodeid}: {type(exc).__name__}: {str(exc)[:120]}", stacklevel=1)
    finally:
        patch.undo()
    return counts


#: node id -> its parameters, from pytest's collection of its module
_PARAMS: dict[str, dict[str, Any]] = {}


class _Params:
    """A pytest plugin that keeps every collected item's parameters in :data:`_PARAMS`."""

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        for item in items:
            callspec = getattr(item, "callspec", None)
            _PARAMS[item.nodeid] = dict(callspec.params) if callspec is not None else {}


def case_params(nodeid: str) -> dict[str, Any]:
    """The keyword arguments of a parametrized node id, from pytest's own collection of its module."""
    import pytest

    if nodeid not in _PARAMS:
        quiet = ["--collect-only", "-q", "-o", "addopts=", "-p", "no:xdist", "-p", "no:cacheprovider"]
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            pytest.main([*quiet, nodeid.split("::")[0]], plugins=[_Params()])
    return _PARAMS.get(nodeid, {})


def count_stage(stage: Stage, tmp: Path) -> dict[str, Counts]:
    """Every graph a stage compiles, by unit: each training job's (``job0``, ...) or each test module's
    (its cases run in one pytest process). Evaluation and inspection jobs compile none (RoPE's fused
    SDPA, no Flex)."""
    units: dict[str, Counts] = {}
    cli = console_args(stage.words)
    if cli is not None and cli[0] == "posformer-train":
        for i, job in enumerate(stage.jobs):
            units[f"job{i}"] = count_training(job, tmp / f"{stage.id}-{i}")
    for module, cases in by_module(stage.cases).items():
        units[module] = Counts()
        for case in cases:
            units[module] += count_case(case)
    return units


# ------------------------------------------------------------------------------------------ estimates
def merged(units: dict[str, Counts]) -> Counts:
    total = Counts()
    for counts in units.values():
        total += counts
    return total


def estimate(stage: Stage, units: dict[str, Counts]) -> float:
    """Expected seconds of ``stage`` on a cold machine (module docstring). Test modules run in
    ``stage.workers`` processes at once: their work shared among them, at least the longest module's."""
    if stage.id == "setup":
        return SETUP_S
    if stage.cases:
        cases = by_module(stage.cases)
        work = [
            COST["process"] + len(cases[module]) * COST["test"] + units.get(module, Counts()).cost()
            for module in cases
        ]
        return max(sum(work) / stage.workers, max(work))
    jobs = max(1, len(stage.jobs))
    return COST["process"] + jobs * (COST["job"] + stage.steps * COST["step"]) + merged(units).cost()


def table(stages: list[Stage], counts: dict[str, dict[str, Counts]], global_budget: int) -> tuple[str, bool]:
    """The Markdown table of estimates against budgets, lane totals, and whether everything fits."""
    lines = [
        "| stage | lane | jobs / cases | forward graphs | with backward | masks | estimate s | budget s | |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ok = True
    for s in stages:
        units = counts.get(s.id, {})
        c, est = merged(units), estimate(s, units)
        fits = est <= s.budget
        ok &= fits
        work = len(s.cases) or len(s.jobs)
        lines.append(
            f"| {s.id} | {s.lane} | {work} | {_n(c.forward)} | {_n(c.backward)} | {_n(c.masks)} | {est:.0f} "
            f"| {s.budget} "
            f"| {'fits' if fits else 'OVER'} |"
        )
    setup = sum(s.budget for s in stages if s.lane == 0)
    for lane in sorted({s.lane for s in stages} - {0}):
        total = setup + sum(s.budget for s in stages if s.lane == lane)
        ok &= total <= global_budget
        names = ", ".join(s.id for s in stages if s.lane == lane)
        lines.append(f"\nlane {lane} ({names}): setup + budgets = {total} s of the global {global_budget} s")
    return "\n".join(lines), ok


def _n(keys: list[str]) -> str:
    """``distinct (all)`` graphs, or one number when every graph is distinct."""
    distinct = len(set(keys))
    return str(distinct) if distinct == len(keys) else f"{distinct} ({len(keys)})"


def global_budget(text: str) -> int:
    m = re.search(r"global budget (\d+)s", text)
    return int(m.group(1)) if m else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=Path, help="read the graph counts from this JSON file")
    parser.add_argument("--write", type=Path, help="count, and write the counts to this JSON file")
    parser.add_argument("--script", type=Path, default=SCRIPT, help="the check to plan (default: today's)")
    args = parser.parse_args(argv)
    text = dry_run(args.script)
    stages = plan(text)
    if args.counts:
        saved = json.loads(args.counts.read_text())
        counts = {sid: {unit: Counts(**c) for unit, c in units.items()} for sid, units in saved.items()}
    else:
        import tempfile

        warnings.simplefilter("ignore")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        with tempfile.TemporaryDirectory() as tmp:
            counts = {s.id: count_stage(s, Path(tmp)) for s in stages}
    if args.write:
        units = {sid: {unit: asdict(c) for unit, c in us.items()} for sid, us in counts.items()}
        args.write.write_text(json.dumps(units, indent=1) + "\n")
    text_table, ok = table(stages, counts, global_budget(text))
    print(text_table)
    print("\ncosts (s, stated): " + ", ".join(f"{k} {v:g}" for k, v in COST.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
