"""The architecture numbers of a posformer tree: longest functions, function-local imports, package cycles.

    python scripts/code_metrics.py                 # this tree
    python scripts/code_metrics.py /path/to/tree   # another checkout (e.g. a git worktree of an older commit)

Prints one Markdown table: lines of ``posformer/config.py``, modules in ``posformer/eval/``, functions
over 80 lines (and the longest), imports of posformer modules inside function bodies, cycles between
the top-level subpackages of ``posformer`` (``lit -> eval -> lit``), module-level and local imports alike,
the size of the PE contract: the public methods of ``PositionalEncoding`` and the fields of its
``Capabilities`` record (``posformer/pe/base.py``), and the config's measures (:func:`config_measures`:
validation lines, type checkers, dataset tables, ``posformer-eval``'s rule passes,
``OmegaConf.to_container`` sites). Static (``ast`` and text): nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
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
    "posformer/configs/data.py",
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
    "posformer/configs/settings.py",
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
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args()
    print("| measure | value |\n|---|---|")
    for key, value in measure(args.root).items():
        print(f"| {key} | {value} |")


if __name__ == "__main__":
    main()
