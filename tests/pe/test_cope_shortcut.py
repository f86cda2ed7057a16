"""CoPE's no-grad saturation shortcut: long evaluation without a (T, T) bias.

:meth:`ContextualPosition.attention` splits each query's keys into the band of its last ``w`` keys
(explicit CoPE) and the keys further left, whose positions are all capped when the band's gates sum to
``max_pos - 1``: ordinary causal attention from the model's ``causal_lse`` kernel, its log-sum-exp
raised by the row's constant bias. Rows that do not saturate widen the band or run over all their keys.
Every route is checked against CoPE written out in float64.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.model import AttentionContext
from posformer.model.backends import choose, flex, shortcut
from posformer.model.context import BackendPolicy
from posformer.pe import build_encoding, cope
from posformer.pe.cope import ContextualPosition

CUDA = torch.cuda.is_available()
ROUTES = {
    "cpu": shortcut.cpu_causal_lse,
    "flex": lambda q, k, v: flex.causal_with_lse(q, k, v, compiled=False),
}


pytestmark = pytest.mark.usefixtures("fresh_compiles")  # conftest: Flex for many lengths


@pytest.fixture(autouse=True)
def _saturation_at_every_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the saturation shortcut itself, at lengths where the CPU would take the exact
    function instead (``cope.SATURATION_MIN_LEN``; that choice: ``test_cope_training.py``)."""
    monkeypatch.setattr(cope, "SATURATION_MIN_LEN", 0)


def _cope(max_pos: int = 4, n_heads: int = 4, head_dim: int = 8) -> ContextualPosition:
    torch.manual_seed(1)
    pe = build_encoding(
        "cope", d_model=n_heads * head_dim, n_heads=n_heads, causal=True, n_layers=2, max_pos=max_pos
    )
    with torch.no_grad():
        pe.pos_emb.normal_()
    return pe


def _reference(pe: ContextualPosition, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    """Causal CoPE attention in float64 from its definition (module docstring): (B, H, T, Dh)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    t, dh = q.shape[2], q.shape[-1]
    hidden = torch.ones(t, t, dtype=torch.bool).triu(1)
    logits = q64 @ k64.transpose(-1, -2) / math.sqrt(dh)  # (B, H, T, T)
    gates = torch.sigmoid(logits).masked_fill(hidden, 0.0)
    pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=pe.max_pos - 1)
    z = q64 @ pe.pos_emb[layer].detach().double().T  # (B, H, T, max_pos)
    lo = pos.floor()
    frac = pos - lo
    bias = z.gather(-1, lo.long()) * (1 - frac) + z.gather(-1, pos.ceil().long()) * frac
    return (logits + bias).masked_fill(hidden, float("-inf")).softmax(-1) @ v64


def _qkv(b: int, h: int, t: int, dh: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    torch.manual_seed(0)
    return [torch.randn(b, h, t, dh, dtype=torch.float64).to(dtype) for _ in range(3)]


def _spied(pe: ContextualPosition, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Record the band width of every :meth:`_band` call and the row count of every :meth:`_rows` call."""
    seen: dict[str, list[int]] = {"band": [], "rows": []}
    band, rows = pe._band, pe._rows
    monkeypatch.setattr(pe, "_band", lambda q, k, v, z, w: (seen["band"].append(w), band(q, k, v, z, w))[1])
    monkeypatch.setattr(
        pe, "_rows", lambda q, k, v, r, layer: (seen["rows"].append(len(r)), rows(q, k, v, r, layer))[1]
    )
    return seen


@pytest.mark.parametrize("route", ["cpu", "flex"])
@pytest.mark.parametrize(
    "t", [3, 16, 17, 41, 300]
)  # max_pos 4 -> w = 16: band only, T = w, T = w + 1, T >> w
def test_shortcut_equals_float64_cope(t: int, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random q, k (gates around 0.5) saturate the cap 3 within the 16-key band: one band, the far keys
    through the causal kernel, no row over all its keys; fp32 to 1e-5 of float64."""
    pe = _cope()
    seen = _spied(pe, monkeypatch)
    q, k, v = _qkv(2, 4, t, 8)
    with torch.no_grad():
        got = pe.attention(q, k, v, causal=True, causal_lse=ROUTES[route], layer=1)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert seen == {"band": [min(16, t)], "rows": []}
    torch.testing.assert_close(got, _reference(pe, q, k, v, 1).float(), atol=1e-5, rtol=1e-5)


def _counting_rows(t: int, failing: Tensor) -> list[Tensor]:
    """q, k, v (1, 2, T, 8) where head 1's queries in ``failing`` (T,) bool have gates ~e^-20 on every
    key (their positions never reach the cap) and every other query has gates ~1."""
    q, k, v = _qkv(1, 2, t, 8)
    u = torch.zeros(8)
    u[0] = 1.0
    k = k * 0.1 + 10 * u  # every key along u
    q = q * 0.1 + 10 * u
    q[0, 1, failing] = q[0, 1, failing] * 0.1 - 10 * u  # against every key: q·k/√Dh ≈ -35
    return [q, k, v]


def test_rows_that_do_not_saturate_run_over_all_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few unsaturated rows (<= 2w) keep the band and are computed over all their keys; exact."""
    pe = _cope()
    seen = _spied(pe, monkeypatch)
    t = 120
    failing = torch.zeros(t, dtype=torch.bool)
    failing[[5, 40, 41, 90, 119]] = True  # row 5 is inside the first band: no far keys, nothing to fix
    q, k, v = _counting_rows(t, failing)
    with torch.no_grad():
        got = pe.attention(q, k, v, causal=True, causal_lse=ROUTES["cpu"], layer=0)
    assert seen == {"band": [16], "rows": [4]}
    torch.testing.assert_close(got, _reference(pe, q, k, v, 0).float(), atol=1e-5, rtol=1e-5)


def test_many_unsaturated_rows_widen_the_band(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than 2w failing rows past the band double it: 42 past w = 16 (> 32), then 34 past w = 32
    (<= 64), which run over all their keys."""
    pe = _cope()
    seen = _spied(pe, monkeypatch)
    t = 100
    q, k, v = _counting_rows(t, torch.arange(t) % 2 == 0)  # half the rows never saturate
    with torch.no_grad():
        got = pe.attention(q, k, v, causal=True, causal_lse=ROUTES["cpu"], layer=0)
    assert seen == {"band": [16, 32], "rows": [34]}
    torch.testing.assert_close(got, _reference(pe, q, k, v, 0).float(), atol=1e-5, rtol=1e-5)


def test_bf16_shortcut_through_flex_is_close_to_float64() -> None:
    """bf16 inputs through the Flex route: the output stays bf16 and is within a few bf16 roundings
    (u = 2^-8) of the float64 result of the same inputs (outputs are O(1) averages of unit values)."""
    pe = _cope(max_pos=16, head_dim=16)
    q, k, v = _qkv(2, 4, 200, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        got = pe.attention(q, k, v, causal=True, causal_lse=ROUTES["flex"], layer=1)
    assert got.dtype == torch.bfloat16
    err = (got.double() - _reference(pe, q, k, v, 1)).abs().max().item()
    assert err < 8 * 2.0**-8, err


def test_the_model_takes_the_shortcut_without_gradients(tiny_model: Any) -> None:
    """A CoPE model's no-grad forward runs the shortcut (the CPU flash kernel for the far keys) and gives
    the logits of its masked path (the shortcut switched off), fp32 to 1e-5; with gradients CoPE's
    training attention runs instead (``tests/pe/test_cope_training.py``), on the CPU and, with Flex for the
    backend's kernel, on CUDA."""
    model = tiny_model("cope", d_model=32, n_heads=2, n_layers=2, pe_options={"max_pos": 4})
    pes = {m for m in model.modules() if isinstance(m, ContextualPosition)}
    x = torch.randint(0, 13, (2, 70), generator=torch.Generator().manual_seed(0))  # 70 > w = 16
    model.attention_policy = BackendPolicy(off=frozenset({"shortcut"}))
    masked = model(x).detach()
    model.attention_policy = BackendPolicy()
    used = []
    for pe in pes:
        pe.attention = lambda *a, _o=pe.attention, **kw: (used.append(1), _o(*a, **kw))[1]
    with torch.no_grad():
        fused = model(x)
    assert len(used) == 2  # both layers
    torch.testing.assert_close(fused, masked, atol=1e-5, rtol=1e-5)
    pos = torch.arange(8)[None]
    pe = next(iter(pes))
    q = torch.randn(1, 2, 8, 16)
    for device_type in ("cpu", "cuda"):
        ctx = AttentionContext(pe, pos, pos, causal=True, policy=BackendPolicy())
        with torch.no_grad():
            chosen = choose(q, q, ctx, dropout_p=0.0, device_type=device_type)
        assert chosen == ("shortcut" if device_type == "cpu" or flex.available() else "masked")
        with_grad = choose(q.requires_grad_(), q, ctx, dropout_p=0.0, device_type=device_type)
        assert with_grad == chosen  # gradients on


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_model_shortcut_equals_masked_path(tiny_model: Any) -> None:
    """On CUDA (compiled Flex for the far keys) a CoPE model's no-grad logits equal its masked path's,
    fp32 to 1e-4, at a length past the band."""
    model = tiny_model("cope", d_model=32, n_heads=2, n_layers=2, pe_options={"max_pos": 4}).cuda()
    x = torch.randint(0, 13, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    masked = model(x).detach()
    with torch.no_grad():
        fused = model(x)
    torch.testing.assert_close(fused, masked, atol=1e-4, rtol=1e-4)
