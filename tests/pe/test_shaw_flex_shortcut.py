"""Shaw's no-grad region shortcut on every device.

:meth:`ShawRelative.attention` merges a causal attention over shifted keys (far left, and far right
when bidirectional) with an explicit band by their log-sum-exps. The fused causal attention is the
model's ``causal_lse`` (:func:`posformer.model.backends.shortcut.causal_lse_kernel`): the CPU flash
kernel on the CPU, compiled FlexAttention (:func:`posformer.model.backends.flex.causal_with_lse`) on
CUDA, none on CUDA under ``model.attention_backend=sdpa``. On the CPU the Flex route is passed in
eager (and once through dynamo); the CUDA tests run the compiled kernel itself.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.model import AttentionContext, attend
from posformer.model.backends import choose, flex, shortcut
from posformer.model.context import BackendPolicy
from posformer.pe import build_encoding, shaw

CUDA = torch.cuda.is_available()
#: bf16 unit roundoff (8 significant bits: a rounded value is off by at most 2^-8 of its size)
BF16_U = 2.0**-8


pytestmark = pytest.mark.usefixtures("fresh_compiles")  # conftest: Flex for many lengths


def _qkv(
    b: int, h: int, t: int, dh: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    """Three (B, H, T, Dh) tensors from seed 0."""
    torch.manual_seed(0)
    return [torch.randn(b, h, t, dh, dtype=torch.float64).to(device, dtype) for _ in range(3)]


def _causal_reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention in float64: (output (B, H, T, Dh), natural log-sum-exp (B, H, T))."""
    t = q.shape[2]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    hidden = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    return scores.softmax(-1) @ v.double(), scores.logsumexp(-1)


def _shaw_reference(pe: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, layer: int) -> Tensor:
    """The explicit path by hand in float64 (the ``bias`` and ``value`` hooks' definitions):
    softmax_j((q_i·k_j + q_i·a^K_r) / √Dh) · (v_j + a^V_r), r = clip(j - i, -k, k). (B, H, T, Dh)."""
    return _reference_with_spread(pe, q, k, v, causal, layer)[0]


def _reference_with_spread(
    pe: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, layer: int
) -> tuple[Tensor, Tensor]:
    """:func:`_shaw_reference` (B, H, T, Dh) and the values' spread under the attention,
    ``D_id = Σ_j p_ij |w_jd - o_id|`` with ``w_j = v_j + a^V_r`` (B, H, T, Dh), both float64."""
    t, m = q.shape[2], pe.k
    q64, k64, v64 = q.double(), k.double(), v.double()
    pos = torch.arange(t, device=q.device)
    r = (pos[None, :] - pos[:, None]).clamp(-m, m) + m  # (T, T): index of the clipped offset j - i
    a_k = pe.rel_k[layer].detach().double()[r]  # (T, T, Dh)
    scores = q64 @ k64.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q64, a_k)  # (B, H, T, T)
    scores = scores / math.sqrt(q.shape[-1])
    if causal:
        hidden = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(-1)  # (B, H, T, T)
    w = v64.unsqueeze(2).expand(-1, -1, t, -1, -1)  # (B, H, T, T, Dh): the value query i reads at key j
    if pe.value_relations:
        w = w + pe.rel_v[layer].detach().double()[r]
    out = torch.einsum("bhij,bhijd->bhid", probs, w)
    return out, torch.einsum("bhij,bhijd->bhid", probs, (w - out.unsqueeze(3)).abs())


def _shaw(causal: bool, m: int, value_relations: bool, d_model: int = 32, n_heads: int = 4) -> Any:
    torch.manual_seed(1)
    pe = build_encoding(
        "shaw",
        d_model=d_model,
        n_heads=n_heads,
        causal=causal,
        max_relative_position=m,
        n_layers=2,
        shortcut_min_len=0,
        value_relations=value_relations,
    )
    with torch.no_grad():  # relations as large as the keys and values, so an error in them shows
        pe.rel_k.normal_(0, 0.5)
        if value_relations:
            pe.rel_v.normal_(0, 0.5)
    return pe


#: the two routes of the fused causal attention, as the shortcut receives them (Flex eager: no CPU compile)
ROUTES = {
    "cpu": shortcut.cpu_causal_lse,
    "flex": functools.partial(flex.causal_with_lse, compiled=False),
}


def _chosen_on_cuda(pe: Any, q: Tensor, causal: bool, choice: str = "auto") -> str:
    """The backend a no-grad call of ``q`` (B, H, T, Dh) over itself at positions 0 … T-1 gets on CUDA."""
    pos = torch.arange(q.shape[2], device=q.device)[None]
    ctx = AttentionContext(pe, pos, pos, causal=causal, policy=BackendPolicy(choice=choice))
    with torch.no_grad():
        return choose(q, q, ctx, dropout_p=0.0, device_type="cuda")


def _bf16_bound(pe: Any, q: Tensor, k: Tensor, v: Tensor, spread: Tensor, layer: int) -> Tensor:
    """First-order bound (B, H, T, Dh) on a bf16 Shaw attention output's error against the float64
    reference of the same bf16 inputs, from bf16's unit roundoff u = 2^-8 (8 significant bits: a rounded
    value is off by at most 2^-8 of its size) and the sizes of the sums involved.

    Scores: s_ij is a sum over Dh products q_d·(k_d + a^K_d) / √Dh. Rounding ``a^K`` and ``k + a^K`` to
    bf16 (the shortcut's shifted keys) or the bf16 dot products (the band, the explicit path) moves it by
    at most 3u·A_i, A_i = max_j Σ_d |q_id|·(|k_jd| + max_r |a^K_rd|) / √Dh, the absolute sum's size
    (fp32 accumulation inside the kernels adds far less). A softmax moves its output, to first order, by
    Σ_j p_ij (δs_ij - s̄_i)(w_j - o_i), at most 2·max_j |δs_ij| · D_i with D_i = Σ_j p_ij |w_j - o_i| the
    values' spread (``spread``, from the float64 reference): 6u·A_i·D_i.
    Outputs: convex combinations of the values w = v + a^V, |w| ≤ W, rounded to bf16 at most four
    times along the way (probabilities before P·V, each region's normalised output, adding a^V, the
    final cast), each time by at most u·W: 4u·W. Measured on the CPU (Dh 16, T 40 and 200): both paths
    stay within 1.1u·W of the reference, 5-20% of this bound; a merge that took the log-sum-exp in base 2
    moves outputs by 0.1-0.2·W, 2-3 x this bound.
    """
    a_k = pe.rel_k[layer].detach().float().abs().amax(0)  # (Dh,)
    a_v = pe.rel_v[layer].detach().float().abs().max() if pe.value_relations else 0.0
    w = v.float().abs().max() + a_v
    sums = (q.float().abs() @ (k.float().abs() + a_k).transpose(-1, -2)).amax(-1) / math.sqrt(q.shape[-1])
    return BF16_U * (4 * w + 6 * sums.unsqueeze(-1).double() * spread)


# ------------------------------------------------------------------------ the fused causal kernel
@pytest.mark.parametrize("t", [1, 37, 130])  # one row; under one Flex block; over one (128)
def test_flex_route_equals_cpu_flash_and_float64(t: int) -> None:
    """The Flex route's output and log-sum-exp equal the CPU flash kernel's and a float64 reference's.
    Finding (torch 2.13): Flex returns the *natural* log-sum-exp (its kernels work in base 2; the public
    function multiplies by ln 2), the same unit as the CPU flash kernel: no conversion is needed."""
    q, k, v = _qkv(2, 2, t, 16)
    out, lse = flex.causal_with_lse(q, k, v, compiled=False)
    flash_out, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    ref_out, ref_lse = _causal_reference(q, k, v)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    for got, want in ((out, flash_out), (lse, flash_lse), (out, ref_out.float()), (lse, ref_lse.float())):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if t > 1:  # not base 2: log2-sum-exp = lse / ln 2 is far from it
        assert not torch.allclose(lse, (ref_lse / math.log(2)).float(), atol=1e-2)


def test_cpu_route_is_the_cpu_flash_kernel_bitwise() -> None:
    """On the CPU the shortcut gets the flash kernel Shaw always used: CPU runs stay bitwise equal."""
    q, k, v = _qkv(1, 2, 37, 8)
    for choice in ("auto", "sdpa", "flex"):
        kernel = shortcut.causal_lse_kernel("cpu", BackendPolicy(choice=choice), 8)  # any head size
        assert kernel.func is shortcut.cpu_causal_lse
    out, lse = shortcut.cpu_causal_lse(q, k, v)
    flash_out, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    assert torch.equal(out, flash_out) and torch.equal(lse, flash_lse)


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",  # dynamo traces the call (block mask, return_lse) as on CUDA, eager kernels run it
        pytest.param("inductor", marks=pytest.mark.slow),  # the real compiled CPU kernel, where torch has it
    ],
)
def test_compiled_flex_route_equals_float64(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled route (``compiled=True``: ``flex.kernel`` through ``flex.call_kernel``) for one small
    shape. torch 2.13's inductor has no CPU ``return_lse`` (it raises; ``tests/model/test_sinks.py``):
    that case skips here, and the CUDA tests below run inductor's kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    if backend == "aot_eager":
        compiled = torch.compile(flex_attention, backend="aot_eager", dynamic=True)
        monkeypatch.setattr(flex, "kernel", lambda device_type, compiled_: compiled)
    q, k, v = _qkv(1, 2, 37, 16)
    try:
        out, lse = flex.causal_with_lse(q, k, v, compiled=True)
    except Exception as exc:  # noqa: BLE001 - only the known refusal skips
        if backend == "inductor" and "return_lse" in str(exc):
            pytest.skip("inductor's CPU FlexAttention does not return the log-sum-exp in this torch")
        raise
    ref_out, ref_lse = _causal_reference(q, k, v)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ the whole shortcut
@pytest.mark.parametrize("value_relations", [True, False], ids=["values", "keys-only"])
@pytest.mark.parametrize("route", ["cpu", "flex"])
@pytest.mark.parametrize("t", [3, 4, 5, 37])  # k = 4: T < k (band only), T = k, T = k + 1, T >> k
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_shortcut_equals_float64_explicit_path(
    causal: bool, t: int, route: str, value_relations: bool
) -> None:
    """``ShawRelative.attention`` = the explicit softmax path in float64, fp32 to 1e-5, through the CPU
    flash kernel and through Flex; without value relations the same shortcut with zero value vectors."""
    pe = _shaw(causal, 4, value_relations)
    q, k, v = _qkv(2, 4, t, 8)
    with torch.no_grad():
        got = pe.attention(q, k, v, causal=causal, causal_lse=ROUTES[route], layer=1)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, _shaw_reference(pe, q, k, v, causal, 1).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_bf16_shortcut_through_flex_is_within_the_rounding_bound(causal: bool) -> None:
    """bf16 through the Flex route (eager, on the CPU): within :func:`_bf16_bound` of float64 (the bound the
    CUDA test uses), and the output stays bf16."""
    pe = _shaw(causal, 4, True, d_model=64, n_heads=4)  # the CUDA test's sizes: Dh 16, T 200
    q, k, v = _qkv(2, 4, 200, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        got = pe.attention(q, k, v, causal=causal, causal_lse=ROUTES["flex"], layer=1)
    assert got.dtype == torch.bfloat16
    ref, spread = _reference_with_spread(pe, q, k, v, causal, 1)
    err = (got.double() - ref).abs()
    assert (err <= _bf16_bound(pe, q, k, v, spread, 1)).all(), err.max()


def test_offers_attention_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU: with value relations (as before: the key term alone keeps the CPU's masked SDPA path, so CPU
    numerics are unchanged). CUDA: offered always, taken where the model has Flex to hand it: not under
    ``model.attention_backend=sdpa`` (never Flex), without FlexAttention or for heads under 16."""
    with_values, keys_only = _shaw(True, 4, True), _shaw(True, 4, False)
    assert with_values.offers_attention("cpu") and not keys_only.offers_attention("cpu")
    assert with_values.offers_attention("cuda") and keys_only.offers_attention("cuda")
    assert not with_values.offers_attention("mps")
    q = torch.randn(1, 4, 8, 16)  # (B, H, T, Dh): Dh 16, the least head size of Flex's GPU kernel
    small = torch.randn(1, 4, 8, 8)  # Dh 8: inductor refuses to lower Flex for CUDA
    for choice in ("auto", "flex"):
        if flex.available():
            for pe in (with_values, keys_only):
                assert _chosen_on_cuda(pe, q, True, choice) == "shortcut"
            assert _chosen_on_cuda(with_values, small, True, choice) == "explicit"
            assert _chosen_on_cuda(keys_only, small, True, "auto") == "masked"
    assert shortcut.causal_lse_kernel("cuda", BackendPolicy(), 8) is None
    assert shortcut.causal_lse_kernel("cuda", BackendPolicy(choice="sdpa"), 16) is None
    assert _chosen_on_cuda(with_values, q, True, "sdpa") == "explicit"
    assert _chosen_on_cuda(keys_only, q, True, "sdpa") == "masked"
    monkeypatch.setattr(flex, "available", lambda: False)  # an old torch: the explicit / masked paths
    assert shortcut.causal_lse_kernel("cuda", BackendPolicy(), 16) is None
    assert _chosen_on_cuda(with_values, q, True) == "explicit"
    assert _chosen_on_cuda(keys_only, q, True) == "masked"


# ------------------------------------------------------------------------ CUDA: the compiled kernel
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("value_relations", [True, False], ids=["values", "keys-only"])
@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])  # causal; bidirectional encoder too
def test_cuda_model_shortcut_equals_explicit_path(tiny_model: Any, kind: str, value_relations: bool) -> None:
    """On CUDA a small Shaw model's no-grad forward (the shortcut, Flex for the far regions) gives the
    explicit path's logits (the shortcut switched off: explicit softmax, or the masked bias without value
    relations),
    fp32 to 1e-4; the CUDA ``causal_lse`` itself (compiled Flex) equals float64, natural log-sum-exp."""
    # shortcut_min_len 0: at its default (16 k = 64 tokens here) these 40 tokens take the explicit path
    opts = {"max_relative_position": 4, "value_relations": value_relations, "shortcut_min_len": 0}
    model = tiny_model("shaw", kind, d_model=32, n_heads=2, n_layers=2, pe_options=opts).cuda()  # Dh 16
    pes = {m for m in model.modules() if isinstance(m, shaw.ShawRelative)}
    assert pes and all(pe.offers_attention("cuda") for pe in pes)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 13, (2, 40), generator=gen).cuda()  # 40 > 2k + 1: every region is used
    args = (x, torch.randint(0, 13, (2, 33), generator=gen).cuda()) if kind == "encoder_decoder" else (x,)
    model.attention_policy = BackendPolicy(off=frozenset({"shortcut"}))
    explicit = model(*args).detach()
    model.attention_policy = BackendPolicy()
    used = []
    for pe in pes:
        pe.attention = lambda *a, _o=pe.attention, **kw: (used.append(1), _o(*a, **kw))[1]
    with torch.no_grad():
        fused = model(*args)
    assert used  # the shortcut ran
    torch.testing.assert_close(fused, explicit, atol=1e-4, rtol=1e-4)
    q, k, v = _qkv(2, 2, 300, 16, device="cuda")
    out, lse = shortcut.causal_lse_kernel("cuda", BackendPolicy(), 16)(q, k, v)  # compiled Flex
    ref_out, ref_lse = _causal_reference(q, k, v)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cuda_bf16_shortcut_and_explicit_path_within_the_rounding_bound(causal: bool) -> None:
    """bf16 on CUDA: the shortcut (compiled Flex) and the explicit path (shortcut off) are each within
    :func:`_bf16_bound` of the float64 reference of the same bf16 inputs (so within twice it of each
    other): u = 2^-8 times the values' size, times 4 output roundings plus 12 x the score sums' size."""
    pe = _shaw(causal, 4, True, d_model=64, n_heads=4).cuda()  # Dh 16
    q, k, v = _qkv(2, 4, 200, 16, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(200, device="cuda")[None]
    assert _chosen_on_cuda(pe, q, causal) == "shortcut"
    with torch.no_grad():
        fused = pe.attention(q, k, v, causal=causal, causal_lse=flex.causal_with_lse, layer=1)
    qg = q.clone().requires_grad_()
    no_shortcut = BackendPolicy(off=frozenset({"shortcut"}))
    explicit = attend(qg, k, v, AttentionContext(pe, pos, pos, causal=causal, policy=no_shortcut), layer=1)
    explicit = explicit.detach()
    ref, spread = _reference_with_spread(pe, q, k, v, causal, 1)
    bound = _bf16_bound(pe, q, k, v, spread, 1)
    for got in (fused, explicit):
        assert got.dtype == torch.bfloat16
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), err.max()
