"""Autoregressive decoding: greedy and beam search for the encoder-decoder model, greedy/sampling
``generate`` for the decoder-only model. All of it runs through the KV cache (``model.new_cache()``,
``cache.reorder``) unless ``use_cache=False``, which re-runs the whole prefix every step (the
reference the cached path is tested against).

Beam search follows Vaswani et al. (2017) §6.1 and the fairseq/GNMT conventions:

* hypotheses are scored by ``log P(Y|X) / lp(Y)`` with the GNMT length penalty
  ``lp(Y) = ((5 + |Y|) / 6) ** alpha`` (Wu et al. 2016), where ``|Y|`` counts the generated tokens
  including the final EOS;
* the maximum output length is ``max_len_a * |X| + max_len_b`` per sentence (paper: ``|X| + 50``);
  at that length EOS is forced;
* each step takes the top ``2K`` extensions of the ``K`` live beams; an extension ending in EOS
  that ranks among the top ``K`` is finished, the best ``K`` others stay alive;
* a sentence stops as soon as it has ``K`` finished hypotheses ("early stop when all beams are
  finished"); the answer is the finished hypothesis with the best length-normalised score.

With ``beam_size=1`` this is exactly greedy decoding. Sentences of a batch are flattened to
``B*K`` rows; finished sentences are dropped from the batch (``cache.reorder`` with a subset).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posformer.devices import activation_dtype
from posformer.errors import ConfigError, PositionRangeError
from posformer.model.positions import position_limit

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def length_penalty(length: int | float | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (Wu et al. 2016, eq. 14)."""
    return ((5.0 + length) / 6.0) ** alpha


def _max_lengths(
    src_mask: Tensor | None, src: Tensor, max_len_a: float, max_len_b: int, max_len: int | None
) -> Tensor:
    """Per-sentence output budget (B,) int64, at least 1."""
    if src_mask is not None:
        src_len = src_mask.sum(1)
    else:
        src_len = torch.full((src.shape[0],), src.shape[1], device=src.device)
    limit = (max_len_a * src_len.double()).floor().long() + int(max_len_b)
    if max_len is not None:
        limit = limit.clamp(max=int(max_len))
    return limit.clamp(min=1)


def _check_room(model, prompts: Tensor, max_new_tokens: int, *, cached: bool) -> None:
    """Refuse before the first step a :func:`generate` whose positions (the last step reads position
    ``T + max_new_tokens - 2`` of prompts (B, T)) are more than the model's PEs represent in its dtype
    (a learned table, xPos' range; ``cached``: a KV cache, whose positions cannot be centred), instead
    of failing at the step that crosses the limit. Beam search usually ends long before its budget, so
    its steps are checked as they come."""
    prompt = prompts.shape[1]
    needed = prompt + max(max_new_tokens - 1, 0)
    dtype = activation_dtype(prompts.device.type, next(model.parameters()).dtype)
    limit = position_limit(model, dtype, centred=not cached)
    if limit is None or needed <= limit[0]:
        return
    n, pe = limit
    where = "" if n == pe.max_positions else f" in {str(dtype).removeprefix('torch.')}"
    fix = f"use max_new_tokens <= {n - prompt + 1}" if n >= prompt else f"shorten the prompt to {n}"
    raise PositionRangeError(
        f"a prompt of {prompt} tokens and max_new_tokens={max_new_tokens} need {needed} positions, but "
        f"pe={pe.name!r} represents {n}{where}: {fix}."
    )


def _check_common(beam_size: int, alpha: float) -> None:
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ConfigError(f"beam_size={beam_size!r} must be a positive integer (paper: 4).")
    if alpha < 0:
        raise ConfigError(f"length-penalty alpha={alpha} must be >= 0 (paper: 0.6; 0 = no penalty).")


def _step_logprobs(
    model, seqs: Tensor, memory: Tensor, src_mask: Tensor | None, cache, banned: tuple[int, ...]
) -> Tensor:
    """Next-token log-probabilities (N, V) in float32 for rows whose prefix is ``seqs`` (N, t)."""
    if cache is not None:
        logits = model.decode(seqs[:, -1:], memory, src_mask, cache=cache)[:, -1]
    else:
        logits = model.decode(seqs, memory, src_mask)[:, -1]
    logp = F.log_softmax(logits.float(), dim=-1)
    if banned:
        logp[:, list(banned)] = float("-inf")
    return logp


@torch.no_grad()
def greedy_decode(
    model,
    src: Tensor,
    src_mask: Tensor | None = None,
    *,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    max_len: int | None = None,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    pad_id: int = PAD_ID,
    use_cache: bool = True,
) -> list[list[int]]:
    """Greedy decoding of a batch ``src`` (B, S) -> one token list per sentence (no BOS/EOS).

    Same conventions as :func:`beam_search` (EOS forced at the per-sentence maximum length).
    """
    hyps = beam_search(
        model,
        src,
        src_mask,
        beam_size=1,
        alpha=0.0,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        max_len=max_len,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        use_cache=use_cache,
    )
    return hyps


@dataclass
class _Hyp:
    tokens: list[int]  # generated tokens, EOS excluded
    score: float  # length-normalised
    logprob: float  # raw sum of log-probabilities (EOS included)


@torch.no_grad()
def beam_search(
    model,
    src: Tensor,
    src_mask: Tensor | None = None,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    max_len: int | None = None,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    pad_id: int = PAD_ID,
    use_cache: bool = True,
    return_scores: bool = False,
    n_best: int = 1,
) -> list:
    """Batched beam search with the encoder-decoder ``model``.

    Args:
        src: source ids (B, S); ``src_mask`` (B, S) bool, True = real token.
        beam_size: K (paper: 4). ``alpha``: length-penalty exponent (paper: 0.6).
        max_len_a, max_len_b: output budget ``a * |X| + b`` per sentence (paper: ``|X| + 50``);
            ``max_len`` caps it.
        use_cache: incremental decoding through the KV cache (else re-run the prefix each step).
        return_scores: return ``(tokens, normalised score)`` pairs instead of token lists.
        n_best: return the best ``n_best <= K`` hypotheses per sentence (a list per sentence) when > 1.

    Returns:
        per sentence the best hypothesis' tokens (BOS/EOS stripped), or ``(tokens, score)`` when
        ``return_scores``, or a list of those when ``n_best > 1``.
    """
    _check_common(beam_size, alpha)
    if not 1 <= n_best <= beam_size:
        raise ConfigError(f"n_best={n_best} must be in [1, beam_size={beam_size}].")
    was_training = model.training
    model.eval()
    try:
        max_lens = _max_lengths(src_mask, src, max_len_a, max_len_b, max_len)
        hyps = _beam_search(
            model, src, src_mask, beam_size, alpha, max_lens, bos_id, eos_id, pad_id, use_cache
        )
    finally:
        model.train(was_training)
    out = []
    for sent in hyps:
        sent = sent or [_Hyp([], float("-inf"), float("-inf"))]
        ranked = sorted(sent, key=lambda h: h.score, reverse=True)[:n_best]
        items = [(h.tokens, h.score) if return_scores else h.tokens for h in ranked]
        out.append(items if n_best > 1 else items[0])
    return out


def _beam_search(
    model,
    src: Tensor,
    src_mask: Tensor | None,
    K: int,
    alpha: float,
    max_lens: Tensor,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    use_cache: bool,
) -> list[list[_Hyp]]:
    B, device = src.shape[0], src.device
    memory = model.encode(src, src_mask)  # (B, S, D)
    rows = torch.arange(B, device=device).repeat_interleave(K)  # sentence of each flat row
    memory = memory.index_select(0, rows)  # (B*K, S, D)
    mask = src_mask.index_select(0, rows) if src_mask is not None else None
    cache = model.new_cache() if use_cache else None
    banned = tuple(sorted({pad_id, bos_id} - {eos_id}))

    active = torch.arange(B, device=device)  # original index of each active sentence
    seqs = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)  # (Ba*K, t) incl. BOS
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # only one live beam at the start (others would duplicate it)
    finished: list[list[_Hyp]] = [[] for _ in range(B)]
    step = 0
    while active.numel():
        step += 1  # length of the hypotheses after this step (EOS included)
        Ba = active.numel()
        logp = _step_logprobs(model, seqs, memory, mask, cache, banned)  # (Ba*K, V)
        V = logp.shape[-1]
        at_limit = max_lens[active] <= step  # (Ba,) EOS forced
        if at_limit.any():
            forced = at_limit.repeat_interleave(K)
            eos_col = logp[forced, eos_id].clone()
            logp[forced] = float("-inf")
            logp[forced, eos_id] = eos_col
        cand = (scores.unsqueeze(-1) + logp.view(Ba, K, V)).view(Ba, K * V)
        top_scores, top_idx = cand.topk(min(2 * K, K * V), dim=1)  # (Ba, 2K), sorted
        top_beam, top_tok = top_idx // V, top_idx % V
        is_eos = (top_tok == eos_id) & torch.isfinite(top_scores)

        # finish EOS extensions ranked within the top K
        lp = float(length_penalty(step, alpha))
        eos_hits = is_eos[:, :K].nonzero().tolist()
        if eos_hits:
            top_scores_l, top_beam_l = top_scores.tolist(), top_beam.tolist()
            for b, j in eos_hits:
                sent = finished[int(active[b])]
                if len(sent) >= K:
                    continue
                beam = top_beam_l[b][j]
                tokens = seqs[b * K + beam, 1:].tolist()
                sent.append(_Hyp(tokens, top_scores_l[b][j] / lp, top_scores_l[b][j]))

        # the best K non-EOS extensions stay alive
        alive_scores = top_scores.masked_fill(is_eos | (top_tok == eos_id), float("-inf"))
        alive_scores, order = alive_scores.topk(K, dim=1)  # (Ba, K)
        beam_sel = top_beam.gather(1, order)
        tok_sel = top_tok.gather(1, order)
        flat = (torch.arange(Ba, device=device).unsqueeze(1) * K + beam_sel).view(-1)  # (Ba*K,)
        seqs = torch.cat((seqs.index_select(0, flat), tok_sel.view(-1, 1)), dim=1)
        scores = alive_scores

        done = torch.tensor(
            [len(finished[int(i)]) >= K for i in active.tolist()], device=device
        ) | ~torch.isfinite(scores[:, 0])
        keep_rows = flat
        if done.any():
            keep = (~done).nonzero().squeeze(1)  # (Ba',)
            sub = (keep.unsqueeze(1) * K + torch.arange(K, device=device)).view(-1)  # rows of kept sentences
            active, scores, seqs = active[keep], scores[keep], seqs.index_select(0, sub)
            memory = memory.index_select(0, sub)
            mask = mask.index_select(0, sub) if mask is not None else None
            keep_rows = flat.index_select(0, sub)
        if cache is not None and active.numel():
            cache.reorder(keep_rows)
    return finished


@torch.no_grad()
def generate(
    model,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    pad_id: int = PAD_ID,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    on_token: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """Continue prompts with the decoder-only ``model``.

    Args:
        input_ids: prompts (B, T) (all real tokens; same length).
        max_new_tokens: tokens to add.
        temperature: 0 = greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
        top_k: sample only among the ``top_k`` most likely tokens.
        eos_id: rows that produced it are padded with ``pad_id`` afterwards.
        use_cache: incremental decoding (else re-run the whole sequence each step).
        generator: RNG for sampling (deterministic runs).
        on_token: called with each step's new tokens (B,) as they are chosen (a caller that is
            interrupted keeps what was generated so far).

    Returns:
        (B, T + max_new_tokens) prompt followed by the continuation.
    """
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy).")
    _check_room(model, input_ids, max_new_tokens, cached=use_cache)
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache() if use_cache else None
        seq = input_ids
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        step_input = input_ids
        for _ in range(max_new_tokens):
            logits = (model(step_input, cache=cache) if cache is not None else model(seq))[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, pad_id)
                done = done | (nxt == eos_id)
            seq = torch.cat((seq, nxt.unsqueeze(1)), dim=1)
            step_input = nxt.unsqueeze(1)
            if on_token is not None:
                on_token(nxt)
    finally:
        model.train(was_training)
    return seq
