"""A bias of the key alone as one more head-dim column of fused SDPA (``backends/keycol.py``).

Forgetting ALiBi's bias ``c_i - c_j`` is ``-c_j`` up to ``c_i``, a constant of the softmax row
(``caps.key_bias``), so attention is fused SDPA with ``q' = [q, √Dh]``, ``k' = [k, -c]``. Checked here
against float64 written out by hand: outputs and the gradients of q, k, v and the running sums; a
model's training step against the materialised bias; where the rule applies (float32, no padding) and
where it does not (bf16, padded or packed rows).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.model.backends import BACKENDS, choose, keycol
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.pe import ENCODINGS, build_encoding

KEY_BIAS_PES = [name for name, cls in ENCODINGS.items() if cls.capabilities.key_bias]


def test_forgetting_alibi_declares_a_key_bias() -> None:
    assert "forget_alibi" in KEY_BIAS_PES


@pytest.mark.parametrize("pe_name", KEY_BIAS_PES)
def test_the_key_bias_is_the_feature_bias_up_to_a_constant_of_the_row(pe_name: str) -> None:
    """``feature_bias(q_i, k_j) - key_bias(k_j)`` does not depend on j, so both give one softmax."""
    pe = build_encoding(pe_name, d_model=16, n_heads=2, causal=True)
    gen = torch.Generator().manual_seed(0)
    q_feat, k_feat = torch.randn(2, 2, 5, 1, generator=gen) * 30, torch.randn(2, 2, 1, 7, generator=gen) * 30
    rest = pe.feature_bias(q_feat, k_feat) - pe.key_bias(k_feat)  # (B, H, Tq, Tk)
    torch.testing.assert_close(rest, rest[..., :1].expand_as(rest), atol=1e-4, rtol=0)
    assert rest.std(-2).gt(0).all()  # the cancelled part does vary with the query (a real check)


def _forget_alibi() -> Any:
    torch.manual_seed(0)
    return build_encoding("forget_alibi", d_model=32, n_heads=2, causal=True, n_layers=1)


#: the visibility each check adds to causality: padding, packed documents, a sliding window
MASKS = ["none", "padding", "documents", "window"]


def _visible(masks: str, tq: int, tk: int) -> tuple[Tensor, dict[str, Any]]:
    """Which keys each query sees, written out by hand — (B, 1, Tq, Tk) bool for the last ``tq`` of
    ``tk`` queries of batch 2 — and the context arguments that say the same."""
    i = torch.arange(tk - tq, tk).view(-1, 1)  # (Tq, 1): the queries' indices
    j = torch.arange(tk).view(1, -1)  # (1, Tk)
    see = (j <= i).expand(2, 1, tq, tk)  # (B, 1, Tq, Tk)
    kwargs: dict[str, Any] = {}
    if masks == "padding":  # the second row's last 5 keys are padding
        pad = torch.ones(2, tk, dtype=torch.bool)
        pad[1, -5:] = False
        see, kwargs = see & pad.view(2, 1, 1, tk), {"key_padding_mask": pad}
    elif masks == "documents":  # row 0: documents of 10 and 27 tokens; row 1: 20 and 17
        seg = torch.zeros(2, tk, dtype=torch.long)
        seg[0, 10:], seg[1, 20:] = 1, 1
        see, kwargs = see & (seg[:, None, tk - tq :, None] == seg[:, None, None, :]), {"segment_ids": seg}
    elif masks == "window":  # the 6 latest keys
        from posformer.model.schedule import Span

        see, kwargs = see & (j > i - 6), {"span": Span("sliding", 6)}
    return see, kwargs


def _reference(q: Tensor, k: Tensor, v: Tensor, c_q: Tensor, c_k: Tensor, see: Tensor) -> Tensor:
    """softmax(q·k/√Dh + c_i - c_j) over the keys ``see`` (B, 1, Tq, Tk) shows, float64: (B, H, Tq, Dh)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + c_q.unsqueeze(-1) - c_k.unsqueeze(-2)
    return scores.masked_fill(~see, float("-inf")).softmax(-1) @ v


def _check_against_float64(tq: int, device: str, tol: float, masks: str = "none") -> None:
    """Outputs and the gradients of q, k, v and both sums = float64 within ``tol`` of the
    largest entry, with running sums up to 60 in size (larger than the scores, as in long sequences)."""
    pe, tk = _forget_alibi().to(device), 37
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen).to(device).requires_grad_() for n in (tq, tk, tk))
    c = (torch.rand(2, 2, tk, generator=gen) * -3).cumsum(-1).to(device).requires_grad_()  # (B, H, Tk)
    see, kwargs = _visible(masks, tq, tk)
    kwargs = {name: x.to(device) if isinstance(x, Tensor) else x for name, x in kwargs.items()}
    c_q = c[:, :, tk - tq :]
    pos = torch.arange(tk, device=device)[None]
    ctx = AttentionContext(
        pe, pos[:, tk - tq :], pos, causal=True, policy=BackendPolicy(choice="sdpa"), **kwargs
    )
    ctx.set_features(0, c_q.unsqueeze(-1), c.unsqueeze(-1))
    assert choose(q, k, ctx, dropout_p=0.0, device_type=q.device.type) == "keycol"
    out = keycol.run(q, k, v, ctx, 0, 0.0)
    g_out = torch.randn(out.shape, generator=gen).to(device)
    got = torch.autograd.grad((out * g_out).sum(), [q, k, v, c])
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, c)]
    ref = _reference(*leaves[:3], leaves[3][:, :, tk - tq :], leaves[3], see.to(device))
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    want = torch.autograd.grad((ref * g_out.double()).sum(), leaves)
    for g, w, name in zip(got, want, "qkvc", strict=True):
        err, size = (g.double() - w).abs().max().item(), w.abs().max().item()
        assert err <= tol * size + 1e-6, f"{name}: {err:.3g} vs {size:.3g}"


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("tq", [37, 2, 1], ids=["full", "two-query step", "one-query step"])
def test_keycol_equals_float64_with_gradients(tq: int, masks: str) -> None:
    """On the CPU, fp32 to 1e-5 of the largest entry: a full causal call and cached steps, alone and
    with padding, packed documents or a sliding window (the boolean mask of each query block)."""
    _check_against_float64(tq, "cpu", 1e-5, masks)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("masks", ["none", "padding", "documents"])
@pytest.mark.parametrize("tq", [37, 1], ids=["full", "one-query step"])
def test_cuda_keycol_equals_float64_with_gradients(tq: int, masks: str) -> None:
    """On CUDA (float32 under ``sdpa``, and one-query steps: where the rule sends CUDA calls), head size
    Dh + 1 = 17 through whichever SDPA kernel takes it: fp32 to 1e-4 of the largest entry."""
    _check_against_float64(tq, "cuda", 1e-4, masks)


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed"])
def test_a_training_step_through_keycol_equals_the_materialised_bias(
    rows: str, tiny_model: Any, decoder_batch: Any, same_training_step: Any, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """A forget-ALiBi model's loss and every parameter gradient (the gates' included) through the column
    (taken, counted) = through the materialised bias (``keycol`` switched off), fp32 to 1e-5: plain rows,
    left-padded rows and packed documents."""
    model = tiny_model("forget_alibi").train()
    used: list[int] = []
    monkeypatch.setitem(BACKENDS, "keycol", lambda *a: (used.append(1), keycol.run(*a))[1])
    same_training_step(model, decoder_batch(rows), "keycol", used, "gates")


def test_bf16_and_sinks_keep_the_float32_bias() -> None:
    """The column is in the keys' dtype: bf16 would keep 8 bits of the sums, so bf16 calls take the
    materialised bias; float32 takes the column with or without padding and packed rows, but not with
    sinks, whose logits would compete with the scores less the row's cancelled ``c_i``."""
    pe, t = _forget_alibi(), 8
    pos = torch.arange(t)[None]
    q = torch.randn(2, 2, t, 16)

    def chosen(q: Tensor, **masks: Tensor) -> str:
        ctx = AttentionContext(pe, pos, pos, causal=True, **masks)
        return choose(q, q, ctx, dropout_p=0.0, device_type="cpu")

    assert chosen(q) == "keycol"
    assert chosen(q.bfloat16()) == "masked"
    assert chosen(q, key_padding_mask=torch.ones(2, t, dtype=torch.bool)) == "keycol"
    assert chosen(q.bfloat16(), segment_ids=torch.zeros(2, t, dtype=torch.long)) == "masked"
    ctx = AttentionContext(pe, pos, pos, causal=True, sinks=True)
    assert choose(q, q, ctx, dropout_p=0.0, device_type="cpu") == "masked"
