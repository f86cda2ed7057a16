"""Attention spans (sliding windows, chunks) against a written-out reference, in every backend that
takes them, with padding, packed documents and cache offsets; cached decoding with rolling caches
equals the full forward."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from posformer.model import ModelConfig, build_model
from posformer.model.backends import BACKENDS, choose
from posformer.model.context import AttentionContext, BackendPolicy
from posformer.model.schedule import Span
from posformer.pe import build_encoding
from posformer.pe.forms import reads

SPANS = [Span("sliding", 3), Span("sliding", 4), Span("chunked", 4)]
#: no PE; offset-only (ALiBi); learned offset-only (T5); elementwise over positions (FIRE); a value
#: term (Shaw); a bias that reads q and k (CoPE, causal only)
PES = [None, "alibi", "t5", "fire", "shaw", "cope"]
#: the representative cases of the PE grids (the others are ``slow``, the suite's rule): the offset vector
#: with Flex (ALiBi) and the explicit softmax (Shaw)
FAST = ("alibi", "shaw")


def grid(names: list) -> list:
    """``names`` as parameters, all but :data:`FAST` marked slow."""
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


def reference_keep(tq: int, tk: int, causal: bool, span: Span, key_start: int, pad, seg) -> Tensor:
    """(B|1, 1, Tq, Tk) bool, written out element by element from the definitions."""
    rows = pad.shape[0] if pad is not None else seg.shape[0] if seg is not None else 1
    keep = torch.zeros(rows, 1, tq, tk, dtype=torch.bool)
    for b in range(rows):
        for i in range(tq):
            qi = i + tk - tq  # the query's key index
            for j in range(tk):
                a_i, a_j = qi + key_start, j + key_start
                ok = not causal or j <= qi
                if span.kind == "sliding":
                    ok = ok and (a_j > a_i - span.window if causal else abs(a_i - a_j) <= span.window // 2)
                if span.kind == "chunked":
                    ok = ok and a_i // span.window == a_j // span.window
                if pad is not None:
                    ok = ok and bool(pad[b, j])
                if seg is not None:
                    ok = ok and bool(seg[b, qi] == seg[b, j])
                keep[b, 0, i, j] = ok
    return keep


def reference(q, k, v, pe, q_pos, k_pos, keep, sinks=None) -> Tensor:
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if pe is not None and "bias" in pe.caps.hooks:
        extra = {"k": k} if "k" in reads(pe.caps.bias) else {}
        scores = scores + pe.bias(q_pos, k_pos, q=q, **extra)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), -1)
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    probs = probs[..., :-1] if sinks is not None else probs
    out = probs @ v
    if pe is not None and "value" in pe.caps.hooks:
        out = out + pe.value(probs, q_pos, k_pos)
    return out


def _pe(name, causal):
    if name is None:
        return None
    torch.manual_seed(1)
    pe = build_encoding(name, d_model=16, n_heads=2, causal=causal, n_layers=1)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe


def backends_for(ctx: AttentionContext) -> list[str]:
    """Every backend that can compute this call (besides the decision's own pick)."""
    if ctx.has_value:
        return ["explicit"]
    names = ["masked"]
    if ctx.uses_offset_vector and not ctx.sinks:
        names.append("offset")
    if not ctx.has_bias or ctx.bias_form.score_mod:
        names.append("flex")
    return names


def check_every_backend(name, causal, span, mask, tq, tk, key_start=0, sinks=None) -> None:
    pe = _pe(name, causal)
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, t, 8, requires_grad=True) for t in (tq, tk, tk))
    k_pos = torch.arange(key_start, key_start + tk)[None]
    q_pos = k_pos[:, -tq:]
    pad = seg = None
    if mask == "padding":
        pad = torch.ones(2, tk, dtype=torch.bool)
        pad[1, -1] = False  # a padded last token: every query still sees a real key
    if mask == "documents":
        seg = torch.tensor([[0] * (tk // 2) + [1] * (tk - tk // 2), [0, 0, 0] + [1] * (tk - 3)])
    keep = reference_keep(tq, tk, causal, span, key_start, pad, seg)
    want = reference(q, k, v, pe, q_pos, k_pos, keep, sinks)
    grads = [q, k, v] + ([sinks] if sinks is not None else [])
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * g).sum(), grads)
    for backend in ["auto", *backends_for_ctx(pe, q_pos, k_pos, causal, pad, seg, span, key_start, sinks)]:
        for chunk_bytes in (2**30, 1):  # one block; many query blocks
            ctx = AttentionContext(
                pe,
                q_pos,
                k_pos,
                causal=causal,
                key_padding_mask=pad,
                segment_ids=seg,
                span=span,
                key_start=key_start,
                sinks=sinks is not None,
                chunk_bytes=chunk_bytes,
                causal_block_rows=2,
                policy=BackendPolicy(choice="flex" if backend == "flex" else "auto", flex_compiled=False),
            )
            if sinks is not None:
                ctx.set_sinks(0, sinks)
            grad = backend != "flex"  # FlexAttention has no CPU backward
            qkv = (q, k, v) if grad else (q.detach(), k.detach(), v.detach())
            with torch.set_grad_enabled(grad):
                auto = choose(*qkv[:2], ctx, dropout_p=0.0, device_type="cpu")
                chosen = auto if backend == "auto" else backend
                got = BACKENDS[chosen](*qkv, ctx, 0, 0.0)
            assert torch.allclose(got, want, atol=1e-5), (backend, chosen, (got - want).abs().max())
            if grad:
                got_grads = torch.autograd.grad((got * g).sum(), grads)
                for a, b in zip(got_grads, want_grads, strict=True):
                    assert torch.allclose(a, b, atol=1e-4), (backend, chosen, (a - b).abs().max())


def backends_for_ctx(pe, q_pos, k_pos, causal, pad, seg, span, key_start, sinks) -> list[str]:
    ctx = AttentionContext(
        pe,
        q_pos,
        k_pos,
        causal=causal,
        key_padding_mask=pad,
        segment_ids=seg,
        span=span,
        key_start=key_start,
        sinks=sinks is not None,
    )
    return backends_for(ctx)


@pytest.mark.parametrize("name", grid(PES))
@pytest.mark.parametrize("span", SPANS, ids=str)
@pytest.mark.parametrize("mask", ["none", "padding", "documents"])
def test_causal_spans_match_the_reference_in_every_backend(name, span, mask) -> None:
    if name == "cope" and mask == "documents":
        pytest.skip("CoPE counts gates over the visible keys: documents are covered by test_packing")
    check_every_backend(name, True, span, mask, 10, 10)


@pytest.mark.parametrize("name", grid([n for n in PES if n != "cope"]))
@pytest.mark.parametrize("span", SPANS, ids=str)
def test_bidirectional_spans_match_the_reference(name, span) -> None:
    check_every_backend(name, False, span, "padding", 10, 10)


@pytest.mark.parametrize("name", grid(PES))
@pytest.mark.parametrize("span", SPANS, ids=str)
def test_spans_at_cache_offsets_use_absolute_indices(name, span) -> None:
    """3 new queries over the 7 keys a rolling cache holds, which start at absolute index 5."""
    check_every_backend(name, True, span, "none", 3, 7, key_start=5)
    check_every_backend(name, True, span, "padding", 1, 4, key_start=6)


def _decoder(pe: str, kinds: dict, pattern: list[str], **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=32,
        d_model=16,
        n_heads=2,
        n_layers=len(pattern),
        dropout=0.0,
        pe=pe,
        layer_kinds=kinds,
        layers={"pattern": pattern},
        **kw,
    )
    return build_model(cfg).eval()


KINDS = {
    "win": {"span": {"kind": "sliding", "window": 3}},
    "chunk": {"span": {"kind": "chunked", "window": 4}},
    "full": {"pe": "nope", "temperature": {"kind": "llama4", "floor_scale": 3.0, "attn_scale": 0.5}},
}


@pytest.mark.parametrize("pe", ["rope", *grid(["alibi", "t5", "fire", "cope", "forget_alibi", "shaw"])])
def test_cached_decoding_with_rolling_caches_equals_the_full_forward(pe) -> None:
    model = _decoder(pe, KINDS, ["win", "chunk", "full"])
    ids = torch.randint(3, 32, (2, 14))
    pad = torch.ones(2, 14, dtype=torch.bool)
    pad[1, :3] = False  # left padding in one row
    with torch.no_grad():
        full = model(ids, attention_mask=pad)
        cache = model.new_cache()
        steps = [model(ids[:, :5], attention_mask=pad[:, :5], cache=cache)]
        for s, e in ((5, 7), (7, 8), (8, 11), (11, 12), (12, 14)):  # one- and multi-token steps
            steps.append(model(ids[:, s:e], attention_mask=pad[:, s:e], cache=cache))
    got = torch.cat(steps, 1)
    real = pad[:, :, None].expand_as(full)
    assert torch.allclose(got[real], full[real], atol=1e-5), (got - full)[real].abs().max()
    sizes = [layer[0].k.shape[2] for layer in cache.layers]
    assert sizes == [2, 14, 14], sizes  # window - 1 keys; chunks and full attention keep every key


def test_a_rolling_cache_stays_window_sized_over_a_long_generation() -> None:
    model = _decoder("rope", KINDS, ["win"])
    ids = torch.randint(3, 32, (1, 200))
    cache = model.new_cache()
    with torch.no_grad():
        for t in range(200):
            model(ids[:, t : t + 1], cache=cache)
            layer = cache.layers[0][0]
            assert layer.k.shape[2] == min(t + 1, 2)
            assert layer._buf is None or layer._buf[0].shape[2] <= 64  # compacted, never grown


def test_encoder_decoder_with_a_bidirectional_window_and_chunked_decoder() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        kind="encoder_decoder",
        vocab_size=32,
        d_model=16,
        n_heads=2,
        n_encoder_layers=2,
        n_decoder_layers=2,
        dropout=0.0,
        pe="alibi",
        layer_kinds=KINDS,
        layers={"encoder_pattern": ["win"], "decoder": ["chunk", "win"]},
    )
    model = build_model(cfg).eval()
    src, tgt = torch.randint(3, 32, (2, 9)), torch.randint(3, 32, (2, 8))
    with torch.no_grad():
        full = model(src, tgt)
        memory = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t : t + 1], memory, cache=cache) for t in range(8)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    # a window changes the encoder: not the full-attention model's output
    cfg.layers = {}
    torch.manual_seed(0)
    with torch.no_grad():
        assert not torch.allclose(build_model(cfg).eval()(src, tgt), full)


def test_packed_documents_with_windows_equal_each_document_alone() -> None:
    model = _decoder("rope", KINDS, ["win", "chunk"])
    a, b = torch.randint(3, 32, (1, 6)), torch.randint(3, 32, (1, 5))
    seg = torch.tensor([[0] * 6 + [1] * 5])
    with torch.no_grad():
        packed = model(torch.cat((a, b), 1), segment_ids=seg)
        assert torch.allclose(packed[:, :6], model(a), atol=1e-5)
        assert torch.allclose(packed[:, 6:], model(b), atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_windows_plan_window_sized_query_blocks(causal) -> None:
    """O(T·W): each query block of a long sliding-window call reads only the keys its window reaches."""
    from posformer.model.backends.blocks import plan_query_blocks

    t, w = 4096, 64
    pos = torch.arange(t)[None]
    ctx = AttentionContext(None, pos, pos, causal=causal, span=Span("sliding", w))
    blocks, _ = plan_query_blocks(ctx, t, t, bytes_per_row=4 * t)
    assert blocks[0].start == 0 and blocks[-1].end == t
    assert all(a.end == b.start for a, b in zip(blocks, blocks[1:]))
    reach = w - 1 if causal else w // 2
    for b in blocks:
        assert b.end - b.start <= max(ctx.causal_block_rows, reach + 1)
        assert b.first == max(0, b.start - reach)
        assert b.keys == min(t, b.end if causal else b.end + reach)
    scores = sum((b.end - b.start) * (b.keys - b.first) for b in blocks)
    assert scores <= t * (2 * w + ctx.causal_block_rows)  # not t * t / 2


def test_beam_reordering_keeps_a_rolling_cache_right() -> None:
    """``cache.reorder`` (beam search) on a rolling window cache = the reordered rows decoded from scratch."""
    model = _decoder("rope", KINDS, ["win", "full"])
    ids = torch.randint(3, 32, (3, 9))
    index = torch.tensor([2, 0, 0])
    with torch.no_grad():
        cache = model.new_cache()
        for t in range(6):
            model(ids[:, t : t + 1], cache=cache)
        cache.reorder(index)
        got = torch.cat([model(ids[index, t : t + 1], cache=cache) for t in range(6, 9)], 1)
        want = model(ids[index])[:, 6:]
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("span", [Span("sliding", 8), Span("chunked", 16)], ids=str)
def test_compiled_flex_block_masks_of_spans_equal_the_eager_kernel(span) -> None:
    """The compiled FlexAttention kernel (CPU inductor; on CUDA the same mask_mod) with a span's block
    mask, packed documents included, equals the eager kernel (about 15 s of compiling each)."""
    from posformer.model.backends import flex

    if not flex.cpu_compiles():
        pytest.skip("FlexAttention does not compile on this machine's CPU")
    torch.manual_seed(0)
    t = 64
    q, k, v = (torch.randn(2, 2, t, 16) for _ in range(3))
    pos = torch.arange(t)[None]
    pe = build_encoding("alibi", d_model=32, n_heads=2, causal=True)
    seg = torch.tensor([[0] * 30 + [1] * 34, [0] * 10 + [1] * 54])
    outs = []
    for compiled in (False, True):
        policy = BackendPolicy(choice="flex", flex_compiled=compiled)
        ctx = AttentionContext(pe, pos, pos, causal=True, span=span, segment_ids=seg, policy=policy)
        with torch.no_grad():
            outs.append(flex.run(q, k, v, ctx, 0, 0.0))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
