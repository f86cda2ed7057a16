"""A bias of the key alone as head-dim columns of fused SDPA (``backends/keycol.py``).

Forgetting ALiBi's bias ``c_i - c_j`` is ``-c_j`` up to ``c_i``, a constant of the softmax row
(``Features(key_columns=True)``), and causal ALiBi's ``-m_h·(i - j)`` is ``m_h·j`` up to ``-m_h·i``
(``Offsets(key_columns=True)``), so attention is fused SDPA with ``q' = [q, √Dh]``, ``k' = [k, g]`` (bf16:
three columns). Checked here against float64 written out by hand: outputs and the gradients of q, k, v
and the running sums, fp32 and bf16; a model's training step against the materialised bias; where the
rule applies and where it does not.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model.backends import BACKENDS, choose, keycol
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.model.positions import document_positions
from posformer.pe import ENCODINGS, build_encoding
from posformer.pe.alibi import alibi_slopes


def _methods(form: Any) -> frozenset[str]:
    """The methods a bias form names (none without a bias)."""
    return form.methods() if form is not None else frozenset()


KEY_BIAS_PES = [n for n, cls in ENCODINGS.items() if "key_bias" in _methods(cls.capabilities.bias)]


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


KEY_POSITION_PES = [n for n, c in ENCODINGS.items() if "key_position_bias" in _methods(c.capabilities.bias)]


def test_alibi_declares_a_key_position_bias() -> None:
    assert KEY_POSITION_PES == ["alibi"]


@pytest.mark.parametrize("pe_name", KEY_POSITION_PES)
def test_the_key_position_bias_is_the_causal_bias_up_to_a_constant_of_the_row(pe_name: str) -> None:
    """``bias(i, j) - key_position_bias(j)`` does not depend on the visible keys ``j <= i`` (sparse,
    batched positions), so both give one causal softmax."""
    pe = build_encoding(pe_name, d_model=32, n_heads=4, causal=True)
    pos = torch.tensor([[0, 2, 3, 7, 8, 20, 21, 50], [5, 6, 9, 10, 11, 30, 31, 32]])  # (B, T) increasing
    rest = pe.bias(pos, pos) - pe.key_position_bias(pos).unsqueeze(-2)  # (B, H, T, T)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    row = rest.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # (B, H, T, 1): the key j = i
    torch.testing.assert_close(rest.masked_fill(~causal, 0), row.expand_as(rest).masked_fill(~causal, 0))
    assert rest.diagonal(dim1=-2, dim2=-1).std(-1).gt(0).all()  # the cancelled part varies (a real check)


def _pe(name: str) -> Any:
    torch.manual_seed(0)
    return build_encoding(name, d_model=32, n_heads=2, causal=True, n_layers=1)


#: the visibility each check adds to causality: padding, packed documents, a sliding window, chunks
MASKS = ["none", "padding", "documents", "window", "chunks"]


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
    elif masks == "chunks":  # Llama 4's chunks of 8 positions (here positions = indices)
        from posformer.model.schedule import Span

        see, kwargs = see & (i // 8 == j // 8), {"span": Span("chunked", 8)}
    return see, kwargs


def _reference(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, see: Tensor) -> Tensor:
    """softmax(q·k/√Dh + bias) over the keys ``see`` (B, 1, Tq, Tk) shows, float64: (B, H, Tq, Dh)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return scores.masked_fill(~see, float("-inf")).softmax(-1) @ v


def _check_against_float64(
    tq: int, device: str, tol: float, masks: str = "none", pe_name: str = "forget_alibi", tk: int = 37
) -> None:
    """Outputs and the gradients of q, k, v (and forget-ALiBi's running sums) = float64 within ``tol`` of
    the largest entry. Forget-ALiBi's sums reach 60 in size (larger than the scores, as in long
    sequences); ALiBi's positions restart with each packed document, as the model makes them."""
    pe = _pe(pe_name).to(device)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen).to(device).requires_grad_() for n in (tq, tk, tk))
    see, kwargs = _visible(masks, tq, tk)
    kwargs = {name: x.to(device) if isinstance(x, Tensor) else x for name, x in kwargs.items()}
    pos = torch.arange(tk, device=device)[None]
    if "segment_ids" in kwargs:
        pos = document_positions(kwargs["segment_ids"])  # (B, Tk)
    decided_on = "cuda" if pe_name == "alibi" else device  # ALiBi's columns: CUDA's decision only
    ctx = AttentionContext(
        pe,
        pos[:, tk - tq :],
        pos,
        causal=True,
        policy=BackendPolicy(choice="sdpa"),
        from_zero="segment_ids" in kwargs,
        **kwargs,
    )
    leaves = [q, k, v]
    if pe_name == "forget_alibi":
        c = (torch.rand(2, 2, tk, generator=gen) * -3).cumsum(-1).to(device).requires_grad_()  # (B, H, Tk)
        ctx.set_features(0, c[:, :, tk - tq :].unsqueeze(-1), c.unsqueeze(-1))
        leaves.append(c)
    assert choose(q, k, ctx, dropout_p=0.0, device_type=decided_on) == "keycol"
    out = keycol.run(q, k, v, ctx, 0, 0.0)
    g_out = torch.randn(out.shape, generator=gen).to(device)
    got = torch.autograd.grad((out * g_out).sum(), leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    if pe_name == "forget_alibi":
        c64 = ref_leaves[3]
        bias = c64[:, :, tk - tq :].unsqueeze(-1) - c64.unsqueeze(-2)  # (B, H, Tq, Tk): c_i - c_j
    else:
        slopes = torch.tensor(alibi_slopes(2), dtype=torch.float64, device=device).view(1, -1, 1, 1)
        bias = -slopes * (pos[:, None, tk - tq :, None] - pos[:, None, None, :]).double()  # -m_h (i - j)
    ref = _reference(*ref_leaves[:3], bias, see.to(device))
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    want = torch.autograd.grad((ref * g_out.double()).sum(), ref_leaves)
    for g, w, name in zip(got, want, "qkvc"[: len(got)], strict=True):
        err, size = (g.double() - w).abs().max().item(), w.abs().max().item()
        assert err <= tol * size + 1e-6, f"{name}: {err:.3g} vs {size:.3g}"


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("tq", [37, 2, 1], ids=["full", "two-query step", "one-query step"])
def test_keycol_equals_float64_with_gradients(tq: int, masks: str) -> None:
    """On the CPU, fp32 to 1e-5 of the largest entry: a full causal call and cached steps, alone and
    with padding, packed documents, a sliding window or chunks (the boolean mask of each query block)."""
    _check_against_float64(tq, "cpu", 1e-5, masks)


@pytest.mark.parametrize("masks", MASKS)
def test_alibi_through_keycol_equals_float64_with_gradients(masks: str) -> None:
    """Causal ALiBi's key part ``m_h·j`` as the column, on the CPU, fp32 to 1e-5 of the largest entry,
    alone and with padding, packed documents (positions restarting), a sliding window or chunks."""
    _check_against_float64(37, "cpu", 1e-5, masks, pe_name="alibi")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("masks", ["none", "padding", "documents"])
@pytest.mark.parametrize("tq", [37, 1], ids=["full", "one-query step"])
def test_cuda_keycol_equals_float64_with_gradients(tq: int, masks: str) -> None:
    """On CUDA (float32 under ``sdpa``, and one-query steps: where the rule sends CUDA calls), head size
    Dh + 1 = 17 through whichever SDPA kernel takes it: fp32 to 1e-4 of the largest entry."""
    _check_against_float64(tq, "cuda", 1e-4, masks)
    if tq == 37:
        _check_against_float64(tq, "cuda", 1e-4, masks, pe_name="alibi")


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed"])
def test_a_training_step_through_keycol_equals_the_materialised_bias(
    rows: str, tiny_model: Any, decoder_batch: Any, same_training_step: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forget-ALiBi model's loss and every parameter gradient (the gates' included) through the column
    (taken, counted) = through the materialised bias (``keycol`` switched off), fp32 to 1e-5: plain rows,
    left-padded rows and packed documents."""
    model = tiny_model("forget_alibi").train()
    used: list[int] = []
    monkeypatch.setitem(BACKENDS, "keycol", lambda *a: (used.append(1), keycol.run(*a))[1])
    same_training_step(model, decoder_batch(rows), "keycol", used, "gates")


@pytest.mark.parametrize("rows", ["plain", "left-padded", "packed"])
def test_an_alibi_training_step_through_keycol_equals_the_cpus_paths(
    rows: str, tiny_model: Any, decoder_batch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Causal ALiBi through the column (each call decided as CUDA decides it under ``sdpa``) = the CPU's
    own paths (the offset vector; the masked path for packed rows, positions restarting): loss and
    every parameter gradient, fp32 to 1e-5."""
    from posformer.model import attention
    from tests.conftest import _loss_and_grads

    model = tiny_model("alibi").train()
    ref_loss, ref = _loss_and_grads(model, decoder_batch(rows), BackendPolicy())
    used: list[str] = []

    def as_cuda(q: Tensor, k: Tensor, ctx: AttentionContext, *, dropout_p: float, device_type: str) -> str:
        used.append(choose(q, k, ctx, dropout_p=dropout_p, device_type="cuda"))
        return used[-1]

    monkeypatch.setattr(attention, "choose", as_cuda)
    loss, grads = _loss_and_grads(model, decoder_batch(rows), BackendPolicy(choice="sdpa"))
    assert used and set(used) == {"keycol"}
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, grad in ref.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("pe_name", ["alibi", "forget_alibi"])
def test_bf16_columns_keep_the_key_bias_of_float32(pe_name: str) -> None:
    """:func:`_check_bf16` on the CPU (its flash kernel, float32 accumulation)."""
    _check_bf16(pe_name, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pe_name", ["alibi", "forget_alibi"])
def test_cuda_bf16_columns_keep_the_key_bias_of_float32(pe_name: str) -> None:
    """:func:`_check_bf16` on CUDA (the fused kernel nope runs, heads of 32 + 8 columns)."""
    _check_bf16(pe_name, "cuda")


def _check_bf16(pe_name: str, device: str) -> None:
    """bf16 through the three split columns = float64 (from the same bf16 q, k, v, the bias exact) within
    ``2⁻⁷·max|v|``: the output's bf16 rounding and the probabilities' before ``P·V`` are ``2⁻⁹·max|v|``
    each, times 2. Forget-ALiBi's sums get their gradient, per entry within ``8·2⁻⁸·Σ_i |dS_ij|`` of
    float64's (its bf16 products summed over the queries; ``dS`` the reference's score gradient). The
    control: one bf16 column (8 bits of ``g·√Dh``, |g| up to 256 here) is off by more than 0.25."""
    t, h, dh = 1024, 8, 32  # √32 is not a power of two; slopes up to 1/2
    torch.manual_seed(0)
    pe = build_encoding(pe_name, d_model=h * dh, n_heads=h, causal=True).to(device)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, t, dh, generator=gen).bfloat16().to(device) for _ in range(3))
    pos = torch.arange(t, device=device)[None]
    ctx = AttentionContext(pe, pos, pos, causal=True, from_zero=True, policy=BackendPolicy(choice="sdpa"))
    c = (torch.rand(1, h, t, generator=gen) * -0.5).cumsum(-1).to(device).requires_grad_()  # (B, H, T)
    if pe_name == "forget_alibi":
        ctx.set_features(0, c.unsqueeze(-1), c.unsqueeze(-1))
        bias = c.double().unsqueeze(-1) - c.double().unsqueeze(-2)  # (B, H, T, T): c_i - c_j
    else:
        slopes = torch.tensor(alibi_slopes(h), dtype=torch.float64, device=device).view(1, -1, 1, 1)
        bias = -slopes * (pos[:, None, :, None] - pos[:, None, None, :]).double()
    assert choose(q, k, ctx, dropout_p=0.0, device_type="cuda") == "keycol"  # ALiBi's: CUDA's only
    out = keycol.run(q, k, v, ctx, 0, 0.0)
    scores = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(dh) + bias).detach().requires_grad_()
    see = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    ref = scores.masked_fill(~see, float("-inf")).softmax(-1) @ v.double()
    scale = v.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2**-7 * scale
    one = torch.cat([k, keycol.key_bias(ctx, 0).unsqueeze(-1).bfloat16()], -1)  # one bf16 column
    q_one = torch.cat([q, q.new_full((1, h, t, 1), math.sqrt(dh))], -1)
    single = F.scaled_dot_product_attention(q_one, one, F.pad(v, (0, 1)), is_causal=True, scale=dh**-0.5)
    assert (single[..., :dh].double() - ref).abs().max().item() > 0.25
    if pe_name == "forget_alibi":
        g_out = torch.randn(out.shape, generator=gen).to(device)
        (got,) = torch.autograd.grad((out.float() * g_out).sum(), [c])
        (d_scores,) = torch.autograd.grad((ref * g_out.double()).sum(), [scores])  # (B, H, T, T)
        want = d_scores.sum(-1) - d_scores.sum(-2)  # c_i's row (0 up to rounding) and c_j's column
        bound = 8 * 2**-8 * d_scores.abs().sum(-2) + 1e-6
        assert ((got.double() - want).abs() <= bound).all()


def test_sinks_fp16_and_cached_alibi_steps_keep_other_paths() -> None:
    """The columns take float32 and bf16 calls with or without padding and packed rows, but not float16
    (``g·√Dh`` would leave its range at long lengths), nor sinks, whose logits would compete with the
    scores less the row's cancelled part; causal ALiBi's columns neither a cached step (they would copy
    the cache) nor any CPU call, nor bidirectional attention."""
    pe, t = _pe("forget_alibi"), 8
    pos = torch.arange(t)[None]
    q = torch.randn(2, 2, t, 16)

    def chosen(q: Tensor, pe: Any = pe, device: str = "cpu", q_pos: Tensor = pos, **kw: Any) -> str:
        ctx = AttentionContext(pe, q_pos, pos, causal=kw.pop("causal", True), **kw)
        return choose(q[:, :, : q_pos.shape[1]], q, ctx, dropout_p=0.0, device_type=device)

    assert chosen(q) == chosen(q.bfloat16()) == "keycol"
    assert chosen(q, key_padding_mask=torch.ones(2, t, dtype=torch.bool)) == "keycol"
    assert chosen(q.bfloat16(), segment_ids=torch.zeros(2, t, dtype=torch.long)) == "keycol"
    assert chosen(q.half()) == "masked"
    assert chosen(q, sinks=True) == "masked"
    alibi = _pe("alibi")
    sdpa = BackendPolicy(choice="sdpa")
    assert chosen(q, alibi) == chosen(q.bfloat16(), alibi) == "offset"  # the CPU keeps its paths
    assert chosen(q, alibi, segment_ids=torch.zeros(2, t, dtype=torch.long)) == "masked"
    for x in (q, q.bfloat16()):
        assert chosen(x, alibi, "cuda", policy=sdpa) == "keycol"
    assert chosen(q, alibi, "cuda") == "flex"  # auto: Flex first (gpu_speed.sh stage kc measures both)
    assert chosen(q, alibi, "cuda", q_pos=pos[:, -1:], policy=sdpa) == "offset"  # a cached step
    assert chosen(q.half(), alibi, "cuda", policy=sdpa) == "offset"
    assert chosen(q, _pe_bidirectional("alibi"), "cuda", policy=sdpa, causal=False) == "offset"


def _pe_bidirectional(name: str) -> Any:
    return build_encoding(name, d_model=32, n_heads=2, causal=False, n_layers=1)


def test_float32_takes_the_split_columns_where_matmuls_may_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """At torch's default matmul precision (``highest``) a float32 call adds one column (the form every
    float32 result so far was computed with); where matmuls may round to TF32 or bf16 (``high``), the
    three bf16-exact parts, and the result is still float64's to 1e-5 of the largest entry."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    g = torch.randn(1, 2, 5) * 1000
    assert keycol._columns(q, k, g)[2] == 1
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert keycol._columns(q, k, g)[2] == 8  # three parts and five zero columns
    for masks in ("none", "documents"):
        _check_against_float64(37, "cpu", 1e-5, masks, pe_name="alibi")
        _check_against_float64(37, "cpu", 1e-5, masks)
