"""A bf16 run sees the positions of a float32 run (``posformer.precision``).

CUDA trains under bf16 autocast by default, and ``trainer.precision=bf16-true`` casts a PE's own weights.
Autocast made every matmul of a PE's position arithmetic bf16 whatever dtype the code named: CoPE's gates
and counts (positions 4% off), DPB's and FIRE's MLPs over distances (bf16 keeps integers exactly only
up to 256; FIRE's training bias then differed from its evaluation bias). Each PE's position term (its
bias, rotated queries or added embedding) is compared here, for every registered PE, against the same
term computed in float32 from the same weights and inputs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

from posformer.pe import build_encoding, list_encodings
from posformer.pe.base import PositionalEncoding
from posformer.pe.cope import SATURATION_MIN_LEN, _CopeTraining
from posformer.pe.forms import reads
from posformer.precision import autocast_off, float32_call

#: past 256, where bf16 stops keeping integer distances exactly
T = 300
D, H = 64, 4
HALF = torch.bfloat16
#: PEs whose term contains a projection of content in the activation dtype, as the attention's own q·k is
#: (their positions and running sums stay float32): exempt from the autocast equality, with the reason
CONTENT_PROJECTIONS = {
    "shaw": "q·a_K, a dot product of the query with a relation embedding, like the attention scores",
    "forget_alibi": "the forget gates' Linear(D, H) of the layer input (its running sums are float32)",
}


def _pe(name: str, seed: int = 0) -> PositionalEncoding:
    """``name`` with every parameter moved off its initial value (zero-initialised MLP layers, tables)."""
    torch.manual_seed(seed)
    pe = build_encoding(name, d_model=D, n_heads=H, causal=True, n_layers=1)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe


def _inputs(dtype: torch.dtype, device: torch.device | None = None) -> dict[str, Tensor]:
    """q, k (1, H, T, Dh) and a layer input (1, T, D), bf16-representable (so both runs see one input)."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, H, T, D // H, generator=g).to(HALF).to(device, dtype) for _ in range(2))
    return {"q": q, "k": k, "x": torch.randn(1, T, D, generator=g).to(HALF).to(device, dtype)}


def _term(pe: PositionalEncoding, dtype: torch.dtype, *, grad: bool, autocast: bool) -> Tensor:
    """The PE's position term at positions 0 … T-1 on the PE's device: its bias (B, H, T, T), rotated
    queries (B, H, T, Dh) or its embedding of zeros (B, T, D)."""
    device = next((p.device for p in pe.parameters()), torch.device("cpu"))
    for buf in pe.buffers():
        device = buf.device
    pos = torch.arange(T, device=device).unsqueeze(0)  # (1, T)
    inp = _inputs(dtype, device)
    hooks = pe.caps.hooks
    with torch.set_grad_enabled(grad), torch.autocast(device.type, dtype=HALF, enabled=autocast):
        if "bias" in hooks:
            extra: dict[str, Any] = {}
            if "q" in reads(pe.caps.bias):
                extra["q"] = inp["q"]
            if "k" in reads(pe.caps.bias):
                extra["k"] = inp["k"]
            if "x" in reads(pe.caps.bias):
                extra["q_feats"] = extra["k_feats"] = pe.input_features(inp["x"])
            return pe.bias(pos, pos, **extra).detach()
        if "rotary" in hooks:
            return pe.rotate(inp["q"], pos, is_query=True).detach()
        if "embed" in hooks:
            return pe.embed(torch.zeros(1, T, D, dtype=dtype, device=device), pos).detach()
    return torch.zeros(1, device=device)


def test_exempt_pes_read_content() -> None:
    """Only a term that reads content may be exempt: a PE computed from positions alone never is."""
    for name in CONTENT_PROJECTIONS:
        assert reads(_pe(name).caps.bias) & {"q", "x"}, name


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list_encodings())
def test_position_terms_under_autocast_are_the_float32_ones(name: str, grad: bool) -> None:
    """Under bf16 autocast a PE's term is bitwise its float32 term (inputs bf16-representable in both):
    autocast reaches only the model's projections and attention kernels, never a PE's positions."""
    if name in CONTENT_PROJECTIONS:
        pytest.skip(f"{name}: {CONTENT_PROJECTIONS[name]}")
    pe = _pe(name)
    plain = _term(pe, torch.float32, grad=grad, autocast=False)
    mixed = _term(pe, torch.float32, grad=grad, autocast=True)
    assert mixed.dtype == plain.dtype
    assert torch.equal(mixed, plain), f"{name}: {(mixed.double() - plain.double()).abs().max():.3g} off"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list_encodings())
def test_cuda_position_terms_under_autocast_are_the_float32_ones(name: str, grad: bool) -> None:
    """The same on CUDA, whose autocast lists differ from the CPU's (the GPU's default run: bf16-mixed)."""
    if name in CONTENT_PROJECTIONS:
        pytest.skip(f"{name}: {CONTENT_PROJECTIONS[name]}")
    pe = _pe(name).to("cuda")
    plain = _term(pe, torch.float32, grad=grad, autocast=False)
    mixed = _term(pe, torch.float32, grad=grad, autocast=True)
    assert mixed.dtype == plain.dtype and mixed.device == plain.device
    torch.testing.assert_close(mixed, plain, rtol=1e-5, atol=1e-5)  # a bf16 step is ~4e-3 off


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list_encodings())
def test_position_terms_of_bf16_weights_are_the_float32_function_of_them(name: str, grad: bool) -> None:
    """With its weights cast to bf16 (``bf16-true``), a PE's term is the float32 term of those weights,
    cast at use: bitwise where it returns float32 (biases), within a few bf16 roundings of each entry's
    scale where it returns bf16 (rotated queries: the float32 tables cast, then products and a sum)."""
    if name in CONTENT_PROJECTIONS:
        pytest.skip(f"{name}: {CONTENT_PROJECTIONS[name]}")
    pe_half = _pe(name).to(HALF)
    pe_ref = copy.deepcopy(pe_half).float()  # the same (rounded) weights, in float32
    out = _term(pe_half, HALF, grad=grad, autocast=False)
    ref = _term(pe_ref, torch.float32, grad=grad, autocast=False)
    if out.dtype == torch.float32:
        assert torch.equal(out, ref), f"{name}: {(out.double() - ref.double()).abs().max():.3g} off"
    else:
        err = (out.double() - ref.double()).abs().max()
        assert err <= 4 * 2**-8 * ref.double().abs().max(), f"{name}: {err:.3g} off"


def test_dpb_keeps_distances_past_256_apart_under_autocast() -> None:
    """The failure the exactness above rules out, stated plainly: under bf16 autocast DPB's MLP saw the
    distances 256 and 257 as one (bf16 spacing is 2 there; 257 rounds to even), so two keys got one bias."""
    pe = _pe("dpb")
    pos = torch.arange(T).unsqueeze(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=HALF):
        bias = pe.bias(pos, pos)  # (1, H, T, T)
    last = T - 1
    assert not torch.equal(bias[0, :, last, last - 256], bias[0, :, last, last - 257])


def test_copes_training_function_under_autocast_is_its_float32_one() -> None:
    """``_CopeTraining`` under bf16 autocast returns the output and the q, k, v, embedding gradients of its
    float32 run, bitwise: its forward ran bf16 matmuls under autocast while its backward recomputed them in
    float32, so the saved log-sum-exp did not normalise the backward's probabilities."""
    inp = _inputs(HALF)
    emb = torch.randn(16, D // H, generator=torch.Generator().manual_seed(2))
    v = torch.randn(1, H, T, D // H, generator=torch.Generator().manual_seed(3)).to(HALF)
    results = []
    for autocast in (False, True):
        q, k, vv, e = (t.clone().requires_grad_() for t in (inp["q"], inp["k"], v, emb))
        with torch.autocast("cpu", dtype=HALF, enabled=autocast):
            out = _CopeTraining.apply(q, k, vv, e, 15, None)
        out.float().square().sum().backward()
        results.append((out, q.grad, k.grad, vv.grad, e.grad))
    for plain, mixed in zip(*results):
        assert torch.equal(plain, mixed)


def test_copes_shortcut_under_autocast_is_its_float32_one() -> None:
    """CoPE's no-grad shortcut (the band explicitly, the saturated keys through the fused kernel) gives the
    same output with and without bf16 autocast, for bf16 q, k, v."""
    from posformer.model.backends.shortcut import cpu_causal_lse

    assert T >= SATURATION_MIN_LEN  # the shortcut, not the exact function
    pe = build_encoding("cope", d_model=D, n_heads=H, causal=True, max_pos=4)
    inp = _inputs(HALF)
    v = torch.randn(1, H, T, D // H, generator=torch.Generator().manual_seed(3)).to(HALF)
    outs = []
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=HALF, enabled=autocast):
            outs.append(pe.attention(inp["q"], inp["k"], v, causal=True, causal_lse=cpu_causal_lse))
    assert torch.equal(outs[0], outs[1])


def test_float32_call_upcasts_half_weights_and_leaves_float32_ones() -> None:
    """The helper: a bf16 MLP runs as the float32 MLP of its (rounded) weights, gradients reach the bf16
    weights; a float32 MLP is called as it is; autocast is off inside only."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.SiLU(), torch.nn.Linear(8, 2))
    x = torch.arange(250, 270, dtype=torch.float32).unsqueeze(-1)  # distances past bf16's exact 256
    ref = mlp(x)
    with torch.autocast("cpu", dtype=HALF):
        assert torch.equal(float32_call(mlp, x), ref)
        assert torch.is_autocast_enabled("cpu")  # restored on exit
    half = copy.deepcopy(mlp).to(HALF)
    out = float32_call(half, x)
    assert out.dtype == torch.float32
    assert torch.equal(out, copy.deepcopy(half).float()(x))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == HALF for p in half.parameters())
    with autocast_off(torch.device("meta")):  # a device type without autocast: a null context
        pass
