"""CoPE trains through its own attention on the CPU and CUDA: ``cope._CopeTraining``.

The function computes ``q·k`` once per block of query rows for both the gates and the logits, keeps
no (T, T) tensor between forward and backward, and writes the gradients by hand. Checked against CoPE
written out in float64 and differentiated by autograd: outputs and the gradients of q, k, v and the
position embeddings, with positions below and at the cap, in one and in several row blocks; with
padding (queries that see no key included) and packed documents, whose hidden keys count no gate; a
model's training step against the masked path, on plain, left-padded and packed rows; where the
decision sends it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.model.backends import choose, shortcut
from posformer.model.context import AttentionContext
from posformer.model.positions import document_positions
from posformer.pe import build_encoding, cope
from tests.pe.test_shaw_masked import MASKS, _rows  # padding, an all-padding row, documents


def _cope(max_pos: int) -> Any:
    torch.manual_seed(1)
    pe = build_encoding("cope", d_model=32, n_heads=4, causal=True, n_layers=2, max_pos=max_pos)
    with torch.no_grad():  # embeddings as large as the scores, so an error in their terms shows
        pe.pos_emb.normal_(0, 1.0)
    return pe


def _reference(q: Tensor, k: Tensor, v: Tensor, emb: Tensor, cap: int, see: Tensor | None = None) -> Tensor:
    """CoPE's attention in float64 from its definition, over causal keys that ``see`` (B, 1, T, T) also
    shows (a query that sees none gives 0): (B, H, T, Dh)."""
    t = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if see is not None:
        visible = visible & see  # (B, 1, T, T)
    empty = ~visible.any(-1, keepdim=True)
    gates = torch.sigmoid(scores) * visible
    pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=cap)  # p_ij = min(Σ_{t=j}^{i} g_it, cap)
    z = q @ emb.T  # (B, H, T, max_pos)
    lo = pos.floor()
    w = pos - lo
    bias = z.gather(-1, lo.long()) * (1 - w) + z.gather(-1, pos.ceil().long()) * w
    logits = (scores + bias).masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    return logits.softmax(-1).masked_fill(empty, 0.0) @ v


@pytest.mark.parametrize("block_rows", [None, 5], ids=["one block", "blocks of 5 rows"])
@pytest.mark.parametrize("max_pos", [4, 64], ids=["capped", "below the cap"])
def test_training_attention_equals_float64(max_pos: int, block_rows: int | None, monkeypatch) -> None:
    """Output and the gradients of q, k, v and the embeddings = float64 autograd, fp32 to 1e-5 of the
    largest entry. ``max_pos`` 4 over 37 keys: most positions hit the cap (its gradient stops there);
    64: none does. Blocks of 5 rows: the row loop and the keys each block reads."""
    _check_against_float64("cpu", max_pos, block_rows, monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_rows", [None, 5], ids=["one block", "blocks of 5 rows"])
def test_cuda_training_attention_equals_float64(block_rows: int | None, monkeypatch) -> None:
    """The same on CUDA, which trains CoPE through it (its own row budget), called
    under bf16 autocast as CUDA trains: the function keeps float32 inside, so the bound stays 1e-5."""
    _check_against_float64("cuda", 4, block_rows, monkeypatch, autocast=True)


def _check_against_float64(
    device: str, max_pos: int, block_rows: int | None, monkeypatch, autocast: bool = False
) -> None:
    if block_rows is not None:  # both budgets: the CPU's and the other devices'
        for budget in ("TRAIN_BLOCK_ELEMENTS", "DEVICE_TRAIN_BLOCK_ELEMENTS"):
            monkeypatch.setattr(cope, budget, block_rows * 2 * 4 * 37)  # B·H·T per row
    pe = _cope(max_pos).to(device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 8, generator=gen).to(device).requires_grad_() for _ in range(3))
    if block_rows is not None:
        assert len(cope._row_blocks(q)) == 8  # 37 rows in blocks of 5
    with torch.autocast(q.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = pe.attention(q, k, v, causal=True, causal_lse=shortcut.cpu_causal_lse, layer=1)
    assert out.dtype == torch.float32
    g_out = torch.randn(out.shape, generator=gen).to(device)
    got = torch.autograd.grad((out * g_out).sum(), [q, k, v, pe.pos_emb])
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, pe.pos_emb)]
    ref = _reference(*leaves[:3], leaves[3][1], max_pos - 1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad((ref * g_out.double()).sum(), leaves)
    for g, w, name in zip(got, want, ["q", "k", "v", "pos_emb"], strict=True):
        err, size = (g.double() - w).abs().max().item(), w.abs().max().item()
        assert err <= 1e-5 * size + 1e-6, f"{name}: {err:.3g} vs {size:.3g}"
    assert got[3][0].abs().max() == 0  # layer 0's embeddings get nothing from layer 1


@pytest.mark.parametrize("grad", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("mask", MASKS)
def test_masked_rows_equal_float64(mask: str, grad: bool) -> None:
    """Through ``shortcut.run`` on padded rows (one of them all padding) and packed documents: hidden
    keys count no gate; output (and, training, every gradient) = float64, fp32 to 1e-5 of the largest
    entry, no NaN. Without gradients the same function runs (the saturation shortcut takes no masks)."""
    pe, t = _cope(4), 37
    rows = _rows(mask, t)
    pos = document_positions(rows["segment_ids"]) if mask == "documents" else torch.arange(t)[None]
    ctx = AttentionContext(pe, pos, pos, causal=True, from_zero=True, **rows)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, t, 8, generator=gen).requires_grad_(grad) for _ in range(3))
    with torch.set_grad_enabled(grad):
        assert choose(q, k, ctx, dropout_p=0.0, device_type="cpu") == "shortcut"
        out = shortcut.run(q, k, v, ctx, 1, 0.0)
    if "segment_ids" in rows:
        see = (rows["segment_ids"][:, :, None] == rows["segment_ids"][:, None, :]).unsqueeze(1)
    else:
        see = rows["key_padding_mask"][:, None, None, :].expand(2, 1, t, t)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, pe.pos_emb)]
    ref = _reference(*leaves[:3], leaves[3][1], 3, see)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    g_out = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad((out * g_out).sum(), [q, k, v, pe.pos_emb])
    want = torch.autograd.grad((ref * g_out.double()).sum(), leaves)
    for g, w, name in zip(got, want, ["q", "k", "v", "pos_emb"], strict=True):
        assert torch.isfinite(g).all(), name
        err, size = (g.double() - w).abs().max().item(), w.abs().max().item()
        assert err <= 1e-5 * size + 1e-6, f"{name}: {err:.3g} vs {size:.3g}"


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed"])
def test_a_training_step_through_it_equals_the_masked_path(
    tiny_model: Any, decoder_batch: Any, same_training_step: Any, rows: str
) -> None:
    """A CoPE model's loss and every parameter gradient through ``_CopeTraining`` (taken with gradients
    on, counted) = through the masked path (the shortcut switched off), fp32 to 1e-5: plain rows,
    left-padded rows and packed documents."""
    model = tiny_model("cope").train()
    used: list[int] = []
    pe = next(m for m in model.modules() if isinstance(m, cope.ContextualPosition))
    pe.attention = lambda *a, _o=pe.attention, **kw: (used.append(1), _o(*a, **kw))[1]
    same_training_step(model, decoder_batch(rows), "shortcut", used, "pos_emb")


def test_the_decision_takes_it_on_the_cpu_and_cuda() -> None:
    """With gradients, and with padded rows in either grad mode, the CPU and CUDA take it (CUDA took the
    masked path before, whose backward keeps ~26 bytes per score); CUDA with heads under 16
    (no Flex kernel for the shortcut backend's log-sum-exp) keeps the masked path."""
    pe, t = _cope(16), 8
    pos = torch.arange(t)[None]
    q = torch.randn(2, 4, t, 16, requires_grad=True)  # (B, H, T, Dh): the least Dh of Flex's GPU kernel

    def chosen(device: str, q: Tensor = q, **masks: Tensor) -> str:
        ctx = AttentionContext(pe, pos, pos, causal=True, **masks)
        return choose(q, q, ctx, dropout_p=0.0, device_type=device)

    pad = torch.ones(2, t, dtype=torch.bool)
    for device in ("cpu", "cuda"):
        assert chosen(device) == "shortcut"
        assert chosen(device, key_padding_mask=pad) == "shortcut"
        with torch.no_grad():
            assert chosen(device, key_padding_mask=pad) == "shortcut"
            assert chosen(device) == "shortcut"
    assert chosen("cuda", q[..., :8]) == "masked"
    assert chosen("cpu", q[..., :8]) == "shortcut"


def test_short_inference_takes_the_exact_function() -> None:
    """Without gradients on the CPU, below ``SATURATION_MIN_LEN`` tokens the exact function runs (it
    beats the saturation shortcut there) and equals float64; from it on, the saturation shortcut."""
    pe, t = _cope(4), 37
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, t, 8, generator=gen) for _ in range(3))
    calls: list[int] = []
    original = cope._CopeTraining.apply

    def counted(*args: Any) -> Tensor:
        calls.append(1)
        return original(*args)

    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(cope._CopeTraining, "apply", counted)
        out = pe.attention(q, k, v, causal=True, causal_lse=shortcut.cpu_causal_lse, layer=1)
        assert calls == [1] and t < cope.SATURATION_MIN_LEN
        ref = _reference(q.double(), k.double(), v.double(), pe.pos_emb[1].detach().double(), 3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        mp.setattr(cope, "SATURATION_MIN_LEN", t)
        pe.attention(q, k, v, causal=True, causal_lse=shortcut.cpu_causal_lse, layer=1)
        assert calls == [1]  # the saturation shortcut, not the function
