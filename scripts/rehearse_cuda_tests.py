"""Run the body of every ``cuda``-marked test on the CPU, on CUDA's attention paths, before a GPU window.

The ``cuda`` tests run only on a lent GPU (``scripts/gpu_check.sh`` stage h, ``scripts/gpu_speed.sh``
stage t), and the project can go without one for a long time. A test written without a GPU can be wrong
in ways no CPU run shows, and then it costs part of a short GPU window. One GPU window found four such
tests: two tensors of different head sizes, a length below Shaw's shortcut threshold, and heads of 8,
which the GPU's Flex kernel refuses. This script runs each such test's body here:

- the literal ``"cuda"`` devices become ``"cpu"``, and ``.cuda()`` becomes ``.cpu()``;
  ``device_type="cuda"`` and ``offers_attention("cuda")`` stay, because they ask about CUDA's decisions;
- ``tests/flex_lowering.py::as_on_cuda`` sends every attention call through CUDA's paths and runs the
  checks inductor's GPU lowering makes.

It runs the first four parametrizations of each test. Tests that need fixtures other than
``tiny_model`` and ``monkeypatch`` (the ``posformer-train`` flows) are listed as skipped; so are those
in :data:`DEVICE_ONLY`, whose assertions are about the device itself.

    python scripts/rehearse_cuda_tests.py               # every tests/**/test_*.py with a cuda test
    python scripts/rehearse_cuda_tests.py test_flex     # some modules

Exit status 1 if a body fails. ``tests/project/test_gpu_check.py`` runs it (``slow``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import itertools
import re
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
#: tests whose assertions are about the device itself: they fail on the CPU by design
#: tests whose assertions are about the device itself (fused AdamW exists on CUDA only)
DEVICE_ONLY = {"tests.bench.test_bench_mfu.test_cuda_training_uses_the_fused_optimizer"}
#: the fixtures a body may take here
FIXTURES = ("tiny_model", "monkeypatch", "fresh_compiles")
#: parametrizations run per test
PER_TEST = 4


def cuda_tests(module: Any) -> Iterator[tuple[str, Callable[..., Any]]]:
    """(name, function) of every test in ``module`` marked ``cuda``."""
    for name, fn in vars(module).items():
        if name.startswith("test_") and any(m.name == "cuda" for m in getattr(fn, "pytestmark", [])):
            yield name, fn


def on_the_cpu(module: Any, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recompiled from its source with its devices on the CPU (see the module docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tree.body[0].decorator_list = []  # type: ignore[attr-defined]
    code = re.sub(r"(?<!device_type=)(?<!offers_attention\()'cuda'", "'cpu'", ast.unparse(tree))
    code = code.replace(".cuda()", ".cpu()")
    namespace = dict(vars(module))
    exec(compile(code, f"<{module.__name__}.{name} on the CPU>", "exec"), namespace)
    return namespace[name]


def parametrizations(fn: Callable[..., Any]) -> list[dict[str, Any]]:
    """Every combination of ``fn``'s ``parametrize`` marks, as keyword arguments."""
    axes = []
    for mark in (m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"):
        names = mark.args[0] if isinstance(mark.args[0], list | tuple) else mark.args[0].split(",")
        names = [n.strip() for n in names]
        values = [v.values if hasattr(v, "values") else v for v in mark.args[1]]  # pytest.param: .values
        axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in values])
    return [dict(kv for d in combo for kv in d.items()) for combo in itertools.product(*axes)]


def rehearse(module_name: str) -> list[tuple[str, str, str]]:
    """(status, test, detail) for each cuda test of ``module_name``: OK, FAIL or SKIP."""
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    from tests.conftest import _tiny_model
    from tests.flex_lowering import as_on_cuda

    module = importlib.import_module(module_name)
    results = []
    for name, fn in cuda_tests(module):
        test = f"{module_name}.{name}"
        params = set(inspect.signature(fn).parameters)
        extra = params - set(FIXTURES) - set().union(*(p.keys() for p in parametrizations(fn) or [{}]))
        if test in DEVICE_ONLY or extra:
            results.append(
                ("SKIP", test, "device-only" if test in DEVICE_ONLY else f"fixtures {sorted(extra)}")
            )
            continue
        body = on_the_cpu(module, name, fn)
        for kwargs in (parametrizations(fn) or [{}])[:PER_TEST]:
            patch = MonkeyPatch()
            fixtures = {"tiny_model": _tiny_model, "monkeypatch": patch, "fresh_compiles": None}
            try:
                as_on_cuda(patch)
                body(**kwargs, **{k: v for k, v in fixtures.items() if k in params})
                results.append(("OK", test, str(kwargs)))
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                where = traceback.extract_tb(exc.__traceback__)[-1]
                line = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                results.append(
                    ("FAIL", test, f"{kwargs} {line} at {Path(where.filename).name}:{where.lineno}")
                )
            finally:
                patch.undo()
                torch._dynamo.reset()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="test modules (default: every one with a cuda test)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(TESTS.parent), str(TESTS)]  # the tests package, and its helpers by name
    warnings.simplefilter("ignore")
    found = {
        p.stem: p for p in TESTS.rglob("test_*.py") if "pytest.mark.cuda" in p.read_text(encoding="utf-8")
    }
    chosen = [found[m.removesuffix(".py").rsplit("/", 1)[-1]] for m in args.modules] or sorted(found.values())
    modules = [".".join(p.relative_to(TESTS.parent).with_suffix("").parts) for p in chosen]
    results = [r for m in modules for r in rehearse(m)]
    for status, test, detail in results:
        print(f"{status:4} {test} {detail}")
    failed = sum(status == "FAIL" for status, _, _ in results)
    print(
        f"{len(results)} runs: {sum(s == 'OK' for s, _, _ in results)} OK, {failed} FAIL, "
        f"{sum(s == 'SKIP' for s, _, _ in results)} SKIP"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
