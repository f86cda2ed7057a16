"""The content and offset biases (sandwich, dpb, forget_alibi, cope): float64 formulas, x-transformers
references (same weights; skipped when x-transformers is absent), the bias forms that carry keys and
layer-input features to the bias, and bad options.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import Tensor

from posformer.errors import ConfigError
from posformer.model.attention import AttentionContext, attend
from posformer.pe import ENCODINGS, Offsets, PerCall, PositionalEncoding, build_encoding, check_class
from posformer.pe.forms import reads
from posformer.pe.probe import position_logits

H, DH = 4, 8


def _rand_params(pe: torch.nn.Module, std: float = 0.5, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


# ------------------------------------------------------------------------------ sandwich
@pytest.mark.parametrize("compress", [True, False])
def test_sandwich_equals_its_formula_in_float64(compress: bool) -> None:
    dim, base = 16, 10000.0
    pe = build_encoding("sandwich", d_model=H * DH, n_heads=H, dim=dim, compress=compress)
    q_pos, k_pos = torch.tensor([[0, 3, 50, 1000]]), torch.arange(0, 60, 7).unsqueeze(0)
    got = pe.bias(q_pos, k_pos)[0].double().numpy()  # (H, Tq, Tk)
    ref = np.zeros_like(got)
    for h in range(H):
        r = 8 * (h + 1) / H if compress else 1.0
        for a, i in enumerate(q_pos[0].tolist()):
            for b, j in enumerate(k_pos[0].tolist()):
                inner = sum(math.cos((i - j) / (r * base ** (2 * k / dim))) for k in range(1, dim // 2 + 1))
                ref[h, a, b] = inner - dim / 2
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    assert list(pe.parameters()) == []
    # 0 at distance 0, negative elsewhere, symmetric; head 1 (the smallest r) the most local
    b = pe.bias(torch.arange(20)[None], torch.arange(20)[None])[0]
    assert torch.all(b.diagonal(dim1=-2, dim2=-1).abs() < 1e-5) and torch.all(b <= 1e-5)
    torch.testing.assert_close(b, b.transpose(-1, -2))
    if compress:
        assert b[0, 10, 0] < b[-1, 10, 0]


def test_sandwich_long_inputs_take_the_per_frequency_loop() -> None:
    pe = build_encoding("sandwich", d_model=H * DH, n_heads=H)
    pos = torch.arange(300)[None]
    long = pe.bias(pos, pos)  # 300·300·4·64 entries: the loop branch
    short = pe.bias(pos[:, 280:], pos[:, 270:])  # one broadcast
    torch.testing.assert_close(long[..., 280:, 270:], short)


# ------------------------------------------------------------------------------ dpb
def _dpb_float64(pe, dist: np.ndarray) -> np.ndarray:
    """The MLP written out in float64: dist (...,) -> (..., H)."""
    x = np.sign(dist) * np.log1p(np.abs(dist)) if pe.log_distance else dist.astype(np.float64)
    h = x[..., None]
    for layer in pe.mlp:
        if isinstance(layer, torch.nn.Linear):
            h = h @ layer.weight.detach().double().numpy().T + layer.bias.detach().double().numpy()
        elif isinstance(layer, torch.nn.SiLU):
            h = h / (1 + np.exp(-h))
        else:
            raise AssertionError(layer)
    return h


@pytest.mark.parametrize("log_distance", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_dpb_equals_its_mlp_in_float64(log_distance: bool, causal: bool) -> None:
    torch.manual_seed(0)
    pe = build_encoding("dpb", d_model=H * DH, n_heads=H, causal=causal, log_distance=log_distance, depth=3)
    q_pos, k_pos = torch.tensor([[2, 9, 40]]), torch.arange(0, 45, 4).unsqueeze(0)
    dist = (q_pos[0, :, None] - k_pos[0, None, :]).numpy()
    ref = np.moveaxis(_dpb_float64(pe, dist), -1, 0)  # (H, Tq, Tk)
    got = pe.bias(q_pos, k_pos)[0]
    np.testing.assert_allclose(got.double().detach().numpy(), ref, rtol=1e-5, atol=1e-5)
    # fractional positions go through the MLP directly: same function
    frac = pe.bias(q_pos.double(), k_pos.double())[0]
    torch.testing.assert_close(frac, got)


@pytest.mark.parametrize("log_distance", [False, True])
def test_dpb_equals_x_transformers_dynamic_position_bias(log_distance: bool) -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(1)
    hidden, depth = 12, 2
    ref = xt.DynamicPositionBias(dim=hidden, heads=H, depth=depth, log_distance=log_distance)
    pe = build_encoding(
        "dpb", d_model=H * DH, n_heads=H, causal=True, hidden=hidden, depth=depth, log_distance=log_distance
    )
    ours = [m for m in pe.mlp if isinstance(m, torch.nn.Linear)]
    theirs = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    assert len(ours) == len(theirs) == depth + 1
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)
    i, j = 5, 17  # x-transformers: queries j-i … j-1 over keys 0 … j-1
    want = ref(i, j)  # (H, i, j)
    got = pe.bias(torch.arange(j - i, j)[None], torch.arange(j)[None])[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_t5_default_scale_equals_x_transformers_relative_position_bias() -> None:
    """``scale="auto"`` is x-transformers' ``RelativePositionBias(scale=dim_head ** 0.5)``, causal."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(2)
    ref = xt.RelativePositionBias(scale=DH**0.5, causal=True, num_buckets=32, max_distance=128, heads=H)
    pe = build_encoding("t5", d_model=H * DH, n_heads=H, causal=True)
    with torch.no_grad():
        pe.table.weight.copy_(ref.relative_attention_bias.weight)
    i, j = 7, 300  # offsets past max_distance: the shared last bucket
    got = pe.bias(torch.arange(j - i, j)[None], torch.arange(j)[None])[0]  # (H, i, j)
    torch.testing.assert_close(got, ref(i, j), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------ forget_alibi
def test_forget_alibi_equals_its_formula_in_float64_and_continues_from_the_cache() -> None:
    torch.manual_seed(0)
    D, T = H * DH, 9
    pe = build_encoding("forget_alibi", d_model=D, n_heads=H, causal=True, n_layers=2, scale=0.7)
    _rand_params(pe)
    x = torch.randn(2, T, D)
    feats = pe.input_features(x, layer=1)
    assert feats.shape == (2, H, T, 1) and feats.dtype == torch.float32
    pos = torch.arange(T)[None]
    got = pe.bias(pos, pos, q_feats=feats, k_feats=feats, layer=1)  # (2, H, T, T)
    lin = pe.gates[1]
    logits = x.double() @ lin.weight.double().T + lin.bias.double()  # (2, T, H)
    log_f = 0.7 * torch.nn.functional.logsigmoid(logits)
    for i in range(T):
        for j in range(i + 1):
            want = log_f[:, j + 1 : i + 1].sum(1)  # (2, H): Σ_{l=j+1}^{i} log f_l
            torch.testing.assert_close(got[:, :, i, j].double(), want, atol=1e-5, rtol=1e-5)
    # cached decoding: the new tokens' running sums continue the cached ones
    past = pe.input_features(x[:, :4], layer=1)
    torch.testing.assert_close(pe.input_features(x[:, 4:], layer=1, past=past), feats[:, :, 4:])


def test_forget_alibi_equals_x_transformers_data_dependent_alibi() -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(2)
    D = H * DH
    ref = xt.DataDependentAlibi(D, H, causal=True, bias_init=5.0, post_log_scale=0.5)
    pe = build_encoding("forget_alibi", d_model=D, n_heads=H, causal=True, scale=0.5)
    with torch.no_grad():
        pe.gates[0].weight.copy_(ref.to_forget_gates[0].weight)
        pe.gates[0].bias.copy_(ref.to_forget_gates[0].bias)
    x = torch.randn(2, 11, D)
    feats = pe.input_features(x)
    pos = torch.arange(11)[None]
    got = pe.bias(pos, pos, q_feats=feats, k_feats=feats)
    torch.testing.assert_close(got.tril(), ref(x).tril(), atol=1e-5, rtol=1e-5)  # keys j <= i


def test_forget_alibi_cache_keeps_the_features_and_reorders_them(tiny_model) -> None:
    model = tiny_model("forget_alibi", n_layers=2)
    x = torch.randint(3, 13, (3, 6))
    with torch.no_grad():
        cache = model.new_cache()
        model(x[:, :4], cache=cache)
        sc, _ = cache.layers[1]
        assert sc.feats.shape == (3, 2, 4, 1)
        before = sc.feats.clone()
        cache.reorder(torch.tensor([2, 2, 0]))
        torch.testing.assert_close(sc.feats, before[[2, 2, 0]])
        model(x[[2, 2, 0], 4:5], cache=cache)
        assert sc.feats.shape == (3, 2, 5, 1)


# ------------------------------------------------------------------------------ cope
def _cope_float64(q: Tensor, k: Tensor, emb: Tensor, max_pos: int) -> Tensor:
    """CoPE written out in float64 loops: q (H, T, Dh), k (H, T, Dh), emb (P, Dh) -> (H, T, T), causal."""
    q, k, emb = q.double(), k.double(), emb.double()
    n_heads, T, dh = q.shape
    out = torch.zeros(n_heads, T, T, dtype=torch.float64)
    for h in range(n_heads):
        for i in range(T):
            gates = [torch.sigmoid(q[h, i] @ k[h, t] / math.sqrt(dh)) for t in range(i + 1)]
            for j in range(i + 1):
                p = min(float(sum(gates[j:])), max_pos - 1)
                lo, hi = math.floor(p), math.ceil(p)
                w = p - lo
                out[h, i, j] = (1 - w) * (q[h, i] @ emb[lo]) + w * (q[h, i] @ emb[hi])
    return out


@pytest.mark.parametrize("max_pos", [4, 16])
def test_cope_equals_its_formula_in_float64(max_pos: int) -> None:
    torch.manual_seed(0)
    T = 10
    pe = build_encoding("cope", d_model=H * DH, n_heads=H, causal=True, n_layers=2, max_pos=max_pos)
    _rand_params(pe)
    q, k = torch.randn(1, H, T, DH) * 2, torch.randn(1, H, T, DH) * 2
    pos = torch.arange(T)[None]
    got = pe.bias(pos, pos, q=q, k=k, layer=1)[0]
    want = _cope_float64(q[0], k[0], pe.pos_emb[1].detach(), max_pos)
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(got.double()[:, keep], want[:, keep], atol=1e-5, rtol=1e-5)
    if max_pos == 4:  # long sequences: the positions hit the cap
        assert pe.positions(q.float(), k.float(), keep[None, None]).max() == max_pos - 1


def test_cope_equals_x_transformers_cope() -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(3)
    T, max_pos = 12, 8
    ref = xt.CoPE(dim=DH, heads=H, max_pos=max_pos)
    pe = build_encoding("cope", d_model=H * DH, n_heads=H, causal=True, max_pos=max_pos)
    with torch.no_grad():
        ref.pos_emb.copy_(torch.randn(max_pos, DH))
        pe.pos_emb[0].copy_(ref.pos_emb)
    q, k = torch.randn(2, H, T, DH), torch.randn(2, H, T, DH)
    sim = (q @ k.transpose(-1, -2)) * DH**-0.5  # x-transformers masks the logits, then calls CoPE
    sim = sim.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.finfo(sim.dtype).max)
    pos = torch.arange(T)[None]
    torch.testing.assert_close(pe.bias(pos, pos, q=q, k=k), ref(q, sim), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the contract
class _Spy(PositionalEncoding):
    """Records what the context passes to bias(); reads keys and the input."""

    bias_form = PerCall(reads=frozenset({"k", "x"}))
    seen: ClassVar[list] = []

    def input_features(self, x: Tensor, *, layer: int = 0, past: Tensor | None = None) -> Tensor:
        return x.mean(-1, keepdim=True).unsqueeze(1).expand(-1, self.n_heads, -1, -1)  # (B, H, T, 1)

    def bias(self, q_pos, k_pos, *, k=None, q_feats=None, k_feats=None, layer=0):
        type(self).seen.append(
            sorted(n for n, t in (("k", k), ("q_feats", q_feats), ("k_feats", k_feats)) if t is not None)
        )
        return q_feats - k_feats.transpose(-1, -2) + k.sum(-1, keepdim=True).transpose(-1, -2)


def test_context_passes_keys_and_features_only_when_declared() -> None:
    check_class(_Spy)
    pe = _Spy(d_model=8, n_heads=2)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    pos = torch.arange(5)[None]
    ctx = AttentionContext(pe, pos, pos, causal=True)
    with pytest.raises(RuntimeError, match="set_features"):
        attend(q, k, v, ctx)
    feats = torch.randn(1, 2, 5, 1)
    ctx.set_features(0, feats, feats)
    _Spy.seen.clear()
    attend(q, k, v, ctx)
    attend(q, k, v, ctx)  # not memoised: the bias reads the call's tensors
    assert _Spy.seen == [["k", "k_feats", "q_feats"]] * 2
    # a bias that reads nothing extra is called without them (ALiBi's signature has no k)
    alibi = AttentionContext(build_encoding("alibi", d_model=8, n_heads=2, causal=True), pos[:, :3], pos)
    assert attend(q[:, :, :3], k, v, alibi).shape == (1, 2, 3, 4)


_READS_K = PerCall(reads=frozenset({"k"}))


@pytest.mark.parametrize(
    ("attrs", "needle"),
    [
        ({"bias_form": _READS_K}, "stated without a bias"),
        ({"input_features": _Spy.input_features}, "defines input_features"),  # reads the input, no bias
        ({"bias": _Spy.bias, "bias_form": _READS_K, "input_features": _Spy.input_features}, "does not name"),
        ({"bias": _Spy.bias, "bias_form": Offsets(), "input_features": _Spy.input_features}, "does not name"),
        ({"bias": _Spy.bias, "bias_form": PerCall(reads=frozenset({"x"}))}, "needs input_features"),
        ({"bias": _Spy.bias, "bias_form": PerCall(reads=frozenset({"z"}))}, r"reads \['z'\]"),
        ({"bias": _Spy.bias, "bias_reads": frozenset({"k"})}, "states bias_reads, which bias_form replaces"),
    ],
)
def test_what_a_bias_reads_is_checked_at_registration(attrs: dict, needle: str) -> None:
    with pytest.raises(TypeError, match=needle):
        check_class(type("Bad", (PositionalEncoding,), attrs))


def test_declared_capabilities_of_the_new_pes() -> None:
    forms = {n: ENCODINGS[n].capabilities.bias for n in ("sandwich", "dpb", "forget_alibi", "cope")}
    assert isinstance(forms["sandwich"], Offsets) and isinstance(forms["dpb"], Offsets)
    assert reads(forms["forget_alibi"]) == {"x"} and ENCODINGS["forget_alibi"].causal_only
    assert reads(forms["cope"]) == {"q", "k"} and ENCODINGS["cope"].causal_only
    assert all(ENCODINGS[n].content_positions for n in ("forget_alibi", "cope"))


@pytest.mark.parametrize("name", ["forget_alibi", "cope"])
def test_position_logits_of_content_biases_are_finite(name: str) -> None:
    pe = build_encoding(name, d_model=16, n_heads=2, causal=True)
    logits = position_logits(pe, torch.arange(12)[None])
    assert logits.shape == (2, 12, 12) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("name", "options", "needle"),
    [
        ("sandwich", {"dim": 7}, "dim=7"),
        ("sandwich", {"scale": 0}, "scale=0"),
        ("dpb", {"depth": 0}, "depth=0"),
        ("dpb", {"hidden": 0}, "hidden=0"),
        ("forget_alibi", {"scale": -1.0}, "scale=-1.0"),
        ("cope", {"max_pos": 1}, "max_pos=1"),
    ],
)
def test_bad_options_are_rejected_with_the_value(name: str, options: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=rf"pe='{name}'.*{needle}"):
        build_encoding(name, d_model=16, n_heads=2, causal=True, **options)
