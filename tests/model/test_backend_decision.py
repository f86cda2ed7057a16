"""The attention backend decision, pinned: every PE x mask x positions x device x grad mode x choice.

:func:`posformer.model.backends.choose` is one ordered list of rules; this test prints what it decides
for a grid of calls and compares it with ``tests/fixtures/backend_decisions.tsv``, so any change of which
kernel runs where is a visible diff of that file (regenerate it with ``POSFORMER_UPDATE_DECISIONS=1``
and review the diff). The CUDA column is decided on the CPU (``device_type="cuda"``): the decision
reads host facts only. When the rules were collected into one function, the CPU column equalled the
old dispatcher's choice (each backend's ``applies`` tried in order) in all 1,782 cases.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posformer.model.backends import BACKENDS, CATCH_ALL, choose
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.model.positions import document_positions
from posformer.model.schedule import Span
from posformer.pe import ENCODINGS, build_encoding, list_encodings

TABLE = Path(__file__).resolve().parents[1] / "fixtures" / "backend_decisions.tsv"
T = 8
DH = 16  # head size: the least FlexAttention's GPU kernel takes (smaller heads: a test of their own)
POSITIONS = {
    "0…T-1": (torch.arange(T)[None], torch.arange(T)[None]),
    "shifted": (torch.arange(3, 3 + T)[None], torch.arange(3, 3 + T)[None]),
    "sparse": (torch.tensor([[0, 2, 3, 5, 6, 9, 10, 12]]),) * 2,
    "2-token step": (torch.arange(T)[None, -2:], torch.arange(T)[None]),
    "1-token step": (torch.arange(T)[None, -1:], torch.arange(T)[None]),
}
PADDING = torch.ones(2, T, dtype=torch.bool).index_fill_(1, torch.tensor([T - 2, T - 1]), False)
DOCUMENTS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
#: packed documents at the positions the model makes for them (restarting with each document: from_zero)
POSITIONS["restarting"] = (document_positions(DOCUMENTS),) * 2


#: per-layer schedules (model/schedule.py), in the mask column: a sliding window, chunks, learned sinks
SCHEDULED = {
    "window": {"span": Span("sliding", 3)},
    "chunks": {"span": Span("chunked", 4)},
    "sinks": {"sinks": True},
}


#: Shaw with its shortcut at any length (at T = 8 the default keeps the explicit softmax: 16 k tokens)
SHAW_ALWAYS = "shaw/shortcut_min_len=0"


def calls() -> Iterator[tuple[str, ...]]:
    """(pe, attention, positions, mask, grad, choice) for every case of the grid; then the scheduled
    layers' cases (causal, positions 0…T-1), then packed documents at restarting positions, then Shaw
    with its shortcut at any length, after the others so their rows stay where they were."""
    pes = ["none", *list_encodings()]
    yield from _grid(pes, list(POSITIONS)[:-1])
    for pe in pes:
        for mask in SCHEDULED:
            for grad in ("train", "infer"):
                for choice in ("auto", "sdpa", "flex"):
                    yield pe, "causal", "0…T-1", mask, grad, choice
    yield from _grid(pes, ["restarting"])
    yield from _grid([SHAW_ALWAYS], list(POSITIONS))


def _grid(pes: list[str], positions_kinds: list[str]) -> Iterator[tuple[str, ...]]:
    for pe in pes:
        for attention in ("causal", "bidirectional"):
            if pe in ENCODINGS and attention != "causal" and ENCODINGS[pe].causal_only:
                continue
            for positions in positions_kinds:
                for mask in ("none", "padding", "documents"):
                    if mask == "documents" and positions not in ("0…T-1", "restarting"):
                        continue
                    if positions == "restarting" and mask != "documents":
                        continue
                    for grad in ("train", "infer"):
                        for choice in ("auto", "sdpa", "flex"):
                            yield pe, attention, positions, mask, grad, choice


def decide(
    pe_name: str, attention: str, positions: str, mask: str, grad: str, choice: str, device: str
) -> str:
    # the CPU generator only: torch.manual_seed also queues a CUDA seeding with its stack trace when CUDA is
    # not initialised, two thirds of this grid's time
    torch.default_generator.manual_seed(0)
    causal = attention == "causal"
    name, _, option = pe_name.partition("/")  # "shaw/shortcut_min_len=0": one option set
    options = {option.split("=")[0]: int(option.split("=")[1])} if option else {}
    pe = (
        None
        if pe_name == "none"
        else build_encoding(name, d_model=2 * DH, n_heads=2, causal=causal, n_layers=2, **options)
    )
    q_pos, k_pos = POSITIONS[positions]
    ctx = AttentionContext(
        pe,
        q_pos,
        k_pos,
        causal=causal,
        key_padding_mask=PADDING if mask == "padding" else None,
        segment_ids=DOCUMENTS if mask == "documents" else None,
        policy=BackendPolicy(choice=choice),
        from_zero=positions == "restarting",
        **SCHEDULED.get(mask, {}),
    )
    training = grad == "train"
    q = torch.randn(2, 2, q_pos.shape[1], DH, requires_grad=training)  # (B, H, Tq, Dh)
    k = torch.randn(2, 2, T, DH, requires_grad=training)
    with torch.set_grad_enabled(training):
        try:
            return choose(q, k, ctx, dropout_p=0.0, device_type=device)
        except Exception as exc:  # noqa: BLE001 - a refusal is part of the table
            return f"refused ({type(exc).__name__})"


def table() -> str:
    head = "pe\tattention\tpositions\tmask\tgrad\tchoice\tcpu\tcuda"
    rows = [head] + ["\t".join((*c, decide(*c, "cpu"), decide(*c, "cuda"))) for c in calls()]
    return "\n".join(rows) + "\n"


def test_the_decision_table_is_pinned() -> None:
    got = table()
    if os.environ.get("POSFORMER_UPDATE_DECISIONS"):
        TABLE.write_text(got)
    want = TABLE.read_text()
    changed = [
        f"{w!r} -> {g!r}" for w, g in zip(want.splitlines(), got.splitlines()) if w != g
    ]  # the first few, readable
    assert got == want, f"{len(changed)} decisions changed, e.g. " + "; ".join(changed[:5])


def test_every_backend_is_reachable_and_catch_alls_take_the_rest() -> None:
    rows = [line.split("\t") for line in TABLE.read_text().splitlines()[1:]]
    chosen = {r[6] for r in rows} | {r[7] for r in rows}
    # remapped: only under a position map (evaluation), outside the grid (tests/model/test_position_maps.py)
    assert set(BACKENDS) - {"remapped"} <= chosen
    # a value term always has a backend: the shortcut or the explicit softmax, never another
    for r in rows:
        if r[0] == "shaw" and not r[6].startswith("refused"):
            assert r[6] in {"shortcut", "explicit"} | CATCH_ALL, r


def test_switching_a_backend_off_moves_the_call_to_the_next_rule() -> None:
    pe = build_encoding("alibi", d_model=16, n_heads=2, causal=True)
    q_pos, k_pos = POSITIONS["0…T-1"]
    q = k = torch.randn(1, 2, T, 8)
    on = AttentionContext(pe, q_pos, k_pos, causal=True)
    off = AttentionContext(pe, q_pos, k_pos, causal=True, policy=BackendPolicy(off=frozenset({"offset"})))
    assert choose(q, k, on, dropout_p=0.0, device_type="cpu") == "offset"
    assert choose(q, k, off, dropout_p=0.0, device_type="cpu") == "masked"


@pytest.mark.parametrize("name", ["nonsense", "masked", "explicit"])
def test_a_model_refuses_to_switch_off_an_unknown_backend_or_a_catch_all(name: str, tiny_model) -> None:
    model = tiny_model("alibi")
    with pytest.raises(ValueError, match=f"cannot switch attention backend '{name}' off"):
        model.attention_policy = BackendPolicy(off=frozenset({name}))


def test_heads_under_16_never_reach_flex_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor lowers FlexAttention for a GPU only for heads of at least 16 dimensions (Triton's
    ``tl.dot``); at head size 8 the pinned table's CUDA ``flex`` and ``shortcut`` (Flex for Shaw's and
    CoPE's far keys) would fail at the first call on a GPU. At Dh 8 every call of the grid keeps off Flex
    on CUDA: ``auto`` takes another backend, forced ``flex`` refuses in one line where it would have run
    Flex, and nothing else changes. The CPU kernel takes any head size: the CPU column is the pinned one."""
    pinned = {tuple(r[:6]): r[6:] for r in (line.split("\t") for line in TABLE.read_text().splitlines()[1:])}
    monkeypatch.setattr(sys.modules[__name__], "DH", 8)
    for case in calls():
        cpu, cuda = decide(*case, "cpu"), decide(*case, "cuda")
        want_cpu, want_cuda = pinned[case]
        assert cpu == want_cpu, case
        if want_cuda not in ("flex", "shortcut"):
            assert cuda == want_cuda, case
        elif case[-1] == "flex" and want_cuda == "flex":
            assert cuda == "refused (ConfigError)", case
        else:
            assert cuda not in ("flex", "shortcut") and not cuda.startswith("refused"), case
