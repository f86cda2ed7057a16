"""The docs list exactly the registered PEs with their hooks, and the registry checks declarations.

README.md ("## Positional encodings") and docs/encodings.md ("## The encodings") each have one table
row per PE; the hook column must name the hooks of the class's ``capabilities``. Adding a PE to the
registry without a row in both tables (or with the wrong hooks) fails here.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

import posformer
from posformer.pe import (
    ENCODINGS,
    AttentionShortcut,
    Capabilities,
    Features,
    Offsets,
    PerCall,
    PositionalEncoding,
    Positions,
    build_encoding,
    register,
)
from posformer.pe.base import HOOKS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ENCODINGS_DOC = ROOT / "docs" / "encodings.md"
#: what a hook cell says for a PE without hooks (nope)
NO_HOOK = {"—", "–", "-", "none", ""}


# ------------------------------------------------------------------------------ markdown parsing
def section(text: str, heading: str) -> str:
    """The body of the section ``heading`` (a ``#``-line, any level), up to the next heading of that
    level or above."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(.*?)\s*$", line)
        if m and m.group(2) == heading:
            level = len(m.group(1))
            body = []
            for nxt in lines[i + 1 :]:
                h = re.match(r"^(#+)\s", nxt)
                if h and len(h.group(1)) <= level:
                    break
                body.append(nxt)
            return "\n".join(body)
    raise AssertionError(f"no section {heading!r}")


def split_row(line: str) -> list[str]:
    """Cells of a markdown table row; ``\\|`` inside a cell is not a separator."""
    inner = line.strip()
    assert inner.startswith("|") and inner.endswith("|"), line
    cells = re.split(r"(?<!\\)\|", inner[1:-1])
    return [c.strip() for c in cells]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in ``text``: a list of rows (header first, separator row dropped)."""
    out, current = [], []
    for line in text.splitlines() + [""]:
        if line.strip().startswith("|"):
            current.append(split_row(line))
        elif current:
            out.append(current)
            current = []
    for table in out:
        assert len(table) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in table[1]), table[:2]
        del table[1]
    return out


def pe_table(text: str, heading: str) -> dict[str, str]:
    """The one table of section ``heading`` whose header starts with ``name`` and has a hook column:
    PE name (backticks stripped) -> hook cell."""
    found = [
        t
        for t in tables(section(text, heading))
        if t[0][0].lower() == "name" and any(c.lower().startswith("hook") for c in t[0])
    ]
    assert len(found) == 1, f"expected one PE table under {heading!r}, found {len(found)}"
    header, *rows = found[0]
    col = next(i for i, c in enumerate(header) if c.lower().startswith("hook"))
    by_name: dict[str, str] = {}
    for row in rows:
        assert len(row) == len(header), row
        name = row[0].strip("`")
        assert name not in by_name, f"{name!r} listed twice under {heading!r}"
        by_name[name] = row[col]
    return by_name


def hooks_of_cell(cell: str) -> frozenset[str]:
    """``"bias (reads q) + value"`` -> {bias, value}; ``"—"`` / ``"none"`` -> {}. Parenthesised
    remarks are ignored; every other word must be a hook name."""
    bare = re.sub(r"\([^)]*\)", " ", cell).replace("`", "")
    parts = [p.strip() for p in re.split(r"\+|,|/|&|\band\b", bare)]
    if all(p.lower() in NO_HOOK for p in parts):
        return frozenset()
    unknown = [p for p in parts if p not in HOOKS]
    assert not unknown, f"hook cell {cell!r}: {unknown} are not hooks ({', '.join(HOOKS)})"
    return frozenset(parts)


DOC_TABLES = {
    "README.md": (README, "Positional encodings"),
    "docs/encodings.md": (ENCODINGS_DOC, "The encodings"),
}


@pytest.fixture(scope="module", params=sorted(DOC_TABLES))
def doc_table(request) -> tuple[str, dict[str, str]]:
    path, heading = DOC_TABLES[request.param]
    return request.param, pe_table(path.read_text(encoding="utf-8"), heading)


# ------------------------------------------------------------------------------ the parser itself
def test_hook_cells_parse_to_hook_sets() -> None:
    assert hooks_of_cell("embed") == {"embed"}
    assert hooks_of_cell("rotary (+decay)") == {"rotary"}
    assert hooks_of_cell("bias (query-dependent) + value") == {"bias", "value"}
    assert hooks_of_cell("—") == hooks_of_cell("none") == frozenset()
    with pytest.raises(AssertionError, match="not hooks"):
        hooks_of_cell("bias + magic")


def test_pe_table_finds_rows_and_rejects_duplicates() -> None:
    text = "\n".join(
        ["## PEs", "", "| name | hook | x |", "|---|---|---|", "| `a` | embed | 1 |", "| `b` | — | \\| 2 |"]
        + ["", "## Next", ""]
    )
    assert pe_table(text, "PEs") == {"a": "embed", "b": "—"}
    with pytest.raises(AssertionError, match="listed twice"):
        pe_table(text.replace("`b`", "`a`"), "PEs")
    with pytest.raises(AssertionError, match="no section"):
        pe_table(text, "Missing")


# ------------------------------------------------------------------------------ docs vs registry
def test_docs_list_exactly_the_registered_pes(doc_table) -> None:
    where, rows = doc_table
    registered = set(posformer.list_encodings())
    missing, extra = sorted(registered - set(rows)), sorted(set(rows) - registered)
    assert not missing, f"{where}: registered PEs without a row: {missing}"
    assert not extra, f"{where}: rows for PEs that are not registered: {extra}"


def test_docs_hook_column_matches_capabilities(doc_table) -> None:
    where, rows = doc_table
    wrong = {
        name: (cell, sorted(ENCODINGS[name].capabilities.hooks))
        for name, cell in rows.items()
        if name in ENCODINGS and hooks_of_cell(cell) != ENCODINGS[name].capabilities.hooks
    }
    assert not wrong, f"{where}: hook column (cell, declared hooks) differs: {wrong}"


def test_encodings_doc_hook_table_lists_every_hook() -> None:
    text = ENCODINGS_DOC.read_text(encoding="utf-8")
    [table] = [t for t in tables(text) if t[0][0].lower() == "hook"]
    assert [row[0].strip("`") for row in table[1:]] == list(HOOKS)


def test_encodings_doc_pe_apply_table_covers_every_pe_once() -> None:
    text = section(ENCODINGS_DOC.read_text(encoding="utf-8"), "Where a PE is applied: `model.pe_apply`")
    [table] = [t for t in tables(text) if t[0][0] == "PE"]
    names = [n.strip().strip("`") for row in table[1:] for n in row[0].split(",")]
    assert sorted(names) == posformer.list_encodings()


# ------------------------------------------------------------------------------ registration checks
@pytest.fixture
def registry_guard():
    """Whatever a test registers is removed afterwards (the docs tests compare the registry)."""
    before = dict(ENCODINGS)
    yield
    ENCODINGS.clear()
    ENCODINGS.update(before)


def _bias(self, q_pos, k_pos, *, q=None, layer=0):  # a bias method for the test classes below
    return (q_pos[:, None, :, None] - k_pos[:, None, None, :]).float()


class _Bias(PositionalEncoding):
    bias_form = Offsets()
    bias = _bias


def _bias_fn(self, layer=0):  # an elementwise bias for the test classes below
    return lambda h, q_pos, k_pos: (q_pos - k_pos).float()


def test_a_consistent_declaration_registers(registry_guard) -> None:
    cls = type("GoodBias", (_Bias,), {})
    assert register("_test_good_bias")(cls) is cls
    assert ENCODINGS["_test_good_bias"] is cls and cls.name == "_test_good_bias"
    assert cls.capabilities.hooks == {"bias"} and cls.capabilities.bias == Offsets()


def test_a_bias_without_a_stated_form_has_the_general_one() -> None:
    """A class that states no form has the form of what it defines: bias -> Positions(), bias_fn ->
    Positions(score_mod=True); without either, no bias hook."""
    assert type("Plain", (PositionalEncoding,), {"bias": _bias}).capabilities.bias == Positions()
    elementwise = type("Elementwise", (PositionalEncoding,), {"bias_fn": _bias_fn}).capabilities
    assert elementwise.bias == Positions(score_mod=True) and elementwise.hooks == {"bias"}
    assert type("Nothing", (PositionalEncoding,), {}).capabilities.bias is None


@pytest.mark.parametrize(
    ("attrs", "needle"),
    [
        ({"bias_form": Offsets()}, "stated without a bias"),
        ({"bias_form": PerCall(reads=frozenset({"q"}))}, "stated without a bias"),
        ({"bias_form": Offsets(score_mod=True), "bias": _bias}, "needs bias_fn()"),
        ({"bias_form": Offsets(key_columns=True), "bias": _bias}, "needs key_position_bias()"),
        ({"bias_form": Offsets(trainable=True), "bias": _bias}, "trainable without score_mod"),
        ({"bias_form": Features(), "bias": _bias}, "needs feature_bias()"),
        ({"bias_form": PerCall(reads=frozenset({"z"})), "bias": _bias}, "reads ['z']"),
        ({"bias_form": "offsets", "bias": _bias}, "is not a form"),
        (  # an elementwise bias of positions cannot read the call's tensors
            {"bias_fn": _bias_fn, "bias": _bias, "bias_form": PerCall(reads=frozenset({"k"}))},
            "defines bias_fn(), which its bias_form",
        ),
        ({"bias": _bias, "key_position_bias": lambda self, k_pos: k_pos}, "defines key_position_bias"),
        ({"bias": _bias, "bias_offset_only": True}, "states bias_offset_only, which bias_form replaces"),
    ],
)
def test_register_rejects_stated_facts_that_contradict_the_methods(attrs, needle, registry_guard) -> None:
    cls = type("BadPE", (PositionalEncoding,), attrs)
    with pytest.raises(TypeError, match=re.escape(needle)) as info:
        register("_test_bad_pe")(cls)
    assert "BadPE" in str(info.value)
    assert "_test_bad_pe" not in ENCODINGS


def test_capabilities_are_derived_from_the_methods_never_assigned(registry_guard) -> None:
    attention = {"attention": lambda self, q, k, v, *, causal, causal_lse, layer=0, visible=None: q}
    shortcut = type("Shortcut", (AttentionShortcut, _Bias), attention)
    assert shortcut.capabilities.attention_shortcut and not _Bias.capabilities.attention_shortcut
    with pytest.raises(TypeError, match="AttentionShortcut without attention"):
        register("_test_no_attention")(type("NoAttention", (AttentionShortcut, _Bias), {}))
    rotary = {"rotary_tables": lambda *a, **k: None, "set_scaling": lambda self, s: None}
    scalable = type("Scaled", (PositionalEncoding,), rotary)
    assert scalable.capabilities.hooks == {"rotary"} and scalable.capabilities.rotary_scalable
    with pytest.raises(TypeError, match="derived from the methods it overrides"):
        type("Declares", (PositionalEncoding,), {"capabilities": Capabilities(hooks=frozenset({"bias"}))})


def test_register_rejects_what_is_not_a_positional_encoding(registry_guard) -> None:
    import torch

    for thing in (type("Plain", (), {}), torch.nn.Linear, _Bias(d_model=4, n_heads=1)):
        with pytest.raises(TypeError, match="not a subclass of posformer.pe.PositionalEncoding"):
            register("_test_not_a_pe")(thing)
    assert "_test_not_a_pe" not in ENCODINGS


def test_register_rejects_a_name_twice(registry_guard) -> None:
    with pytest.raises(RuntimeError, match="'rope' registered twice"):
        register("rope")(type("Again", (_Bias,), {}))


# ------------------------------------------------------------------------------ instance capabilities
def test_shaw_without_value_relations_has_no_value_hook() -> None:
    declared = ENCODINGS["shaw"].capabilities
    assert declared.hooks == {"bias", "value"}
    with_values = build_encoding("shaw", d_model=16, n_heads=2, value_relations=True)
    without = build_encoding("shaw", d_model=16, n_heads=2, value_relations=False)
    assert with_values.caps.hooks == {"bias", "value"}
    assert without.caps.hooks == {"bias"} and "value" not in without.caps.hooks
    assert without.caps == replace(with_values.caps, hooks=frozenset({"bias"}))  # nothing else changes


@pytest.mark.parametrize("per_layer", [False, True])
def test_kerple_bias_per_layer_follows_the_option(per_layer: bool) -> None:
    pe = build_encoding("kerple", d_model=16, n_heads=2, per_layer=per_layer)
    assert pe.caps.bias.per_layer is per_layer
    assert pe.caps.hooks == {"bias"} and isinstance(pe.caps.bias, Offsets)
