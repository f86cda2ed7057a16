"""Shaw trains through its region shortcut: gradients equal the explicit path's.

:meth:`ShawRelative.attention` merges a fused causal attention over shifted keys with an explicit band
by their log-sum-exps, so its gradient needs the fused kernel's log-sum-exp gradient. FlexAttention
returns it; the CPU flash kernel's aten formula drops it, so
:class:`posformer.model.backends.shortcut._CpuFlashLSE` folds it into the kernel's backward (the
``D_i`` term, through one extra zero column). Every check is against float64 written out by hand. On
the CPU the Flex route runs through dynamo and AOT autograd (``aot_eager``: the traced joint graph of
the CUDA path, eager kernels, the dense backward with its ``grad_logsumexp``); the CUDA test runs
inductor's kernel.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.model.backends import flex, shortcut
from posformer.model.context import BackendPolicy
from tests.flex_lowering import compiled_flex
from tests.pe.test_shaw_flex_shortcut import _shaw  # the same relations, large enough for errors to show

CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.usefixtures("fresh_compiles")  # conftest: Flex for several lengths


def _leaves(b: int, h: int, t: int, dh: int, device: str = "cpu") -> list[Tensor]:
    """Three (B, H, T, Dh) float32 leaves that need gradients, from seed 0."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, t, dh, generator=gen).to(device).requires_grad_() for _ in range(3)]


def _causal_reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention in float64: (output (B, H, T, Dh), natural log-sum-exp (B, H, T))."""
    t = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def _grads(loss: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


def _assert_grads_close(got: list[Tensor | None], want: list[Tensor], tol: float, names: list[str]) -> None:
    """Each gradient within ``tol`` of the largest entry of its float64 reference (+ 1e-6: a gradient
    that is zero in exact arithmetic, q's for one key, is rounding noise in float32)."""
    for g, w, name in zip(got, want, names, strict=True):
        assert g is not None, name
        scale = w.abs().max().item()
        err = (g.double() - w).abs().max().item()
        assert err <= tol * scale + 1e-6, f"{name}: max error {err:.3g} vs {tol:g} x {scale:.3g} + 1e-6"


# ------------------------------------------------------------------------ the CPU kernel's gradient
@pytest.mark.parametrize("upstream", ["both", "lse", "out"])
@pytest.mark.parametrize("t", [1, 37, 130])
def test_cpu_causal_lse_returns_the_log_sum_exp_gradient(t: int, upstream: str) -> None:
    """``cpu_causal_lse``: q, k, v gradients of ``Σ g_o·out + Σ g_l·lse`` = float64, fp32 to 1e-5 of the
    largest entry, with an upstream gradient on both outputs, on the log-sum-exp alone (aten's formula
    would give zeros: it drops it) and on the output alone (aten's own backward, unchanged)."""
    q, k, v = _leaves(2, 3, t, 16)
    gen = torch.Generator().manual_seed(1)
    g_out, g_lse = torch.randn(2, 3, t, 16, generator=gen), torch.randn(2, 3, t, generator=gen)
    out, lse = shortcut.cpu_causal_lse(q, k, v)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = _causal_reference(*ref_leaves)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    terms = {"out": [(out, ref_out, g_out)], "lse": [(lse, ref_lse, g_lse)]}
    terms["both"] = terms["out"] + terms["lse"]
    loss = sum((a * g).sum() for a, _, g in terms[upstream])
    ref_loss = sum((r * g.double()).sum() for _, r, g in terms[upstream])
    needs_v = upstream != "lse"  # the log-sum-exp does not depend on v
    got = _grads(loss, [q, k, v][: 2 + needs_v])
    want = _grads(ref_loss, ref_leaves[: 2 + needs_v])
    _assert_grads_close(got, want, 1e-5, ["q", "k", "v"][: 2 + needs_v])


# ------------------------------------------------------------------------ the whole shortcut
def _shaw_reference(pe: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, layer: int) -> Tensor:
    """softmax_j((q_i·k_j + q_i·a^K_r) / √Dh) · (v_j + a^V_r), r = clip(j - i, -m, m), in float64, from
    float64 leaves (``pe``'s relations converted by the caller): (B, H, T, Dh)."""
    t, m = q.shape[2], pe.k
    pos = torch.arange(t, device=q.device)
    r = (pos[None, :] - pos[:, None]).clamp(-m, m) + m  # (T, T): index of the clipped offset j - i
    scores = q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, pe.ref_k[layer][r])
    scores = scores / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if causal:
        hidden = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(-1)
    out = probs @ v
    if pe.value_relations:
        out = out + torch.einsum("bhij,ijd->bhid", probs, pe.ref_v[layer][r])
    return out


def _check_shortcut_gradients(
    causal: bool, t: int, value_relations: bool, causal_lse: Any, tol: float, dh: int = 8
) -> None:
    """The shortcut's output and the gradients of q, k, v and the relations = float64, heads of ``dh``."""
    pe = _shaw(causal, 4, value_relations, d_model=4 * dh)
    q, k, v = _leaves(2, 4, t, dh)  # (B, H, T, Dh)
    g_out = torch.randn(2, 4, t, dh, generator=torch.Generator().manual_seed(2))
    out = pe.attention(q, k, v, causal=causal, causal_lse=causal_lse, layer=1)
    params = [pe.rel_k] + ([pe.rel_v] if value_relations else [])
    got = _grads((out * g_out).sum(), [q, k, v, *params])
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    pe.ref_k = pe.rel_k.detach().double().requires_grad_()
    pe.ref_v = pe.rel_v.detach().double().requires_grad_() if value_relations else None
    ref = _shaw_reference(pe, *leaves, causal, 1)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    want = _grads((ref * g_out.double()).sum(), [*leaves, pe.ref_k] + ([pe.ref_v] if value_relations else []))
    _assert_grads_close(got, want, tol, ["q", "k", "v", "rel_k", "rel_v"][: len(want)])


@pytest.mark.parametrize("value_relations", [True, False], ids=["values", "keys-only"])
@pytest.mark.parametrize("t", [3, 4, 5, 37, 70])  # m = 4: T < m, = m, = m + 1, >> m; 70: three blocks of 32
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_shortcut_gradients_through_the_cpu_kernel(causal: bool, t: int, value_relations: bool) -> None:
    """Through the CPU flash kernel: every gradient = float64, fp32 to 1e-5 of the largest entry (the
    padded query rows of the band's last block give no NaN either)."""
    _check_shortcut_gradients(causal, t, value_relations, shortcut.cpu_causal_lse, 1e-5)


@pytest.mark.slow  # traced through torch.compile on the CPU
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_shortcut_gradients_through_traced_flex(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``flex.causal_with_lse`` traced by dynamo and AOT autograd as on CUDA (``aot_eager``,
    dynamic shapes): Flex's own log-sum-exp gradient reaches the merge; every gradient = float64.
    torch refuses q, k, v that need gradients on the CPU up front, because inductor has no CPU backward
    template; the dense backward that ``aot_eager`` runs is device-free, so the test lifts that guard."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    compiled, checked = compiled_flex()  # with inductor's joint-graph check: tests/flex_lowering.py
    monkeypatch.setattr(flex, "kernel", lambda device_type, compiled_: compiled)
    _check_shortcut_gradients(causal, 37, True, flex.causal_with_lse, 1e-5, dh=16)  # CUDA's least Dh
    assert checked, "no Flex backward was traced"


@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])
def test_a_training_step_through_the_shortcut_equals_the_explicit_path(
    tiny_model: Any, same_training_step: Any, kind: str
) -> None:
    """A whole model's loss and every parameter's gradient with Shaw's shortcut (taken with gradients on,
    counted) = with it switched off (the explicit softmax), fp32 to 1e-5."""
    model = tiny_model("shaw", kind, pe_options={"shortcut_min_len": 0}).train()  # k 16 < 40: all regions
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 13, (2, 40), generator=gen)
    args = (x, torch.randint(0, 13, (2, 33), generator=gen)) if kind == "encoder_decoder" else (x,)
    used: list[int] = []
    for pe in {m for m in model.modules() if type(m).__name__ == "ShawRelative"}:
        pe.attention = lambda *a, _o=pe.attention, **kw: (used.append(1), _o(*a, **kw))[1]
    same_training_step(model, args, "shortcut", used, "rel_v")


# ------------------------------------------------------------------------ CUDA: inductor's kernel
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cuda_shortcut_gradients_through_compiled_flex(causal: bool) -> None:
    """On CUDA, compiled Flex (the model's ``causal_lse`` there): the shortcut's gradients of q, k, v and
    the relations = float64, fp32 to 1e-4 of the largest entry, at T 300 (Flex blocks of 128, a partial
    one)."""
    kernel = shortcut.causal_lse_kernel("cuda", BackendPolicy(), 16)
    assert kernel is not None
    pe = _shaw(causal, 4, True, d_model=64).cuda()  # 4 heads of 16, as q, k, v
    q, k, v = _leaves(2, 4, 300, 16, device="cuda")
    g_out = torch.randn(2, 4, 300, 16, generator=torch.Generator().manual_seed(2)).cuda()
    out = pe.attention(q, k, v, causal=causal, causal_lse=kernel, layer=1)
    got = _grads((out * g_out).sum(), [q, k, v, pe.rel_k, pe.rel_v])
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    pe.ref_k = pe.rel_k.detach().double().requires_grad_()
    pe.ref_v = pe.rel_v.detach().double().requires_grad_()
    ref = _shaw_reference(pe, *leaves, causal, 1)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    want = _grads((ref * g_out.double()).sum(), [*leaves, pe.ref_k, pe.ref_v])
    _assert_grads_close(got, want, 1e-4, ["q", "k", "v", "rel_k", "rel_v"])
