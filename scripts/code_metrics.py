"""The architecture numbers of a posformer tree: longest functions, function-local imports, package cycles.

    python scripts/code_metrics.py                 # this tree
    python scripts/code_metrics.py /path/to/tree   # another checkout (e.g. a git worktree of an older commit)

Prints one Markdown table: lines of ``posformer/config.py``, modules in ``posformer/eval/``, functions
over 80 lines (and the longest), imports of posformer modules inside function bodies, cycles between
the top-level subpackages of ``posformer`` (``lit -> eval -> lit``), module-level and local imports alike,
the size of the PE contract: the public methods of ``PositionalEncoding`` and the fields of its
``Capabilities`` record (``posformer/pe/base.py``), and the config's measures (:func:`config_measures`:
validation lines, type checkers, dataset tables, ``posformer-eval``'s rule passes,
``OmegaConf.to_container`` sites), and the layers' measures (:func:`layer_measures`: package and
reporting lines, mean ± std implementations, ``eval/`` -> ``lit/`` imports, written-out metric lists,
``# fmt: skip`` lines). Static (``ast`` and text): nothing is imported or run.

    python scripts/code_metrics.py --before 8b205df --write docs/design.md   # the table of docs/design.md

``--before REF`` adds a column measured on a git ref (``git archive``, no checkout); ``--write FILE``
puts the table between FILE's ``<!-- code-metrics -->`` and ``<!-- /code-metrics -->`` lines
(``tests/project/test_docs.py`` holds the "now" column to this tree).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def imported_packages(node: ast.AST, module: str) -> set[str]:
    """Top-level posformer subpackages imported anywhere under ``node`` (``posformer.lit.x`` -> ``lit``)."""
    out = set()
    for n in ast.walk(node):
        names: list[str] = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module:
            names = [n.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "posformer" and len(parts) > 1:
                out.add(parts[1])
    return out - {module}


def _imports_posformer(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "posformer"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "posformer" for a in node.names)


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of subpackages that import each other (directly or through others)."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    closure = {p: reach(p) for p in graph}
    pairs = {tuple(sorted((a, b))) for a in graph for b in closure[a] if a != b and a in closure.get(b, ())}
    return sorted(pairs)


def _class(tree: ast.AST, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def pe_contract(base: Path) -> tuple[int, int]:
    """(public methods of ``PositionalEncoding``, fields of ``Capabilities``) as ``base`` defines them: the
    methods (properties included) the class body defines without a leading underscore, and the annotated
    dataclass fields (``ClassVar`` left out)."""
    tree = ast.parse(base.read_text(encoding="utf-8"))
    pe, caps = _class(tree, "PositionalEncoding"), _class(tree, "Capabilities")
    methods = [n for n in pe.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    fields = [
        n for n in caps.body if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation)
    ]
    return len(methods), len(fields)


#: the modules that type, check and word the config: the six of the typed-config issue (``cli/composition.py``
#: since split into ``configs/composition.py`` + ``cli/composition.py``) and the homes the checks moved to
VALIDATION_MODULES = (
    "posformer/config.py",
    "posformer/configs/schema.py",
    "posformer/configs/eval_schema.py",
    "posformer/rules.py",
    "posformer/data/options.py",
    "posformer/configs/composition.py",
    "posformer/cli/composition.py",
    "posformer/configs/checks.py",
    "posformer/configs/settings.py",
)
#: the built-in datasets: a dict keyed by three or more of them is a table of datasets
DATASET_NAMES = {"synthetic", "text", "hub", "corpus", "translation"}
#: the typing calls a hand-written type checker makes (it compares values with type hints)
TYPE_INTROSPECTION = {"get_origin", "get_args", "get_type_hints"}
#: the modules on ``posformer-eval``'s path up to its first checkpoint
EVAL_PATH = (
    "posformer/eval/run.py",
    "posformer/eval/settings.py",
    "posformer/configs/eval_schema.py",
)


def _calls(node: ast.AST) -> set[str]:
    """Names of the functions ``node`` calls (``a.b.c(...)`` -> ``c``)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            out.add(n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
    return out


def _dataset_tables(tree: ast.Module, rel: str) -> list[str]:
    """Module-level dicts keyed by three or more built-in dataset names (``rel:NAME``)."""
    out = []
    for node in tree.body:
        value = getattr(node, "value", None)
        if not isinstance(value, ast.Dict):
            continue
        keys = {k.value for k in value.keys if isinstance(k, ast.Constant)}
        if len(keys & DATASET_NAMES) >= 3:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            out.append(f"{rel}:{getattr(target, 'id', '?')}")
    return out


def config_measures(root: Path) -> dict[str, object]:
    """The config's numbers; each counts what its comment says."""
    # validation lines: the lines of the VALIDATION_MODULES this tree has
    present = {}
    for module in VALIDATION_MODULES:
        if (root / module).is_file():
            present[module.removeprefix("posformer/")] = len((root / module).read_text().splitlines())
    checkers, tables, passes, to_container = [], [], [], 0
    for path in sorted((root / "posformer").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree, rel = ast.parse(text), str(path.relative_to(root))
        # OmegaConf.to_container sites: lines of posformer/ that name it (grep to_container posformer/)
        to_container += sum("to_container" in line for line in text.splitlines())
        # hand-written type checkers: modules whose functions compare values with type hints
        if any(_calls(fn) & TYPE_INTROSPECTION for fn in functions(tree)):
            checkers.append(rel)
        # dataset tables: module-level dicts keyed by built-in dataset names
        tables += _dataset_tables(tree, rel)
        # posformer-eval's rule passes: functions on its path that raise the rule lines they collected
        if rel in EVAL_PATH:
            passes += [f"{rel}:{fn.name}" for fn in functions(tree) if "raise_problems" in _calls(fn)]
    files = ", ".join(f"{m} {n}" for m, n in present.items())
    home_made = f", a hand-written one in {', '.join(checkers)}" if checkers else ""
    return {
        "validation lines": f"{sum(present.values())} ({files})",
        "type checkers": f"{1 + bool(checkers)} (OmegaConf's{home_made})",
        "dataset tables": f"{len(tables)} ({', '.join(tables)})",
        "posformer-eval rule passes": f"{len(passes)} ({', '.join(passes)})",
        "OmegaConf.to_container sites": to_container,
    }


#: the modules that write results files, tables, console summaries and figures, or aggregate over seeds
REPORTING_MODULES = (
    "posformer/metrics.py",
    "posformer/bench/report.py",
    "posformer/eval/console.py",
    "posformer/eval/plots.py",
    "posformer/eval/results.py",
    "posformer/eval/seeds.py",
    "posformer/eval/sweep.py",
    "posformer/lit/results.py",
    "posformer/studies/aggregate.py",
    "posformer/studies/algorithmic_summary.py",
    "posformer/studies/figures.py",
    "posformer/studies/leaderboard.py",
    "posformer/utils/figures.py",
    "posformer/utils/format.py",
)
#: the metrics a results table shows: a literal naming two or more of them is a metric list
METRIC_NAMES = {"exact_match", "token_acc", "loss", "ppl"}
#: the calls that take a standard deviation (``statistics.stdev``, ``Tensor.std``, ``ndarray.std``)
STD_CALLS = {"stdev", "std", "pstdev"}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _metric_lists(tree: ast.AST) -> int:
    """Tuple, list, set and dict literals that name two or more of :data:`METRIC_NAMES`."""
    count = 0
    for n in ast.walk(tree):
        items = n.keys if isinstance(n, ast.Dict) else getattr(n, "elts", None)
        if isinstance(n, ast.Tuple | ast.List | ast.Set | ast.Dict) and items:
            found = {i.value for i in items if isinstance(i, ast.Constant) and i.value in METRIC_NAMES}
            count += len(found) >= 2
    return count


def _takes_std(fn: ast.AST) -> bool:
    """Whether a function takes a standard deviation (calls one of :data:`STD_CALLS`)."""
    return bool(_calls(fn) & STD_CALLS)


def layer_measures(root: Path) -> dict[str, object]:
    """Sizes of the package and its reporting layer, and the repeats and leaks the layers rule out."""
    package = sorted((root / "posformer").rglob("*.py"))
    reporting = {m: _lines(root / m) for m in REPORTING_MODULES if (root / m).is_file()}
    std_fns, metric_lists, eval_to_lit = [], [], 0
    for path in package:
        tree, rel = ast.parse(path.read_text(encoding="utf-8")), path.relative_to(root).as_posix()
        # innermost functions only: a helper's caller is not a second implementation
        takes = [f for f in functions(tree) if _takes_std(f)]
        inner = [f for f in takes if not any(_takes_std(g) for g in functions(f)[1:])]
        std_fns += [f"{rel}:{f.name}" for f in inner]
        if rel != "posformer/metrics.py" and (found := _metric_lists(tree)):
            metric_lists.append((rel, found))
        if rel.startswith("posformer/eval/"):
            eval_to_lit += sum(
                isinstance(n, ast.Import | ast.ImportFrom)
                and any(name.startswith("posformer.lit") for name in _import_names(n))
                for n in ast.walk(tree)
            )
    sources = [*package, *(root / "scripts").glob("*.py"), *(root / "tests").rglob("*.py")]
    skips = sum(line.rstrip().endswith("# fmt: skip") for p in sources for line in p.read_text().splitlines())
    lists = f"{sum(n for _, n in metric_lists)} in {len(metric_lists)} modules"
    lists += f" ({', '.join(f'{rel} {n}' for rel, n in metric_lists)})" if metric_lists else ""
    return {
        "package lines": sum(_lines(p) for p in package),
        "reporting lines": f"{sum(reporting.values())} in {len(reporting)} modules",
        "mean ± std implementations": f"{len(std_fns)} ({', '.join(std_fns)})",
        "eval/ → lit/ imports": eval_to_lit,
        "metric lists outside the registry": lists,
        "`# fmt: skip` lines (package, scripts, tests)": skips,
    }


def _import_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        return [base, *(f"{base}.{a.name}" for a in node.names)]
    return [a.name for a in node.names]


def measure(root: Path) -> dict[str, object]:
    pkg = root / "posformer"
    long_fns, local_imports, graph = [], 0, {}
    longest = ("", 0)
    for path in sorted(pkg.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = path.relative_to(root)
        sub = rel.parts[1].removesuffix(".py") if len(rel.parts) > 2 else rel.stem
        graph.setdefault(sub, set()).update(imported_packages(tree, sub))
        for fn in functions(tree):
            length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if length > 80:
                long_fns.append(f"{rel}:{fn.name} ({length})")
            if length > longest[1]:
                longest = (f"{rel}:{fn.name}", length)
            local_imports += sum(_imports_posformer(n) for n in ast.walk(fn))
    methods, fields = pe_contract(pkg / "pe" / "base.py")
    return {
        "config.py lines": len((pkg / "config.py").read_text().splitlines())
        if (pkg / "config.py").is_file()
        else 0,
        "eval/ modules": len([p for p in (pkg / "eval").glob("*.py") if p.name != "__init__.py"]),
        "functions > 80 lines": len(long_fns),
        "longest function": f"{longest[0]} ({longest[1]} lines)",
        "function-local posformer imports": local_imports,
        "subpackage cycles": ", ".join(f"{a}↔{b}" for a, b in cycles(graph)) or "none",
        "PE contract: public methods of PositionalEncoding": methods,
        "PE contract: fields of Capabilities": fields,
        **config_measures(root),
        **layer_measures(root),
    }


def archived(ref: str, repo: Path, into: Path) -> Path:
    """The files of ``ref`` (``git archive``) under ``into``: a tree to measure without a checkout."""
    data = subprocess.run(["git", "-C", str(repo), "archive", ref], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def table(now: dict[str, object], before: dict[str, object] | None = None, ref: str = "") -> str:
    """The Markdown table: a row per measure, the ``before`` column first when given."""
    rows = ["| measure | " + (f"{ref} | now |" if before is not None else "now |")]
    rows.append("|---|" + ("---|---|" if before is not None else "---|"))
    for key, value in now.items():
        old = f" {before.get(key, '—')} |" if before is not None else ""
        rows.append(f"| {key} |{old} {value} |")
    return "\n".join(rows)


def write_into(doc: Path, text: str) -> None:
    """Replace what lies between ``doc``'s code-metrics markers with ``text``."""
    pattern = re.compile(r"(<!-- code-metrics -->\n).*?(\n<!-- /code-metrics -->)", re.S)
    old = doc.read_text(encoding="utf-8")
    if not pattern.search(old):
        raise SystemExit(f"code_metrics: {doc} has no <!-- code-metrics --> ... <!-- /code-metrics --> lines")
    doc.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(2), old), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--before", metavar="REF", help="a git ref to measure too (a column before 'now')")
    ap.add_argument("--write", metavar="FILE", type=Path, help="put the table between FILE's markers")
    args = ap.parse_args()
    before = None
    if args.before:
        with tempfile.TemporaryDirectory() as tmp:
            before = measure(archived(args.before, args.root, Path(tmp)))
    text = table(measure(args.root), before, args.before or "")
    if args.write:
        write_into(args.write, text)
    print(text)


if __name__ == "__main__":
    main()
