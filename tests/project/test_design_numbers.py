"""docs/design.md's numbers are the code's: its code-metrics table is what ``scripts/code_metrics.py``
measures on this tree (the "now" column), so a change that moves a number moves the doc with it
(``python scripts/code_metrics.py --before 8b205df --write docs/design.md``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def load_code_metrics():
    spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "scripts" / "code_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented() -> dict[str, str]:
    """measure -> the "now" cell of design.md's code-metrics table."""
    block = re.search(r"<!-- code-metrics -->\n(.*?)\n<!-- /code-metrics -->", DESIGN.read_text(), re.S)
    assert block, "docs/design.md has no <!-- code-metrics --> table"
    rows = [line.strip("|").split(" | ") for line in block.group(1).splitlines()[2:]]
    return {cells[0].strip(): cells[-1].strip() for cells in rows}


@pytest.mark.slow
def test_design_doc_numbers_are_the_trees() -> None:
    measured = {k: str(v) for k, v in load_code_metrics().measure(ROOT).items()}
    doc = documented()
    assert list(doc) == list(measured)
    stale = {k: (doc[k], v) for k, v in measured.items() if doc[k] != v}
    assert not stale, f"docs/design.md is stale (doc, tree): {stale}; rerun scripts/code_metrics.py --write"


def test_the_layers_contract_names_every_package() -> None:
    """pyproject.toml's import-linter layers name every top-level module of the package, so a new one
    is placed in the layers on purpose (an unnamed module is held by no contract)."""
    text = (ROOT / "pyproject.toml").read_text()
    layers = re.search(r'type = "layers"\nlayers = \[(.*?)\]', text, re.S).group(1)
    named = set(re.findall(r"posformer\.(\w+)", layers))
    package = {
        p.stem for p in (ROOT / "posformer").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    assert package - {"__init__"} == named
