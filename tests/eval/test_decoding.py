"""Greedy/beam search and decoder-only generation (posformer.eval.decoding)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import posformer
from posformer.errors import ConfigError
from posformer.eval.decoding import BOS_ID, EOS_ID, beam_search, generate, greedy_decode, length_penalty
from posformer.model import ModelConfig, build_model


def _seq2seq(pe: str = "sinusoidal", vocab: int = 13, seed: int = 4):
    """A random small model whose output head is re-drawn (std 0.6) so that, on ``_src()``, sentences
    end at varied lengths: some by EOS, some at the length limit (seed 4 checked by hand)."""
    torch.manual_seed(seed)
    encoder = not posformer.ENCODINGS[pe].causal_only
    pe_apply = {"encoder": encoder, "decoder": True, "cross": False}
    cfg = ModelConfig(
        kind="encoder_decoder",
        vocab_size=vocab,
        d_model=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        pe=pe,
        pe_apply=pe_apply,
        tie_embeddings=False,
    )
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        model.out_proj.weight.copy_(torch.randn(model.out_proj.weight.shape, generator=g) * 0.6)
    return model


def _src(batch: int = 4, length: int = 6, vocab: int = 13, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, length - 2 :] = False  # one padded sentence
    src = src.masked_fill(~mask, 0)
    return src, mask


def _logprob(model, src, mask, tokens: list[int]) -> float:
    """log P(tokens + EOS | src) by teacher forcing."""
    tgt = torch.tensor([[BOS_ID, *tokens]])
    logp = F.log_softmax(model(src, tgt, mask).float(), -1)[0]
    target = [*tokens, EOS_ID]
    return float(sum(logp[i, t] for i, t in enumerate(target)))


def test_length_penalty_formula():
    assert length_penalty(1, 0.6) == pytest.approx((6 / 6) ** 0.6)
    assert length_penalty(10, 0.6) == pytest.approx((15 / 6) ** 0.6)
    assert length_penalty(7, 0.0) == 1.0
    assert length_penalty(torch.tensor(3.0), 1.0).item() == pytest.approx(8 / 6)


def test_beam_one_equals_greedy_reference():
    model = _seq2seq()
    src, mask = _src()
    beam1 = beam_search(model, src, mask, beam_size=1, alpha=0.6, max_len_b=8)
    greedy = greedy_decode(model, src, mask, max_len_b=8)
    assert beam1 == greedy
    lengths = {len(h) for h in greedy}
    # both endings occur: EOS, and the length limit (6 + 8 tokens including the forced EOS)
    assert len(lengths) > 1 and max(lengths) == 6 + 8 - 1 and min(lengths) < 6
    # independent reference: argmax loop without the cache, per sentence
    for b in range(src.shape[0]):
        s, m = src[b : b + 1, : int(mask[b].sum())], None
        seq = [BOS_ID]
        limit = int(mask[b].sum()) + 8
        while True:
            logits = model(s, torch.tensor([seq]), m)[0, -1].float()
            logits[[0, BOS_ID]] = float("-inf")
            if len(seq) == limit:
                break
            nxt = int(logits.argmax())
            if nxt == EOS_ID:
                break
            seq.append(nxt)
        assert greedy[b] == seq[1:], b


def test_beam_search_finds_brute_force_optimum():
    vocab = 6  # PAD BOS EOS + 3 real tokens: 121 candidate outputs of <= 5 tokens
    model = _seq2seq(vocab=vocab, seed=3)
    src = torch.tensor([[3, 4, 5]])
    max_len, alpha = 5, 0.6  # outputs of up to 5 tokens including EOS
    best, best_score = None, -math.inf
    for n in range(max_len):
        for toks in itertools.product([3, 4, 5], repeat=n):
            score = _logprob(model, src, None, list(toks)) / length_penalty(n + 1, alpha)
            if score > best_score:
                best, best_score = list(toks), score
    ((tokens, score),) = beam_search(
        model, src, None, beam_size=128, alpha=alpha, max_len=max_len, return_scores=True
    )
    assert tokens == best
    assert score == pytest.approx(best_score, abs=1e-4)
    assert len(best) >= 2  # a non-trivial optimum (seed 3: [4, 4, 5]) ...
    ((_, small),) = beam_search(
        model, src, None, beam_size=2, alpha=alpha, max_len=max_len, return_scores=True
    )
    assert small < best_score - 1e-3  # ... that a narrow beam misses


def test_beam_scores_are_length_normalised_logprobs():
    model = _seq2seq()
    src, mask = _src()
    out = beam_search(model, src, mask, beam_size=4, alpha=0.6, max_len_b=6, return_scores=True, n_best=3)
    for b, hyps in enumerate(out):
        assert len(hyps) == 3
        assert [h[1] for h in hyps] == sorted((h[1] for h in hyps), reverse=True)
        n = int(mask[b].sum())
        for tokens, score in hyps:
            assert len(tokens) + 1 <= n + 6
            lp = _logprob(model, src[b : b + 1, :n], None, tokens)
            assert score == pytest.approx(lp / length_penalty(len(tokens) + 1, 0.6), abs=1e-4)


@pytest.mark.parametrize("pe", posformer.list_encodings())
def test_cached_equals_uncached_for_every_pe(pe):
    model = _seq2seq(pe=pe)
    src, mask = _src()
    kw = dict(max_len_b=5)
    assert greedy_decode(model, src, mask, use_cache=True, **kw) == greedy_decode(
        model, src, mask, use_cache=False, **kw
    )
    cached = beam_search(model, src, mask, beam_size=3, return_scores=True, n_best=2, use_cache=True, **kw)
    plain = beam_search(model, src, mask, beam_size=3, return_scores=True, n_best=2, use_cache=False, **kw)
    for c, p in zip(cached, plain):
        assert [t for t, _ in c] == [t for t, _ in p]
        assert [s for _, s in c] == pytest.approx([s for _, s in p], abs=1e-4)


def test_batched_equals_one_by_one():
    model = _seq2seq()
    src, mask = _src()
    batched = beam_search(model, src, mask, beam_size=4, max_len_b=6, return_scores=True)
    for b in range(src.shape[0]):
        n = int(mask[b].sum())
        (single,) = beam_search(model, src[b : b + 1, :n], None, beam_size=4, max_len_b=6, return_scores=True)
        assert single[0] == batched[b][0]
        assert single[1] == pytest.approx(batched[b][1], abs=1e-4)


def test_bad_beam_arguments():
    model = _seq2seq()
    src, mask = _src()
    with pytest.raises(ConfigError, match="beam_size"):
        beam_search(model, src, mask, beam_size=0)
    with pytest.raises(ConfigError, match="alpha"):
        beam_search(model, src, mask, alpha=-1.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_cache_matches_no_cache(tiny_model, temperature):
    model = tiny_model("rope", vocab_size=17, d_model=32, n_heads=4, n_layers=2)  # seed 0
    prompt = torch.randint(0, 17, (2, 5))
    out = [
        generate(
            model,
            prompt,
            7,
            temperature=temperature,
            top_k=5,
            use_cache=c,
            generator=torch.Generator().manual_seed(4),
        )
        for c in (True, False)
    ]
    assert out[0].shape == (2, 12)
    assert torch.equal(out[0], out[1])
    assert torch.equal(out[0][:, :5], prompt)


def test_generation_past_the_pes_positions_is_refused_before_the_first_step(tiny_model, monkeypatch):
    """A learned table of 12 positions: a prompt of 5 and 8 new tokens read positions 0 … 11 and run;
    9 new tokens would need position 12: refused in one line naming the sum, the limit and the most
    tokens that fit, before any forward (a spy counts none), not at the step that crosses it."""
    from posformer.errors import PositionRangeError

    model = tiny_model("learned", pe_options={"max_len": 12})
    prompt = torch.randint(4, 13, (2, 5))
    assert generate(model, prompt, 8).shape == (2, 13)
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    for cached in (True, False):
        with pytest.raises(
            PositionRangeError,
            match=r"a prompt of 5 tokens and max_new_tokens=9 need 13 positions, but pe='learned' represents "
            r"12: use max_new_tokens <= 8\.",
        ):
            generate(model, prompt, 9, use_cache=cached)
    with pytest.raises(PositionRangeError, match="shorten the prompt to 12"):
        generate(model, torch.randint(4, 13, (1, 13)), 1)
    assert not calls


def test_xpos_generation_is_held_to_the_uncentred_range_with_a_cache(tiny_model):
    """xPos (``scale_base=1``: 70 positions, 129 centred): with a cache, generation past 70 positions
    is refused up front (its keys are stored rotated from origin 0); without one, every step is a
    whole forward that centres its positions, and 100 positions run."""
    from posformer.errors import PositionRangeError

    model = tiny_model("xpos", pe_options={"scale_base": 1.0})
    prompt = torch.randint(4, 13, (1, 60))
    cached = generate(model, prompt, 11)  # positions 0 … 69
    assert cached.shape == (1, 71)
    with pytest.raises(PositionRangeError, match=r"71 positions, but pe='xpos' represents 70 in float32"):
        generate(model, prompt, 12)
    whole = generate(model, prompt, 41, use_cache=False)  # the steps past 70 positions centred
    assert whole.shape == (1, 101) and torch.equal(whole[:, :71], cached)
