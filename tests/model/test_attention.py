"""Attention fast paths against a naive reference, and the benchmark's smoke run.

The reference is ``softmax(q·kᵀ/√d + bias + mask)·v`` (plus Shaw's value term) written out with
plain tensor ops; every optimisation in :mod:`posformer.model.attention` (Toeplitz bias from one
offset vector, causal query blocks, chunking, the explicit-backward autograd function; the
backends of :mod:`posformer.model.backends`) must match it in outputs and gradients, for every PE,
with padding and cached decoding offsets.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import Tensor

from posformer.model.attention import AttentionContext, attend
from posformer.model.backends import BACKENDS, BackendPolicy, choose, offset
from posformer.model.backends.masked import BiasedAttention
from posformer.pe import ENCODINGS, build_encoding, list_encodings
from posformer.pe.forms import reads

ATTN_PES = [n for n in list_encodings() if n not in ("nope", "learned", "sinusoidal")] + [None]


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pe,
    q_pos: Tensor,
    k_pos: Tensor,
    causal: bool,
    pad: Tensor | None,
    layer: int = 0,
    feats: dict | None = None,
) -> Tensor:
    """Naive attention: explicit scores, bias, masks, softmax (q, k already rotated).

    ``feats``: layer -> (query, key) input features for PEs whose bias reads the layer input."""
    tq, tk = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if pe is not None and "bias" in pe.caps.hooks:
        extra = {"k": k} if "k" in reads(pe.caps.bias) else {}
        if "x" in reads(pe.caps.bias):
            extra["q_feats"], extra["k_feats"] = feats[layer]
        scores = scores + pe.bias(q_pos, k_pos, q=q, layer=layer, **extra)
    keep = torch.ones(1, 1, tq, tk, dtype=torch.bool)
    if causal:
        keep = keep & (torch.arange(tk) <= torch.arange(tq).unsqueeze(-1) + tk - tq)
    if pad is not None:
        keep = keep & pad.view(-1, 1, 1, tk)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = probs @ v
    if pe is not None and "value" in pe.caps.hooks:
        out = out + pe.value(probs, q_pos, k_pos, layer=layer)
    return out


def _setup(name, causal, tq, tk, b=2, h=2, dh=8, layers=2, seed=0):
    torch.manual_seed(seed)
    pe = None
    if name is not None:
        pe = build_encoding(name, d_model=h * dh, n_heads=h, causal=causal, n_layers=layers)
        with torch.no_grad():  # make learned biases non-trivial
            for p in pe.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    q = torch.randn(b, h, tq, dh, requires_grad=True)
    k = torch.randn(b, h, tk, dh, requires_grad=True)
    v = torch.randn(b, h, tk, dh, requires_grad=True)
    return pe, q, k, v


def _compare(pe, q, k, v, q_pos, k_pos, causal, pad, *, chunk_bytes, block_rows, layers=(0, 1)):
    """attend vs reference for two layers sharing one context: outputs and all gradients."""
    ctx = AttentionContext(
        pe if pe is not None and pe.caps.in_attention else None,
        q_pos,
        k_pos,
        causal=causal,
        key_padding_mask=pad,
        chunk_bytes=chunk_bytes,
        causal_block_rows=block_rows,
    )
    qr, kr = ctx.rotate(q, q_pos, is_query=True), ctx.rotate(k, k_pos, is_query=False)
    feats = {}
    if "x" in reads(ctx.bias_form):  # layer-input features, as attention sets them
        g = torch.Generator().manual_seed(1)
        for i in layers:
            x = torch.randn(k.shape[0], k.shape[2], ctx.pe.d_model, generator=g)
            k_feats = ctx.pe.input_features(x, layer=i)
            feats[i] = (k_feats[:, :, -q.shape[2] :], k_feats)
            ctx.set_features(i, *feats[i])
    got = sum(attend(qr, kr, v, ctx, layer=i) * (i + 1) for i in layers)
    want = sum(
        reference(qr, kr, v, ctx.pe, q_pos, k_pos, causal, pad, layer=i, feats=feats) * (i + 1)
        for i in layers
    )
    rows = pad.any(-1) if pad is not None else None
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    params = [q, k, v] + (list(pe.parameters()) if pe is not None else [])
    g = torch.randn_like(got)
    g1 = torch.autograd.grad((got * g).sum(), params, allow_unused=True, retain_graph=True)
    g2 = torch.autograd.grad((want * g).sum(), params, allow_unused=True)
    for a, b in zip(g1, g2):
        if a is None or b is None:
            assert a is None or not a.abs().sum(), "gradient where the reference has none"
            continue
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3), (a - b).abs().max()
    del rows


@pytest.mark.parametrize("name", ATTN_PES)
@pytest.mark.parametrize("causal", [True, False])
def test_attend_matches_reference(name, causal):
    if name is not None and ENCODINGS[name].causal_only and not causal:
        pytest.skip(f"{name} is causal-only")
    t = 40
    pe, q, k, v = _setup(name, causal, t, t)
    pos = torch.arange(t).unsqueeze(0)
    # one block / causal query blocks / tiny chunks (several per block)
    for chunk_bytes, block_rows in ((2**30, 0), (2**30, 16), (2 * 2 * 2 * t * 4 * 16, 0), (1, 16)):
        _compare(pe, q, k, v, pos, pos, causal, None, chunk_bytes=chunk_bytes, block_rows=block_rows)


@pytest.mark.parametrize("name", ATTN_PES)
def test_attend_padding_and_cache_offsets(name):
    """Cached decoding: 7 new queries over 30 keys (offset positions), left padding in one row."""
    tq, tk = 7, 30
    causal = True
    pe, q, k, v = _setup(name, causal, tq, tk)
    k_pos = torch.arange(5, 5 + tk).unsqueeze(0)
    q_pos = k_pos[:, -tq:]
    pad = torch.ones(2, tk, dtype=torch.bool)
    pad[1, :4] = False
    for chunk_bytes, block_rows in ((2**30, 0), (1, 16), (1, 2)):
        _compare(pe, q, k, v, q_pos, k_pos, causal, pad, chunk_bytes=chunk_bytes, block_rows=block_rows)
        _compare(pe, q, k, v, q_pos, k_pos, causal, None, chunk_bytes=chunk_bytes, block_rows=block_rows)


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple", "fire"])
def test_non_contiguous_positions_take_the_generic_path(name):
    """Sparse (randomised) and batched positions: the offset-vector path must not be used wrongly."""
    pe, q, k, v = _setup(name, True, 12, 12)
    sparse = torch.tensor([[0, 2, 3, 7, 8, 9, 15, 20, 21, 30, 31, 40]])
    batched = torch.stack((torch.arange(12), torch.arange(3, 15)))
    for pos in (sparse, batched):
        _compare(pe, q, k, v, pos, pos, True, None, chunk_bytes=1, block_rows=4)


def test_offset_vector_used_and_shared_across_layers():
    pe, q, k, v = _setup("t5", True, 32, 32)
    pos = torch.arange(32).unsqueeze(0)
    ctx = AttentionContext(pe, pos, pos, causal=True, causal_block_rows=8)
    calls = []
    orig = pe.bias
    pe.bias = lambda *a, **kw: calls.append(a[0].shape) or orig(*a, **kw)
    for layer in range(3):
        attend(q, k, v, ctx, layer=layer)
    assert ctx.uses_offset_vector
    assert calls == [torch.Size([1, 1])]  # one query against all offsets, once for all layers and blocks


def _backend(q, k, ctx, dropout_p=0.0) -> str:
    """Name of the backend the decision picks for this call on the CPU."""
    return choose(q, k, ctx, dropout_p=dropout_p, device_type="cpu")


def test_dispatch_order():
    """Which backend the dispatcher tries first, by PE capabilities, positions, padding and grad mode."""
    t = 8
    pos, shifted, sparse = (
        torch.arange(t)[None],
        torch.arange(3, 3 + t)[None],
        torch.tensor([[0, 2, 3, 5, 6, 9, 10, 12]]),
    )
    pad = torch.ones(2, t, dtype=torch.bool)
    q = torch.randn(2, 2, t, 8)
    step = q[:, :, -2:]  # a cached two-token step: 2 queries over 8 keys

    def pe(name: str, causal: bool = True, **options: int):
        return build_encoding(name, d_model=16, n_heads=2, causal=causal, n_layers=2, **options)

    cases = [
        (None, pos, pos, q, None, "fused"),
        (pe("rope"), pos, pos, q, None, "fused"),
        (pe("rope"), pos, pos, q, pad, "masked"),
        (None, pos[:, -2:], pos, step, None, "masked"),
        (pe("alibi"), shifted, shifted, q, None, "offset"),
        (pe("alibi"), shifted, shifted, q, pad, "offset"),
        (pe("alibi"), sparse, sparse, q, None, "masked"),
        (pe("t5"), pos[:, -2:], pos, step, None, "offset"),
        (pe("fire"), pos, pos, q, None, "masked"),
        (pe("shaw"), pos, pos, q, None, "explicit"),  # 8 tokens: below the shortcut's 16 k
        (pe("shaw", shortcut_min_len=0), pos, pos, q, None, "shortcut"),  # trains through its shortcut too
        (pe("shaw"), shifted, shifted, q, None, "explicit"),  # not at positions 0 … T-1
        (pe("cope"), pos, pos, q, None, "shortcut"),  # gradients on: CoPE's training attention (CPU)
        (pe("cope"), pos, pos, q, pad, "shortcut"),  # padded rows: its training attention reads the mask
        (pe("cope"), shifted, shifted, q, None, "masked"),  # not at index distances: the masked path
        (pe("shaw", shortcut_min_len=0), pos, pos, q, pad, "shortcut"),  # padded rows: a mask per region
    ]
    for p, q_pos, k_pos, qq, padding, want in cases:
        ctx = AttentionContext(p, q_pos, k_pos, causal=True, key_padding_mask=padding)
        assert _backend(qq, q, ctx) == want, (p, want)
    alibi = AttentionContext(pe("alibi"), pos, pos, causal=True)
    no_offset = AttentionContext(
        pe("alibi"), pos, pos, causal=True, policy=BackendPolicy(off=frozenset({"offset"}))
    )
    assert _backend(q, q, no_offset) == "masked"
    assert _backend(q, q, alibi) == "offset"
    shaw = pe("shaw", shortcut_min_len=0)  # its shortcut at any length: these cases turn on other facts
    with torch.no_grad():
        assert _backend(q, q, AttentionContext(shaw, pos, pos, causal=True)) == "shortcut"
        assert _backend(q, q, AttentionContext(pe("cope"), pos, pos, causal=True)) == "shortcut"
        assert _backend(q, q, AttentionContext(shaw, shifted, shifted, causal=True)) == "explicit"
        assert _backend(q, q, AttentionContext(shaw, pos, pos, causal=True), dropout_p=0.1) == "explicit"


def test_a_backend_switched_off_gives_the_same_attention_through_the_next_rule():
    pe, q, k, v = _setup("alibi", True, 24, 24)
    pos = torch.arange(24)[None]
    want = attend(q, k, v, AttentionContext(pe, pos, pos, causal=True))
    off = BackendPolicy(off=frozenset({"offset"}))  # the same attention through the materialised mask
    got = attend(q, k, v, AttentionContext(pe, pos, pos, causal=True, policy=off))
    assert torch.allclose(got, want, atol=1e-6)


def test_biased_attention_function_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 2, 5, 5, dtype=torch.float64).masked_fill(
        torch.ones(5, 5).triu(1).bool(), float("-inf")
    )
    mask.requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: BiasedAttention.apply(*a), (q, k, v, mask), atol=1e-6)


def test_biased_attention_forward_runs_the_fused_kernel():
    """A mask that requires grad must not send SDPA to its unfused math path (it picks the kernel by
    ``requires_grad``, also inside an autograd Function's forward, where grad mode is off)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 2, 64, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        BiasedAttention.apply(q, k, v, mask)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops


def test_fully_masked_rows_have_finite_gradients():
    """A left-padded query that sees no real key must not poison gradients with NaN."""
    pe, q, k, v = _setup("t5", True, 6, 6)
    pos = torch.arange(6).unsqueeze(0)
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, :3] = False
    ctx = AttentionContext(pe, pos, pos, causal=True, key_padding_mask=pad)
    out = attend(q, k, v, ctx)
    out[:, :, 3:].sum().backward()  # only real query rows are scored
    assert all(torch.isfinite(p.grad).all() for p in (q, k, v, pe.table.weight))


@pytest.mark.parametrize("name", ["t5", "alibi", "rope", "shaw"])
def test_model_cached_generation_matches_full_forward(tiny_model, name):
    model = tiny_model(name, vocab_size=50, n_layers=2)
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :8], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(8, 20)
        ]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


@pytest.mark.slow  # a benchmark run: training, evaluation, generation, MFU (~4 s); fast: the next test
def test_bench_quick_writes_outputs(tmp_path):
    from posformer.cli.bench import main

    main(
        [
            "--quick",
            "--pes",
            "nope,t5",
            "--out",
            str(tmp_path),
            "--eval-lengths",
            "64",
            "--sections",
            "train,eval,gen,mfu",
        ]
    )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data["pes"]) == {"nope", "t5"}
    row = data["rows"][0]
    for key in ("train_tok_s", "train_peak_mb", "ratio_nope", "eval_64_s", "gen_cached", "gen_speedup"):
        assert key in row
    assert data["pes"]["t5"]["train"]["tok_s"] > 0
    assert data["mfu"]["32"]["mfu"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| PE |" in md and "| t5 |" in md


def test_bench_times_changes_before_and_after(tmp_path, capsys):
    """``--before denormals,offset``: the same ALiBi model alternated with denormals kept and the offset
    backend switched off (it must really be off in those steps), and the ratio in the table."""
    from posformer.cli.bench import main

    seen: list[str] = []
    original = offset.run
    counting = lambda *a: seen.append("offset") or original(*a)  # noqa: E731
    patched = {**BACKENDS, "offset": counting}
    with pytest.MonkeyPatch.context() as mp:
        import posformer.model.attention as attention

        mp.setattr(attention, "BACKENDS", patched)
        main(
            ["--quick", "--pes", "alibi", "--sections", "train", "--no-compare", "--no-nope-reference"]
            + ["--before", "denormals,offset", "--out", str(tmp_path)]
        )
    data = json.loads((tmp_path / "bench.json").read_text())
    train = data["pes"]["alibi"]["train"]
    assert train["ratio_before"] > 0 and len(train["reps"]["posformer-before_tok_s"]) == 2
    assert len(seen) == 2 * 3  # 2 layers x (1 warm-up + 2 timed steps), none in the "before" steps
    assert "vs before (denormals+offset)" in (tmp_path / "bench.md").read_text()
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--before", "masked", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--before masked: not a change the benchmark can undo" in capsys.readouterr().err


@pytest.mark.parametrize("switch", ["flex_offsets", "flex_divisible"])
def test_bench_before_a_policy_switch_turns_that_switch_only_off(switch, tmp_path, monkeypatch):
    """``--before flex_offsets`` (``flex_divisible``): the alternated run's steps carry that
    ``BackendPolicy`` switch off, every other on, and no backend switched off; posformer's own steps
    keep the default (on a GPU the two then time Flex reading the offset vector against Flex computing
    ALiBi's ``slope·(j - i)`` per score; the kernel told the lengths divide by 128, or not)."""
    from posformer.bench.measure import Trainer
    from posformer.cli.bench import main

    policies = []
    step = Trainer.step
    monkeypatch.setattr(Trainer, "step", lambda self: policies.append(self.policy) or step(self))
    argv = ["--quick", "--pes", "alibi", "--sections", "train", "--no-compare", "--no-nope-reference"]
    main([*argv, "--before", switch, "--out", str(tmp_path)])
    seen = {(p.flex_offsets, p.flex_divisible, p.off) for p in policies}
    before = (switch != "flex_offsets", switch != "flex_divisible", frozenset())
    assert seen == {(True, True, frozenset()), before}
    assert json.loads((tmp_path / "bench.json").read_text())["pes"]["alibi"]["train"]["ratio_before"] > 0
