"""The architecture numbers of a posformer tree: longest functions, function-local imports, package cycles.

    python scripts/code_metrics.py                 # this tree
    python scripts/code_metrics.py /path/to/tree   # another checkout (e.g. a git worktree of an older commit)

Prints one Markdown table: lines of ``posformer/config.py``, modules in ``posformer/eval/``, functions
over 80 lines (and the longest), imports of posformer modules inside function bodies, cycles between
the top-level subpackages of ``posformer`` (``lit -> eval -> lit``), module-level and local imports alike,
and the size of the PE contract: the public methods of ``PositionalEncoding`` and the fields of its
``Capabilities`` record (``posformer/pe/base.py``). Static (``ast``): nothing is imported or run.
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
        "config.py lines": len((pkg / "config.py").read_text(encoding="utf-8").splitlines()),
        "eval/ modules": len([p for p in (pkg / "eval").glob("*.py") if p.name != "__init__.py"]),
        "functions > 80 lines": len(long_fns),
        "longest function": f"{longest[0]} ({longest[1]} lines)",
        "function-local posformer imports": local_imports,
        "subpackage cycles": ", ".join(f"{a}↔{b}" for a, b in cycles(graph)) or "none",
        "PE contract: public methods of PositionalEncoding": methods,
        "PE contract: fields of Capabilities": fields,
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
