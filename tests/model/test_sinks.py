"""Learned attention sinks (gpt-oss): a per-head logit in the softmax denominator, in every backend
(virtual key column on SDPA and the explicit softmax, LSE correction on FlexAttention) against a
written-out reference with the sink as one more softmax entry; gradients reach the sink logits;
cached decoding equals the full forward."""

from __future__ import annotations

import pytest
import torch

from posformer.model import ModelConfig, build_model
from posformer.model.backends.sinks import rescale_by_sinks, with_sink_column
from posformer.model.schedule import Span
from tests.model.test_spans import check_every_backend, grid


@pytest.mark.parametrize("name", grid([None, "alibi", "t5", "fire", "shaw"]))
@pytest.mark.parametrize("span", [Span(), Span("sliding", 3)], ids=str)
@pytest.mark.parametrize("mask", ["none", "padding"])
def test_sinks_match_the_reference_in_every_backend(name, span, mask) -> None:
    sinks = torch.tensor([0.7, -1.3], requires_grad=True)  # (H,)
    check_every_backend(name, True, span, mask, 9, 9, sinks=sinks)
    check_every_backend(name, True, span, mask, 2, 6, key_start=4, sinks=sinks)  # a cached step


def test_the_column_and_the_lse_correction_agree() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, t, 8) for t in (5, 7, 7))
    sinks = torch.tensor([0.0, 2.0, -3.0])
    k2, v2, mask = with_sink_column(q, k, v, None, sinks)
    column = torch.nn.functional.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    out = scores.softmax(-1) @ v
    lse = scores.logsumexp(-1)
    assert torch.allclose(rescale_by_sinks(out, lse, sinks), column, atol=1e-6)
    assert not torch.allclose(out, column, atol=1e-3)  # the sinks take a real share


def _model(sinks: bool, pe: str = "rope", **kw):
    torch.manual_seed(0)
    kinds = {"s": {"sinks": sinks, "span": {"kind": "sliding", "window": 4}}, "g": {"sinks": sinks}}
    cfg = ModelConfig(
        kind="decoder",
        vocab_size=32,
        d_model=16,
        n_heads=2,
        n_layers=2,
        dropout=0.0,
        pe=pe,
        layer_kinds=kinds,
        layers={"pattern": ["s", "g"]},
        **kw,
    )
    return build_model(cfg)


@pytest.mark.parametrize("pe", ["rope", *grid(["alibi", "shaw"])])
def test_cached_decoding_with_sinks_equals_the_full_forward(pe) -> None:
    model = _model(True, pe).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.self_attn.sinks.copy_(torch.tensor([1.5, -0.5]))
        ids = torch.randint(3, 32, (2, 11))
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :4], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(4, 11)
        ]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_sinks_are_learned_and_a_very_low_sink_is_no_sink() -> None:
    with_sinks, without = _model(True), _model(False)
    names = [n for n, _ in with_sinks.named_parameters() if n.endswith("sinks")]
    assert names == ["blocks.0.self_attn.sinks", "blocks.1.self_attn.sinks"]
    ids = torch.randint(3, 32, (2, 10))
    with_sinks(ids).logsumexp(-1).sum().backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in with_sinks.named_parameters() if n in names
    )
    with torch.no_grad():
        for block in with_sinks.blocks:
            block.self_attn.sinks.fill_(-1e4)
        assert torch.allclose(with_sinks(ids), without(ids), atol=1e-5)


def test_sinks_leave_the_compiled_cpu_flex_kernel_which_returns_no_lse() -> None:
    """torch 2.13's compiled CPU FlexAttention has no ``return_lse``: a sinks call there goes to SDPA."""
    from posformer.model.backends import choose
    from posformer.model.context import AttentionContext, BackendPolicy

    pos = torch.arange(8)[None]
    q = torch.randn(1, 2, 8, 16)  # (B, H, T, Dh): Dh 16, the least head size of Flex's GPU kernel
    for compiled, want in ((True, "masked"), (False, "flex")):
        policy = BackendPolicy(choice="flex", flex_compiled=compiled)
        ctx = AttentionContext(None, pos, pos, causal=True, sinks=True, policy=policy)
        with torch.no_grad():
            assert choose(q, q, ctx, dropout_p=0.0, device_type="cpu") == want
        assert choose(q, q, ctx, dropout_p=0.0, device_type="cuda") == "flex"  # CUDA returns the LSE
