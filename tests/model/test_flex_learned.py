"""Learned biases train through FlexAttention: the ``score_mod`` reads the PE's trainable
tensors as captured tensors, each indexed once, none 0-d, and its parameter gradients equal the
materialised path's.

CPU (default suite): the eager ``flex_attention`` (``flex_compiled=False``; it materialises the scores)
of every learned bias equals the materialised bias's attention (fp32, 1e-5), forward, and — with q, k,
v frozen, which is what the CPU kernel accepts — the PE's parameter gradients through Flex's own dense
backward equal the materialised path's; the ``score_mod`` reads each trainable tensor by one index
(counted with a ``TorchFunctionMode``); offset-only biases read the context's offset vector itself.
``cuda`` (``scripts/gpu_check.sh``): the compiled kernel's forward and parameter gradients against a
float64 materialised reference, fp32 to 1e-4, bf16 within a bound from the sums' condition.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from posformer.model import AttentionContext, attend
from posformer.model.backends import BackendPolicy, flex
from posformer.model.positions import document_positions
from posformer.pe import ENCODINGS, PositionalEncoding, Positions, build_encoding, check_class, list_encodings
from posformer.pe.forms import reads
from tests.flex_lowering import compiled_flex

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no FlexAttention")
CUDA = torch.cuda.is_available()


def _learned() -> list[str]:
    """Registered PEs with a bias and parameters (what trains through the bias)."""
    out = []
    for name in list_encodings():
        pe = build_encoding(name, d_model=16, n_heads=2, causal=True)
        if "bias" in pe.caps.hooks and not reads(pe.caps.bias) and any(True for _ in pe.parameters()):
            out.append(name)
    return out


LEARNED = _learned()
#: (mask kind, whether the bias is read from the offset vector there); documents restart positions
MASKS = ("none", "padding", "documents")


def _pe(name: str, causal: bool, heads: int = 2, dh: int = 8, device: str = "cpu") -> Any:
    torch.manual_seed(3)
    pe = build_encoding(name, d_model=heads * dh, n_heads=heads, causal=causal, n_layers=2)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # learned biases well away from ~0
    return pe.to(device)


def _ctx(
    pe: Any, causal: bool, masks: str, t: int, device: str = "cpu", compiled: bool = False
) -> AttentionContext:
    pos = torch.arange(t, device=device)[None]
    kw: dict[str, Any] = {}
    if masks == "padding":
        pad = torch.ones(2, t, dtype=torch.bool, device=device)
        pad[1, -5:] = False
        kw["key_padding_mask"] = pad
    elif masks == "documents":
        seg = torch.zeros(2, t, dtype=torch.long, device=device)
        seg[0, t // 2 :], seg[1, t // 4 :], seg[1, 3 * t // 4 :] = 1, 1, 2
        kw["segment_ids"] = seg
        pos = document_positions(seg)
    policy = BackendPolicy(choice="flex", flex_compiled=compiled)
    return AttentionContext(pe, pos, pos, causal=causal, policy=policy, **kw)


def _cases() -> list[Any]:
    out = []
    for name in LEARNED:
        for causal in (True, False):
            for masks in MASKS:
                if ENCODINGS[name].causal_only and not causal:
                    continue
                out.append(
                    pytest.param(name, causal, masks, id=f"{name}-{'causal' if causal else 'bidi'}-{masks}")
                )
    return out


def _materialised(
    pe: Any, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dtype: torch.dtype
) -> Tensor:
    """Reference: ``softmax(q·kᵀ/√d + bias, hidden keys -inf)·v`` in ``dtype`` from the PE's own ``bias()``
    (with gradients: the materialised path's bias, e.g. FIRE's MLP)."""
    tq, tk = q.shape[2], k.shape[2]
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores + ctx.bias(0, tq, tk, q, 0, k).to(dtype)
    keep = ctx.keep(0, tq, tk, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v.to(dtype)


def _flex_form(ctx: AttentionContext) -> str | None:
    return flex.bias_form(ctx)


# ---------------------------------------------------------------------- the capability
def test_every_learned_elementwise_bias_declares_it_trains_through_flex() -> None:
    """No blanket refusal left: every registered PE with parameters and an elementwise bias states
    ``trainable`` in its form, and each learned bias has a Flex form at contiguous positions."""
    assert {"t5", "kerple", "fire", "dpb"} <= set(LEARNED)
    for name in LEARNED:
        form = ENCODINGS[name].capabilities.bias
        assert form.trainable or not form.score_mod, name
        assert _flex_form(_ctx(_pe(name, True), True, "none", 8)) is not None, name


def test_the_fact_needs_a_bias_fn() -> None:
    attrs = {"bias_form": Positions(trainable=True), "bias": lambda *a, **k: None}
    with pytest.raises(TypeError, match="trainable without score_mod"):
        check_class(type("TrainableWithoutBiasFn", (PositionalEncoding,), attrs))


# ---------------------------------------------------------------------- what the score_mod reads
class Reads(TorchFunctionMode):
    """Every op of a call and its tensor arguments: which pre-existing tensors that need gradients are
    read, and how (indexed, or used whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.indexed: dict[int, int] = {}
        self.whole: dict[int, Tensor] = {}
        self.captured: dict[int, Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [x for a in args if isinstance(a, (tuple, list)) for x in a]
        for i, a in enumerate(flat):
            if isinstance(a, Tensor) and a.requires_grad and id(a) not in self.made:
                self.captured[id(a)] = a
                if func is Tensor.__getitem__ and i == 0:
                    self.indexed[id(a)] = self.indexed.get(id(a), 0) + 1
                else:
                    self.whole[id(a)] = a
        out = func(*args, **kwargs)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, Tensor):
                self.made.add(id(o))
        return out


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("name", ["t5", "kerple", "fire", "dpb"])
def test_score_mod_reads_each_trainable_tensor_by_one_index(name: str, masks: str) -> None:
    pe = _pe(name, causal=False)
    ctx = _ctx(pe, False, masks, 16)
    if _flex_form(ctx) is None:
        pytest.skip(f"{name}: no Flex form at {masks} positions (the masked path takes it)")
    mod = flex.score_mod(ctx, 0, 2)
    scalars = [torch.zeros(()), torch.tensor(1), torch.tensor(1), torch.tensor(9), torch.tensor(4)]
    with Reads() as reads:
        mod(*scalars)
    assert reads.captured, f"{name}: the score_mod reads no trainable tensor"
    assert not reads.whole, (
        f"{name}: trainable tensors used whole: {[tuple(t.shape) for t in reads.whole.values()]}"
    )
    assert set(reads.indexed.values()) == {1}, f"{name}: a trainable tensor indexed more than once"
    assert all(t.dim() >= 1 for t in reads.captured.values()), f"{name}: a 0-d trainable tensor"
    # a captured view loses its gradient under dynamo (test_compiled_flex_returns_the_parameter_gradients)
    assert all(t._base is None for t in reads.captured.values()), f"{name}: a trainable view is captured"
    if _flex_form(ctx) == "offsets":  # the offset backend's vector itself: one captured tensor
        (vec,) = reads.captured.values()
        built = ctx.offset_vector(0, torch.float32)  # (1, H, Tq + Tk - 1)
        assert torch.equal(vec, built)
        assert vec.data_ptr() == built.data_ptr() or built._base is not None  # copied only if a view


# ---------------------------------------------------------------------- CPU: forward and parameter gradients
#: the compiled cases that run by default (one per PE and form; the rest is ``slow``): T5 causal (the
#: offset vector), KERPLE bidirectional (the offset vector as a slice), FIRE packed (bias_fn), DPB padded.
#: Bidirectional FIRE (three signs' pieces) costs ~10 s eager and ~30 s compiled on a shared core: slow
#: past its first mask kind
_AOT_QUICK = {
    ("t5", True, "none"),
    ("kerple", False, "none"),
    ("fire", True, "documents"),
    ("dpb", True, "padding"),
}


def _aot_cases() -> list[Any]:
    return [
        pytest.param(*c.values, marks=() if tuple(c.values) in _AOT_QUICK else pytest.mark.slow, id=c.id)
        for c in _cases()
    ]


def _flex_and_reference(name: str, causal: bool, masks: str, kernel: Any, dh: int = 8) -> tuple[tuple, tuple]:
    """(output, parameter gradients) of Flex through ``kernel`` and of the float64 materialised path,
    heads of ``dh``."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, dh) for _ in range(3))  # frozen: the CPU kernel has no q/k/v backward
    weight = torch.randn(2, 2, 24, dh)
    grads = []
    for run in ("flex", "float64"):  # the reference: the materialised bias, all in float64
        pe = _pe(name, causal, dh=dh) if run == "flex" else _pe(name, causal, dh=dh).double()
        ctx = _ctx(pe, causal, masks, 24)
        if run == "flex" and _flex_form(ctx) is None:
            pytest.skip(f"{name}: no Flex form at {masks} positions (the masked path takes it)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if run == "flex":
                mask = flex.block_mask(ctx, 24, 24, 2, q.device)
                out = kernel(q, k, v, score_mod=flex.score_mod(ctx, 0, 2), block_mask=mask)
            else:
                out = _materialised(pe, q, k, v, ctx, torch.float64)
        (out.double() * weight.double()).sum().backward()
        missing = [n for n, p in pe.named_parameters() if p.grad is None]
        assert not missing, f"{name} ({run}): no gradient for {missing}"
        grads.append((out.detach().double(), {n: p.grad.double() for n, p in pe.named_parameters()}))
    return grads[0], grads[1]


def _assert_equal(name: str, flex_run: tuple, reference: tuple) -> None:
    (out_f, g_f), (out_m, g_m) = flex_run, reference
    torch.testing.assert_close(out_f, out_m, atol=1e-5, rtol=1e-5)
    # parameter gradients: fp32 sums of ~1k terms each, 1e-4 of the largest gradient (seen: <= 1e-5; the
    # fp32 materialised path is as far off). Not per entry: an output bias's gradient is a sum that
    # cancels to ~0 (softmax ignores a per-head constant); its rounding error is that of the terms
    scale = max(float(g.abs().max()) for g in g_m.values())
    assert scale > 0.1, f"{name}: gradients ~0 (a vacuous check)"
    assert g_f.keys() == g_m.keys()
    for n in g_m:
        torch.testing.assert_close(g_f[n], g_m[n], atol=1e-4 * scale, rtol=0, msg=f"{name}: d{n}")


def _eager_cases() -> list[Any]:
    """Every PE x direction x mask; the edit loop keeps one case per PE and mask (the rest: slow)."""
    quick = {
        ("t5", True, "none"),
        ("t5", False, "padding"),
        ("kerple", True, "documents"),
        ("fire", True, "none"),
        ("dpb", False, "none"),
    }
    return [
        pytest.param(*c.values, marks=() if tuple(c.values) in quick else pytest.mark.slow, id=c.id)
        for c in _cases()
    ]


@pytest.mark.parametrize(("name", "causal", "masks"), _eager_cases())
def test_flex_learned_bias_equals_materialised_forward_and_parameter_gradients(
    name: str, causal: bool, masks: str
) -> None:
    """Eager Flex (the ``score_mod`` of the training path) = the materialised bias's attention (fp32,
    1e-5), and the PE's parameter gradients through Flex's dense backward = the materialised path's
    (a float64 reference of it)."""
    _assert_equal(name, *_flex_and_reference(name, causal, masks, flex.flex_attention))


@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize(("name", "causal", "masks"), _aot_cases())
def test_compiled_flex_returns_the_parameter_gradients(name: str, causal: bool, masks: str) -> None:
    """Through dynamo and AOT autograd as on CUDA (``dynamic=True``; the traced joint graph runs with the
    eager kernels, so only inductor's lowering is left to the GPU, and its joint-graph check runs here:
    ``tests/flex_lowering.py``): every parameter gets its gradient, equal to the reference. A captured
    *view* loses it here (the bidirectional offset vector and FIRE's stacked slopes did, before they
    were captured as fresh tensors)."""
    torch._dynamo.reset()
    try:
        kernel, checked = compiled_flex()
        _assert_equal(name, *_flex_and_reference(name, causal, masks, kernel, dh=16))  # CUDA's least Dh
        assert checked, "no Flex backward was traced"
    finally:
        torch._dynamo.reset()


def test_inductors_joint_graph_check_catches_a_tensor_indexed_twice() -> None:
    """The control for the check above: a ``score_mod`` reading one trainable tensor at the query and at
    the key (what the GPU lowering refuses) fails on the CPU through :func:`compiled_flex`, and the
    same bias read from two tensors passes."""
    torch._dynamo.reset()
    bias = torch.randn(24, requires_grad=True)
    bias_k = bias.detach().clone().requires_grad_()
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))  # (B, H, T, Dh), frozen: the CPU kernel
    try:
        kernel, checked = compiled_flex()
        out = kernel(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i] + bias_k[j])
        out.sum().backward()
        assert checked and bias.grad is not None and bias_k.grad is not None
        torch._dynamo.reset()
        kernel, _ = compiled_flex()
        out = kernel(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i] + bias[j])
        with pytest.raises(Exception, match="multiple indexing operations on the same tensor"):
            out.sum().backward()
    finally:
        torch._dynamo.reset()


def test_sdpa_choice_still_trains_on_the_materialised_path() -> None:
    """``sdpa`` (and the CPU's ``auto``) never route a training call to Flex: same-seed runs unchanged."""
    pe = _pe("t5", True)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    pos = torch.arange(16)[None]
    for choice in ("sdpa", "auto"):
        ctx = AttentionContext(pe, pos, pos, causal=True, policy=BackendPolicy(choice=choice))
        assert not flex.wanted(q, q, ctx, dropout_p=0.0, device_type="cpu")
        attend(q, q, q, ctx).sum().backward()  # the offset path, as before


# ---------------------------------------------------------------------- CUDA: the compiled kernel
#: bf16 bound. A parameter gradient is a sum over the visible scores, g = Σ_ij ds_ij ∂b_ij/∂θ, with
#: ds = P ⊙ (dP − δ). Both runs read the same bf16 q, k, v; Flex's kernel rounds its operands to bf16
#: (unit roundoff u = 2^-8) a few times per term (P before P·V, dS before the dS·K products, the dP
#: inputs), so each term is off by at most ~C·u of its size and the sum by C·u·Σ_ij |ds_ij ∂b_ij/∂θ|:
#: the sum's condition number times u, not u alone (cancelling terms are why a plain rtol fails). C = 8
#: covers three roundings with a factor ~2.5 to spare; the condition sum S is computed exactly from
#: the float64 reference (per-score Jacobian of the bias).
BF16_U, BF16_C = 2.0**-8, 8.0


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("name", "causal", "masks"),
    [
        ("t5", True, "none"),
        ("kerple", False, "padding"),
        ("fire", True, "documents"),
        ("dpb", True, "none"),
        ("fire", False, "none"),
        ("t5", True, "documents"),
        ("kerple", True, "documents"),
    ],
)
def test_cuda_flex_parameter_gradients_equal_the_materialised_path(
    name: str, causal: bool, masks: str, dtype: torch.dtype
) -> None:
    """Compiled Flex with the PE training (q, k, v too) against the float64 materialised reference from
    the same inputs: output and every gradient, fp32 to 1e-4; bf16 within C·u·S (comment above)."""
    torch._dynamo.reset()
    pe = _pe(name, causal, dh=16, device="cuda")
    ref_pe = _pe(name, causal, dh=16, device="cuda").double()
    torch.manual_seed(0)
    base = [torch.randn(2, 2, 200, 16, device="cuda").to(dtype) for _ in range(3)]
    ctx = _ctx(pe, causal, masks, 200, "cuda", compiled=True)
    assert flex.wanted(base[0], base[1], ctx, dropout_p=0.0, device_type="cuda")
    q, k, v = (t.clone().requires_grad_() for t in base)
    out = flex.run(q, k, v, ctx, 0, 0.0)
    out.float().square().sum().backward()
    got = {n: p.grad.double() for n, p in pe.named_parameters()}
    rq, rk, rv = (t.double().requires_grad_() for t in base)
    ref_ctx = _ctx(ref_pe, causal, masks, 200, "cuda")
    ref = _materialised(ref_pe, rq, rk, rv, ref_ctx, torch.float64)
    ref.square().sum().backward()
    want = {n: p.grad for n, p in ref_pe.named_parameters()}
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        for n in want:
            torch.testing.assert_close(got[n], want[n], atol=1e-4, rtol=1e-4, msg=f"{name}: d{n}")
        return
    # bf16: every parameter entry within C·u·S_θ, S_θ = Σ_ij |ds_ij ∂b_ij/∂θ| from the reference
    ds = _score_gradients(ref_pe, ref_ctx, base)
    for n, p in ref_pe.named_parameters():
        bound = BF16_C * BF16_U * _abs_jacobian_sum(ref_pe, ref_ctx, n, p, ds) + 1e-6
        err = (got[n] - want[n]).abs()
        assert (err <= bound).all(), (
            f"{name}: d{n} off by {err.max():.3g}, bound {bound.flatten()[err.argmax()]:.3g}"
        )


def _score_gradients(pe: Any, ctx: AttentionContext, base: list[Tensor]) -> Tensor:
    """|ds| (B|1, H, Tq, Tk): the loss's gradient with respect to each score's bias, float64."""
    q, k, v = (t.double() for t in base)
    tq, tk = q.shape[2], k.shape[2]
    with torch.no_grad():
        bias = ctx.bias(0, tq, tk, q, 0, k).double()
    bias.requires_grad_()
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    keep = ctx.keep(0, tq, tk, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    (scores.softmax(-1) @ v).square().sum().backward()
    return bias.grad.abs()


class _BiasOf(torch.nn.Module):
    """The context's whole bias (B|1, H, Tq, Tk) as a module call, so a parameter can be swapped for a JVP."""

    def __init__(self, pe: Any, ctx: AttentionContext) -> None:
        super().__init__()
        self.pe, self.ctx = pe, ctx

    def forward(self) -> Tensor:
        tq, tk = self.ctx.q_pos.shape[1], self.ctx.k_pos.shape[1]
        return self.ctx.bias(0, tq, tk, None, 0).double()


def _abs_jacobian_sum(pe: Any, ctx: AttentionContext, name: str, p: Tensor, ds: Tensor) -> Tensor:
    """Σ_ij |ds_ij| |∂b_ij/∂θ_e| for every entry e of parameter ``p`` (one forward-mode JVP per entry)."""
    whole = _BiasOf(pe, ctx)
    out = torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
    for e in range(p.numel()):
        basis = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        basis[e] = 1

        def bias(value: Tensor) -> Tensor:
            return torch.func.functional_call(whole, {f"pe.{name}": value}, ())

        _, tangent = torch.func.jvp(bias, (p.detach(),), (basis.view_as(p),))
        out[e] = (ds * tangent.abs()).sum()
    return out.view_as(p)


# ---------------------------------------------------------------------- per-call costs
def test_offset_form_compiles_once_per_kind_over_many_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offset form's ``score_mod`` (a new vector and a new closure every forward) compiles as many
    graphs as ALiBi's did (tests/model/test_flex_compiles.py): counted with a backend that runs each graph as
    traced, dynamic shapes as on CUDA, for a learned bias."""
    import functools

    from torch.nn.attention.flex_attention import flex_attention

    from posformer.model import ModelConfig, build_model

    graphs = []

    def count(gm: torch.fx.GraphModule, inputs: list) -> Any:
        graphs.append(gm)
        return gm.forward

    @functools.cache
    def kernel(device_type: str, compiled: bool) -> Any:
        return torch.compile(flex_attention, backend=count, dynamic=True)

    torch._dynamo.reset()
    monkeypatch.setattr(flex, "kernel", kernel)
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=20,
        d_model=16,
        n_heads=2,
        n_layers=2,
        d_ff=32,
        dropout=0.0,
        pe="t5",
        attention_backend="flex",
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    try:
        with torch.no_grad():
            for length in (16, 24, 40, 64, 100, 128, 200, 256, 300):
                model(torch.randint(4, 20, (2, length)))
    finally:
        torch._dynamo.reset()
    assert 0 < len(graphs) <= 3, len(graphs)
