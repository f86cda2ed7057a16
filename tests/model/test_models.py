"""Both models with every PE: shapes and gradients, causality, padding, cached decoding, half precision."""

from __future__ import annotations

import pytest
import torch

from posformer.model.context import BackendPolicy
from posformer.pe import ENCODINGS, build_encoding, list_encodings

V = 13  # tiny_config's vocabulary
KINDS = ["decoder", "encoder_decoder"]


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, length), generator=g)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pe", list_encodings())
def test_forward_backward_shapes(tiny_model, pe: str, kind: str) -> None:
    model = tiny_model(pe, kind).train()
    logits = model(ids(2, 7)) if kind == "decoder" else model(ids(2, 9), ids(2, 7, seed=1))
    assert logits.shape == (2, 7, V)
    logits.logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # the PE's own parameters (learned tables, biases, MLPs) are trained too
    pe_params = [(n, p) for n, p in model.named_parameters() if n.startswith("pe")]
    for name, p in pe_params:
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("pe", list_encodings())
def test_decoder_only_is_causal(tiny_model, pe: str) -> None:
    model = tiny_model(pe)
    x = ids(2, 8)
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1 - 3) % (V - 3) + 3  # change the token at position 5
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-4


@pytest.mark.parametrize("pe", list_encodings())
def test_encoder_decoder_decoder_is_causal(tiny_model, pe: str) -> None:
    model = tiny_model(pe, "encoder_decoder")
    src, tgt = ids(2, 6), ids(2, 8, seed=1)
    changed = tgt.clone()
    changed[:, 4] = (changed[:, 4] + 1 - 3) % (V - 3) + 3
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-4


def right_pad(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    padded = torch.cat((x, torch.zeros(x.shape[0], n, dtype=x.dtype)), 1)  # pad id 0
    mask = torch.cat((torch.ones_like(x, dtype=torch.bool), torch.zeros(x.shape[0], n, dtype=torch.bool)), 1)
    return padded, mask


@pytest.mark.parametrize("pe", list_encodings())
def test_right_padding_does_not_change_real_outputs(tiny_model, pe: str) -> None:
    dec = tiny_model(pe)
    x = ids(1, 6)
    xp, xm = right_pad(x, 3)
    with torch.no_grad():
        torch.testing.assert_close(dec(xp, attention_mask=xm)[:, :6], dec(x), atol=1e-5, rtol=1e-5)

    encdec = tiny_model(pe, "encoder_decoder")
    src, tgt = ids(1, 5), ids(1, 4, seed=1)
    sp, sm = right_pad(src, 3)
    tp, tm = right_pad(tgt, 2)
    with torch.no_grad():
        ref = encdec(src, tgt)
        torch.testing.assert_close(encdec.encode(sp, sm)[:, :5], encdec.encode(src), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(encdec(sp, tgt, sm), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(encdec(sp, tp, sm, tm)[:, :4], ref, atol=1e-5, rtol=1e-5)


def test_padding_in_a_batch_matches_unpadded_rows(tiny_model) -> None:
    model = tiny_model("alibi")
    a, b = ids(1, 7), ids(1, 4, seed=3)
    bp, bm = right_pad(b, 3)
    batch = torch.cat((a, bp))
    mask = torch.cat((torch.ones(1, 7, dtype=torch.bool), bm))
    with torch.no_grad():
        out = model(batch, attention_mask=mask)
        torch.testing.assert_close(out[0:1], model(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1:2, :4], model(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offset", [0, 11])
@pytest.mark.parametrize("pe", list_encodings())
def test_cached_decoding_equals_full_forward_decoder_only(tiny_model, pe: str, offset: int) -> None:
    model = tiny_model(pe)
    x = ids(2, 8)
    pos = torch.arange(offset, offset + 8).unsqueeze(0)
    explicit = offset > 0
    with torch.no_grad():
        full = model(x, positions=pos if explicit else None)
        cache = model.new_cache()
        # a prefill of 3 tokens, then one token at a time
        steps = [model(x[:, :3], positions=pos[:, :3] if explicit else None, cache=cache)]
        for t in range(3, 8):
            steps.append(
                model(x[:, t : t + 1], positions=pos[:, t : t + 1] if explicit else None, cache=cache)
            )
    assert cache.length == 8
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offset", [0, 11])
@pytest.mark.parametrize("pe", list_encodings())
def test_cached_decoding_equals_full_forward_encoder_decoder(tiny_model, pe: str, offset: int) -> None:
    model = tiny_model(pe, "encoder_decoder")
    src, tgt = ids(2, 6), ids(2, 7, seed=1)
    pos = torch.arange(offset, offset + 7).unsqueeze(0)
    explicit = offset > 0
    with torch.no_grad():
        memory = model.encode(src)
        full = model.decode(tgt, memory, tgt_pos=pos if explicit else None)
        cache = model.new_cache()
        steps = [
            model.decode(
                tgt[:, t : t + 1], memory, tgt_pos=pos[:, t : t + 1] if explicit else None, cache=cache
            )
            for t in range(7)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", ["rope", "t5", "alibi"])
def test_cached_decoding_with_cross_attention_pe(tiny_model, pe: str) -> None:
    model = tiny_model(pe, "encoder_decoder", pe_apply={"encoder": True, "decoder": True, "cross": True})
    assert model.pe_cross is not None
    src, tgt = ids(2, 6), ids(2, 5, seed=1)
    with torch.no_grad():
        memory = model.encode(src)
        full = model.decode(tgt, memory)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t : t + 1], memory, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_with_per_row_positions_then_default_batch_positions(tiny_model) -> None:
    model = tiny_model("rope")
    x = ids(2, 5)
    pos = torch.tensor([[0, 1, 2, 3], [0, 2, 4, 6]])
    with torch.no_grad():
        cache = model.new_cache()
        model(x[:, :4], positions=pos, cache=cache)
        out = model(x[:, 4:], cache=cache)  # (1, 1) default positions broadcast against the (2, 4) cache
    assert out.shape == (2, 1, V) and cache.positions.shape == (2, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pe", list_encodings())
def test_half_precision_outputs_are_finite(tiny_model, pe: str, dtype: torch.dtype) -> None:
    dec = tiny_model(pe).to(dtype)
    encdec = tiny_model(pe, "encoder_decoder").to(dtype)
    with torch.no_grad():
        a = dec(ids(2, 8))
        b = encdec(ids(2, 8), ids(2, 8, seed=1))
    assert a.dtype == dtype and b.dtype == dtype
    assert torch.isfinite(a).all() and torch.isfinite(b).all()


@pytest.mark.parametrize("name", ["rope", "xpos"])
def test_bf16_rotation_uses_unquantised_positions(name: str) -> None:
    pe = build_encoding(name, d_model=64, n_heads=1, causal=True)
    # position 1001 is not representable in bf16 (it rounds to 1000): positions must stay integers
    assert torch.tensor(1001.0, dtype=torch.bfloat16).item() != 1001
    x = torch.randn(1, 1, 1, 64)
    pos = torch.tensor([[1001]])
    ref = pe.rotate(x, pos, is_query=True)  # fp32
    cos, sin = pe.cos_sin(pos)
    assert cos.dtype == torch.float32
    angle = 1001 * pe.base_inv_freq().to(torch.float64)
    torch.testing.assert_close(cos.flatten().double(), angle.cos(), atol=1e-6, rtol=0)
    got = pe.rotate(x.bfloat16(), pos, is_query=True)
    assert got.dtype == torch.bfloat16
    tol = dict(atol=3e-2, rtol=2e-2)  # bf16 precision of the *values*
    torch.testing.assert_close(got.float(), ref, **tol)
    quantised = pe.rotate(x, torch.tensor([[1000]]), is_query=True)
    assert not torch.allclose(quantised, ref, **tol)  # a rounded position would fail the check above


@pytest.mark.parametrize("pe", list_encodings())
def test_bf16_autocast_forward_backward(tiny_model, pe: str) -> None:
    """Mixed precision (Lightning's ``bf16-mixed``): fp32 weights, bf16 matmuls."""
    for kind in KINDS:
        model = tiny_model(pe, kind).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids(2, 8)) if kind == "decoder" else model(ids(2, 8), ids(2, 8, seed=1))
        out.float().logsumexp(-1).mean().backward()
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("pe", ["sinusoidal", "rope", "t5"])
def test_explicit_positions_reach_every_attention(tiny_model, pe: str) -> None:
    """Sparse (randomized-style) positions: forward == encode/decode with them, != default positions."""
    model = tiny_model(
        pe, "encoder_decoder", pe_apply={"encoder": True, "decoder": True, "cross": pe != "sinusoidal"}
    )
    src, tgt = ids(2, 5), ids(2, 4, seed=1)
    src_pos = torch.tensor([[0, 3, 4, 9, 20], [1, 2, 5, 6, 7]])
    tgt_pos = torch.tensor([[0, 2, 7, 8]])
    with torch.no_grad():
        out = model(src, tgt, src_pos=src_pos, tgt_pos=tgt_pos)
        memory = model.encode(src, None, src_pos)
        torch.testing.assert_close(out, model.decode(tgt, memory, tgt_pos=tgt_pos, src_pos=src_pos))
        assert (out - model(src, tgt)).abs().max() > 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_default_positions_continue_an_explicit_offset(tiny_model, kind: str) -> None:
    model = tiny_model("rope", kind)
    x = ids(2, 6)
    pos = torch.arange(100, 106).unsqueeze(0)
    with torch.no_grad():
        if kind == "decoder":
            full = model(x, positions=pos)
            cache = model.new_cache()
            steps = [model(x[:, :2], positions=pos[:, :2], cache=cache)]
            steps += [model(x[:, t : t + 1], cache=cache) for t in range(2, 6)]  # default: 102, 103, ...
        else:
            memory = model.encode(ids(2, 4, seed=2))
            full = model.decode(x, memory, tgt_pos=pos)
            cache = model.new_cache()
            steps = [model.decode(x[:, :2], memory, tgt_pos=pos[:, :2], cache=cache)]
            steps += [model.decode(x[:, t : t + 1], memory, cache=cache) for t in range(2, 6)]
    assert cache.positions.tolist() == [list(range(100, 106))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", list_encodings())
def test_sparse_per_row_positions_full_forward_equals_cached_steps(tiny_model, pe: str) -> None:
    """Randomized-position training feeds sorted sparse (B, T) positions: the full forward and the
    step-by-step cached path must agree, and differ from contiguous positions."""
    model = tiny_model(pe)
    x = ids(2, 6)
    pos = torch.tensor([[0, 3, 4, 9, 20, 21], [1, 2, 5, 6, 7, 30]])
    with torch.no_grad():
        full = model(x, positions=pos)
        cache = model.new_cache()
        steps = [model(x[:, t : t + 1], positions=pos[:, t : t + 1], cache=cache) for t in range(6)]
        contiguous = model(x)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    if pe != "nope" and not ENCODINGS[pe].content_positions:
        assert (full - contiguous).abs().max() > 1e-4


def test_kv_cache_appends_in_place_and_reorders_rows() -> None:
    """Decoding steps write into spare capacity (no copy of the past); reorder keeps rows and capacity."""
    from posformer.model.cache import LayerCache

    cache = LayerCache()
    chunks = [torch.randn(3, 2, t, 4) for t in (5, 1, 1, 2)]
    for c in chunks:
        k, v = cache.append(c, -c)
    want = torch.cat(chunks, 2)
    assert torch.equal(k, want) and torch.equal(v, -want)
    buffer_ptr = cache.k.data_ptr()
    cache.append(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    assert cache.k.data_ptr() == buffer_ptr and cache.k.shape == (3, 2, 10, 4)  # same buffer, no copy
    before = cache.k.clone()
    rows = torch.tensor([2, 0, 0])
    cache.reorder(rows)
    assert torch.equal(cache.k, before[rows])
    new = torch.randn(3, 2, 1, 4)
    k, _ = cache.append(new, new)
    assert torch.equal(k, torch.cat((before[rows], new), 2))


def test_kv_cache_keeps_gradients_when_they_are_needed() -> None:
    from posformer.model.cache import LayerCache

    cache = LayerCache()
    a, b = torch.randn(1, 1, 2, 4, requires_grad=True), torch.randn(1, 1, 1, 4, requires_grad=True)
    cache.append(a, a)
    k, _ = cache.append(b, b)
    k.sum().backward()
    assert torch.equal(a.grad, torch.ones_like(a)) and torch.equal(b.grad, torch.ones_like(b))


@pytest.mark.parametrize("name", ["rope", "xpos"])
def test_rotary_tables_are_built_once_per_forward(tiny_model, name: str, monkeypatch) -> None:
    """All layers share one cos/sin table per positions tensor (query and key side) in a forward."""
    model = tiny_model(name, n_layers=3)
    calls = []
    original = model.pe.rotary_tables
    monkeypatch.setattr(
        model.pe, "rotary_tables", lambda p, **kw: (calls.append(kw["is_query"]), original(p, **kw))[1]
    )
    with torch.no_grad():
        model(ids(2, 8))
    assert sorted(calls) == [False, True]  # not 3 layers x (q, k)


@pytest.mark.parametrize(
    ("pe", "kind"),
    [  # each case traces the model through dynamo + AOT autograd (1-3 s): rope-decoder stays in the fast set
        pytest.param(pe, kind, marks=() if (pe, kind) == ("rope", "decoder") else pytest.mark.slow)
        for pe, kind in [(pe, "decoder") for pe in ("sinusoidal", "rope", "t5", "shaw")]
        + [("alibi", "encoder_decoder")]
    ],
)
def test_torch_compile_matches_eager(tiny_model, pe: str, kind: str) -> None:
    """torch.compile (traced through AOT autograd, no code generation) gives the eager outputs and grads."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model(pe, kind).train()
    x = ids(2, 8)
    args = (x, ids(2, 6, seed=1)) if kind == "encoder_decoder" else (x,)
    ref = model(*args)
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    names = sorted(model.state_dict())
    model.compile(backend="aot_eager")
    out = model(*args)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-5, msg=n)
    assert sorted(model.state_dict()) == names  # checkpoints keep their parameter names


@pytest.mark.parametrize("kind", KINDS)
def test_shaw_no_grad_forward_equals_training_forward(tiny_model, kind: str) -> None:
    """Shaw's fused no-grad attention inside both models gives the logits of the explicit path."""
    model = tiny_model("shaw", kind, pe_options={"shortcut_min_len": 0})  # k 16 < 24: every region
    x = ids(2, 24)
    args = (x, ids(2, 20, seed=1)) if kind == "encoder_decoder" else (x,)
    model.attention_policy = BackendPolicy(off=frozenset({"shortcut"}))
    explicit = model(*args).detach()
    model.attention_policy = BackendPolicy()
    used = []
    for pe in {m for m in model.modules() if type(m).__name__ == "ShawRelative"}:
        original = pe.attention
        pe.attention = lambda *a, _o=original, **kw: (used.append(1), _o(*a, **kw))[1]
    with torch.no_grad():
        fused = model(*args)
    assert used  # the shortcut ran
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])
def test_embed_pe_is_added_in_units_of_the_token_embedding_std(kind: str) -> None:
    """x = tokens + std * table: the 2017 recipe (std 1) exactly as the paper, decoder-only at the
    kaiming std sqrt(2/d) (the ratio of position to token signal is the same in both recipes)."""
    from posformer.model import ModelConfig, build_model
    from posformer.pe.sinusoidal import sinusoid_table

    torch.manual_seed(0)
    cfg = ModelConfig(
        kind=kind,
        vocab_size=11,
        d_model=16,
        n_heads=2,
        n_layers=1,
        n_encoder_layers=1,
        n_decoder_layers=1,
        dropout=0.0,
        pe="sinusoidal",
    )
    model = build_model(cfg).eval()
    emb = model.tok_emb if kind == "decoder" else model.tgt_emb
    pe = model.pe if kind == "decoder" else model.pe_dec
    ids, pos = torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
    want_std = 1.0 if kind == "encoder_decoder" else (2 / 16) ** 0.5
    assert cfg.embedding_std == want_std
    scale = 16**0.5 if cfg.scale_embedding else 1.0
    tokens = emb(ids) * scale
    got = model._embed(emb, pe, ids, pos)
    want = tokens + want_std * sinusoid_table(pos, 16)
    if kind == "encoder_decoder":
        assert torch.equal(got, tokens + sinusoid_table(pos, 16))  # bitwise: the unscaled path
    torch.testing.assert_close(got, want)
    assert abs(float(emb.weight[1:].std()) * scale / want_std - 1) < 0.25  # it is the tokens' std
