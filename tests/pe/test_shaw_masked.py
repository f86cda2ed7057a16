"""Shaw's region shortcut on padded and packed rows: output and every gradient equal float64.

The shortcut (``backends/shortcut.py``, :meth:`ShawRelative.attention`) takes the context's
visibility: each far region gets it as a mask of its own indices (the CPU kernel's float mask, a Flex
``BlockMask``), the band as a boolean grid. Packed documents run at the positions the model makes for
them (restarting with each document), whose distances within a document are the index distances the
shortcut uses; the reference here reads the positions. A left-padded causal query sees no key at all:
the explicit path gives it output 0, and so must the shortcut, with no NaN in any gradient. Checked
through the CPU flash kernel and through Flex traced by dynamo + AOT autograd (``aot_eager``, as in
``test_shaw_training.py``); on CUDA through compiled Flex.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.model.backends import choose, flex, shortcut
from posformer.model.context import AttentionContext
from posformer.model.positions import document_positions
from tests.flex_lowering import compiled_flex
from tests.pe.test_shaw_flex_shortcut import (
    _shaw,  # relations as large as the keys, so an error in them shows
)
from tests.pe.test_shaw_training import _assert_grads_close, _grads, _leaves

pytestmark = pytest.mark.usefixtures("fresh_compiles")  # conftest: Flex for several lengths

MASKS = ["padding", "empty-row", "documents"]


def _rows(mask: str, t: int) -> dict[str, Tensor]:
    """The context's masks for 2 rows of ``t`` tokens: row 0 left-padded by 6 and row 1 right-padded by
    9; row 0 as before and row 1 all padding; documents of 10 and t - 10 tokens, and of 3, 20, t - 23
    (one shorter than m = 4)."""
    if mask == "documents":
        seg = torch.zeros(2, t, dtype=torch.long)
        seg[0, 10:] = 1
        seg[1, 3:], seg[1, 23:] = 1, 2
        return {"segment_ids": seg}
    pad = torch.ones(2, t, dtype=torch.bool)
    pad[0, :6] = False
    if mask == "empty-row":
        pad[1] = False
    else:
        pad[1, t - 9 :] = False
    return {"key_padding_mask": pad}


def _reference(pe: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, rows: dict[str, Tensor]) -> Tensor:
    """Shaw's attention in float64 from the positions (restarting with documents) and the masks, as the
    explicit path defines it: r = clip(pos_j - pos_i, -m, m), a query that sees no key gives 0.
    (B, H, T, Dh)."""
    b, t, m = q.shape[0], q.shape[2], pe.k
    see = torch.ones(b, t, t, dtype=torch.bool)  # (B, T, T)
    if causal:
        see = see & torch.ones(t, t, dtype=torch.bool).tril()
    if "key_padding_mask" in rows:
        see = see & rows["key_padding_mask"][:, None, :]
        pos = torch.arange(t).expand(b, t)
    else:
        seg = rows["segment_ids"]
        see = see & (seg[:, :, None] == seg[:, None, :])
        pos = document_positions(seg)  # (B, T)
    r = (pos[:, None, :] - pos[:, :, None]).clamp(-m, m) + m  # (B, T, T): index of the clipped offset
    scores = q @ k.transpose(-1, -2) + torch.einsum("bhid,bijd->bhij", q, pe.ref_k[1][r])
    scores = (scores / math.sqrt(q.shape[-1])).masked_fill(~see[:, None], float("-inf"))
    empty = ~see.any(-1)[:, None, :, None]  # (B, 1, T, 1)
    probs = scores.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0)  # (B, H, T, T)
    return probs @ v + torch.einsum("bhij,bijd->bhid", probs, pe.ref_v[1][r])


def _check(causal: bool, t: int, mask: str, tol: float, device: str = "cpu", dh: int | None = None) -> None:
    """The shortcut through ``shortcut.run`` (chosen with gradients on) = :func:`_reference`, output and
    the gradients of q, k, v and both relation tables, within ``tol`` of the largest entry."""
    dh = dh or (16 if device == "cuda" else 8)  # CUDA: the least head size of Flex's GPU kernel
    pe = _shaw(causal, 4, True, d_model=4 * dh).to(device)
    rows = _rows(mask, t)
    pos = (document_positions(rows["segment_ids"]) if mask == "documents" else torch.arange(t)[None]).to(
        device
    )
    ctx = AttentionContext(
        pe, pos, pos, causal=causal, from_zero=True, **{n: x.to(device) for n, x in rows.items()}
    )
    q, k, v = _leaves(2, 4, t, dh, device)  # (B, H, T, Dh)
    assert choose(q, k, ctx, dropout_p=0.0, device_type=device) == "shortcut"
    out = shortcut.run(q, k, v, ctx, 1, 0.0)
    g_out = torch.randn(2, 4, t, dh, generator=torch.Generator().manual_seed(2)).to(device)
    got = _grads((out * g_out).sum(), [q, k, v, pe.rel_k, pe.rel_v])
    assert all(torch.isfinite(g).all() for g in got)
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    pe.ref_k = pe.rel_k.detach().cpu().double().requires_grad_()
    pe.ref_v = pe.rel_v.detach().cpu().double().requires_grad_()
    ref = _reference(pe, *leaves, causal, rows)
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    want = _grads((ref * g_out.cpu().double()).sum(), [*leaves, pe.ref_k, pe.ref_v])
    _assert_grads_close([g.cpu() for g in got], want, tol, ["q", "k", "v", "rel_k", "rel_v"])


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("t", [37, 70])  # m = 4; 70: three band blocks of 32
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_masked_shortcut_through_the_cpu_kernel(causal: bool, t: int, mask: str) -> None:
    """Through the CPU flash kernel with each region's float mask: fp32 to 1e-5 of the largest entry."""
    _check(causal, t, mask, 1e-5)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_masked_shortcut_through_traced_flex(
    causal: bool, mask: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``flex.causal_with_lse`` with each region's ``BlockMask``, traced by dynamo and AOT
    autograd as on CUDA (``aot_eager``; the CPU guard lifted as in ``test_shaw_training.py``)."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    compiled, checked = compiled_flex()  # with inductor's joint-graph check: tests/flex_lowering.py
    monkeypatch.setattr(flex, "kernel", lambda device_type, compiled_: compiled)
    via_flex = lambda device_type, policy, dh, ctx=None: functools.partial(flex.causal_with_lse, ctx=ctx)  # noqa: E731
    monkeypatch.setattr(shortcut, "causal_lse_kernel", via_flex)
    _check(causal, 37, mask, 1e-5, dh=16)  # heads of 16 as on CUDA
    assert checked, "no Flex backward was traced"


@pytest.mark.parametrize("rows", ["left-padded", "packed"])
def test_a_training_step_on_masked_rows_equals_the_explicit_path(
    tiny_model: Any, decoder_batch: Any, same_training_step: Any, rows: str
) -> None:
    """A decoder's loss and every parameter gradient with the shortcut (taken, counted) = with the
    explicit softmax, fp32 to 1e-5: left-padded rows (queries that see no key) and packed documents at
    the positions the model makes."""
    model = tiny_model("shaw", pe_options={"shortcut_min_len": 0}).train()  # k 16 < 40: all regions
    used: list[int] = []
    for pe in {m for m in model.modules() if type(m).__name__ == "ShawRelative"}:
        pe.attention = lambda *a, _o=pe.attention, **kw: (used.append(1), _o(*a, **kw))[1]
    same_training_step(model, decoder_batch(rows), "shortcut", used, "rel_v")


def test_a_training_step_of_a_padded_translation_batch_equals_the_explicit_path(
    tiny_model: Any, same_training_step: Any
) -> None:
    """An encoder-decoder with padded sources and targets (the encoder's bidirectional shortcut with key
    padding, the decoder's causal one): loss and every gradient = the explicit softmax's."""
    model = tiny_model("shaw", "encoder_decoder", pe_options={"shortcut_min_len": 0}).train()
    gen = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(0, 13, (2, 40), generator=gen), torch.randint(0, 13, (2, 33), generator=gen)
    src_mask, tgt_mask = torch.ones(2, 40, dtype=torch.bool), torch.ones(2, 33, dtype=torch.bool)
    src_mask[1, 29:], tgt_mask[0, 20:] = False, False
    used: list[int] = []
    for pe in {m for m in model.modules() if type(m).__name__ == "ShawRelative"}:
        pe.attention = lambda *a, _o=pe.attention, **kw: (used.append(1), _o(*a, **kw))[1]
    same_training_step(model, (src, tgt, src_mask, tgt_mask), "shortcut", used, "rel_v")


@pytest.mark.parametrize(
    ("causal", "grad", "least"),
    [(True, True, 256), (True, False, 256), (False, True, 384), (False, False, 256)],
    ids=["causal-train", "causal-infer", "bidirectional-train", "bidirectional-infer"],
)
def test_the_shortcut_starts_at_its_least_length(causal: bool, grad: bool, least: int) -> None:
    """Below 16 k tokens (bidirectional training: 24 k) the explicit softmax is faster, so the decision
    keeps it; ``shortcut_min_len`` sets the length (0: always), and a negative one is refused."""
    from posformer.errors import ConfigError
    from posformer.pe import build_encoding

    def chosen(pe: Any, t: int) -> str:
        pos = torch.arange(t)[None]
        ctx = AttentionContext(pe, pos, pos, causal=causal, from_zero=True)
        q = torch.zeros(1, 1, t, 8, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            return choose(q, q, ctx, dropout_p=0.0, device_type="cpu")

    pe = build_encoding("shaw", d_model=16, n_heads=2, causal=causal)  # k 16
    assert pe.min_shortcut_len(grad) == least
    assert (chosen(pe, least - 1), chosen(pe, least)) == ("explicit", "shortcut")
    pe = build_encoding("shaw", d_model=16, n_heads=2, causal=causal, shortcut_min_len=0)
    assert chosen(pe, 8) == "shortcut"
    with pytest.raises(ConfigError, match="shortcut_min_len=-1 is invalid: must be >= 0"):
        build_encoding("shaw", d_model=16, n_heads=2, causal=causal, shortcut_min_len=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("causal", "mask"),
    [(True, "documents"), (True, "empty-row"), (False, "padding")],
    ids=["causal-documents", "causal-empty-row", "bidirectional-padding"],
)
def test_cuda_masked_shortcut_through_compiled_flex(causal: bool, mask: str) -> None:
    """On CUDA, compiled Flex with each region's block mask (both regions, documents, a row of padding):
    fp32 to 1e-4 of the largest entry (three cases: each mask compiles a kernel of its own)."""
    _check(causal, 300, mask, 1e-4, "cuda", dh=16)
