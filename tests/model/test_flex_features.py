"""A bias read from the layer input runs through FlexAttention (a ``Features`` bias form): forgetting
ALiBi's ``c_i - c_j`` (:meth:`~posformer.pe.forget_alibi.ForgetGateBias.feature_bias`) as a ``score_mod``
that reads the per-token sums ``c`` as two captured (B, H, T) tensors, each indexed once.

CPU: the eager kernel equals the materialised bias (fp32, 1e-5) and — with q, k, v frozen, what the CPU
kernel's dense backward accepts — the gradient reaching the gates' sums equals a float64 reference;
through dynamo and AOT autograd as on CUDA too. ``cuda`` (``scripts/gpu_check.sh``): the compiled kernel
trains q, k, v and the gates against the float64 reference.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.model import AttentionContext
from posformer.model.backends import BackendPolicy, flex
from posformer.model.positions import document_positions
from posformer.pe import ENCODINGS, Features, PositionalEncoding, build_encoding, check_class
from posformer.pe.forms import reads
from tests.flex_lowering import compiled_flex
from tests.model.test_flex_learned import Reads

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")
CUDA = torch.cuda.is_available()
B, H, T, DH = 2, 2, 24, 8


def _ctx(masks: str, gates: Tensor, device: str = "cpu", compiled: bool = False) -> AttentionContext:
    """A causal forget_alibi context whose layer-0 features are the running sums of ``gates``' log
    sigmoid: ``gates`` (B, H, T, 1) -> c (B, H, T, 1), the graph of the PE's ``input_features``."""
    pe = build_encoding("forget_alibi", d_model=H * DH, n_heads=H, causal=True).to(device)
    pos = torch.arange(T, device=device)[None]
    kw: dict[str, Any] = {}
    if masks == "padding":
        pad = torch.ones(B, T, dtype=torch.bool, device=device)
        pad[1, -5:] = False
        kw["key_padding_mask"] = pad
    elif masks == "documents":
        seg = torch.zeros(B, T, dtype=torch.long, device=device)
        seg[0, T // 2 :], seg[1, T // 4 :], seg[1, 3 * T // 4 :] = 1, 1, 2
        kw["segment_ids"] = seg
        pos = document_positions(seg)
    policy = BackendPolicy(choice="flex", flex_compiled=compiled)
    ctx = AttentionContext(pe, pos, pos, causal=True, policy=policy, **kw)
    c = F.logsigmoid(gates).cumsum(2)  # (B, H, T, 1)
    ctx.set_features(0, c, c)  # no KV cache: the query and key features are one tensor
    return ctx


def _materialised(ctx: AttentionContext, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5 + ctx.bias(0, T, T, q, 0, k).to(q.dtype)
    keep = ctx.keep(0, T, T, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


def _inputs(device: str = "cpu", dh: int = DH) -> tuple[list[Tensor], Tensor, Tensor]:
    torch.manual_seed(0)
    qkv = [torch.randn(B, H, T, dh, device=device) for _ in range(3)]  # (B, H, T, Dh) each
    gates = torch.randn(B, H, T, 1, device=device) + 1.0  # f = σ(.) spread over (0.3, 0.95)
    return qkv, gates, torch.randn(B, H, T, dh, device=device)


def _flex_vs_float64(masks: str, kernel: Any, dh: int = DH) -> None:
    (q, k, v), gates, weight = _inputs(dh=dh)  # (B, H, T, dh)
    g_flex = gates.clone().requires_grad_()
    ctx = _ctx(masks, g_flex)
    assert flex.bias_form(ctx) == "features"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mask = flex.block_mask(ctx, T, T, B, q.device)
        out = kernel(q, k, v, score_mod=flex.score_mod(ctx, 0, B), block_mask=mask)
    (out * weight).sum().backward()
    g_ref = gates.double().requires_grad_()
    ref_ctx = _ctx(masks, g_ref)
    ref = _materialised(ref_ctx, q.double(), k.double(), v.double())
    (ref * weight.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    scale = float(g_ref.grad.abs().max())
    assert scale > 0.05, "gradients ~0 (a vacuous check)"
    # fp32 sums of <= T terms per entry: 1e-4 of the largest (seen: ~1e-6)
    torch.testing.assert_close(g_flex.grad.double(), g_ref.grad, atol=1e-4 * scale, rtol=0)


def test_the_form_is_stated_and_checked() -> None:
    form = ENCODINGS["forget_alibi"].capabilities.bias
    assert isinstance(form, Features) and reads(form) == {"x"} and not form.score_mod
    bad = type("NoFeatures", (PositionalEncoding,), {"bias_form": Features(), "bias": lambda *a, **k: None})
    with pytest.raises(TypeError, match=r"needs feature_bias\(\); .*needs input_features\(\)"):
        check_class(bad)
    assert not isinstance(ENCODINGS["alibi"].capabilities.bias, Features)


@pytest.mark.parametrize("masks", ["none", "padding", "documents"])
def test_eager_flex_equals_the_materialised_bias_and_its_gradient(masks: str) -> None:
    _flex_vs_float64(masks, flex.flex_attention)


def test_compiled_flex_returns_the_features_gradient() -> None:
    """Through dynamo and AOT autograd with dynamic shapes, as on CUDA (inductor's lowering aside, but
    its joint-graph check run: ``tests/flex_lowering.py``): the sums' gradient arrives (a captured view,
    or one tensor read twice, would lose it)."""
    torch._dynamo.reset()
    try:
        kernel, checked = compiled_flex()
        _flex_vs_float64("none", kernel, dh=16)  # as on CUDA: heads of 16, the least its kernel takes
        assert checked, "no Flex backward was traced"
    finally:
        torch._dynamo.reset()


def test_score_mod_reads_each_feature_tensor_by_one_index() -> None:
    ctx = _ctx("none", (torch.randn(B, H, T, 1) + 1.0).requires_grad_())
    mod = flex.score_mod(ctx, 0, B)
    scalars = [torch.zeros(()), torch.tensor(1), torch.tensor(1), torch.tensor(9), torch.tensor(4)]
    with Reads() as reads:
        got = mod(*scalars)
    assert len(reads.captured) == 2 and not reads.whole  # query sums, key sums: two tensors
    assert set(reads.indexed.values()) == {1}
    assert all(t._base is None and t.dim() == 3 for t in reads.captured.values())
    c = ctx.features(0)[0]
    assert torch.allclose(got, c[1, 1, 9, 0] - c[1, 1, 4, 0])


def test_cpu_auto_keeps_the_materialised_path() -> None:
    """The CPU's ``auto`` never takes Flex for a feature bias (no backward there; inference measured only
    for FIRE): CPU runs are unchanged."""
    ctx = _ctx("none", torch.randn(B, H, T, 1))
    ctx.policy = BackendPolicy(choice="auto")
    q = torch.randn(B, H, T, 16)  # (B, H, T, Dh): Dh 16, the least head size of Flex's GPU kernel
    with torch.no_grad():
        assert not flex.wanted(q, q, ctx, dropout_p=0.0, device_type="cpu")
    assert flex.wanted(q, q, ctx, dropout_p=0.0, device_type="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_compiled_flex_trains_the_gates_and_qkv() -> None:
    """Compiled Flex on CUDA, q, k, v and the gates all training, against the float64 materialised
    reference: output and every gradient to 1e-4 (fp32)."""
    torch._dynamo.reset()
    (q0, k0, v0), gates, weight = _inputs("cuda", dh=16)  # the least head size of Flex's GPU kernel
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    g = gates.clone().requires_grad_()
    ctx = _ctx("documents", g, "cuda", compiled=True)
    assert flex.wanted(q, k, ctx, dropout_p=0.0, device_type="cuda")
    out = flex.run(q, k, v, ctx, 0, 0.0)
    (out * weight).sum().backward()
    rq, rk, rv = (t.double().requires_grad_() for t in (q0, k0, v0))
    rg = gates.double().requires_grad_()
    ref = _materialised(_ctx("documents", rg, "cuda"), rq, rk, rv)
    (ref * weight.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    for got, want in ((q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad), (g.grad, rg.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
