"""Training FLOPs per token, counted analytically: the one count of the benchmark's MFU
(:mod:`posformer.bench`) and of training's (``train/mfu``, :class:`posformer.lit.callbacks.Throughput`)."""

from __future__ import annotations

from torch import nn


def flops_per_token(model: nn.Module, n_layers: int, d_model: int, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token, counted analytically (forward + backward = 3x the forward's).

    ``matmul``: ``6·N``, N the entries of the weight matrices (every parameter with two or more
    dimensions, shared ones once: a tied embedding is the output projection's matmul; position tables
    are lookups and excluded; biases and norms are not matmuls). ``attention``: ``12·L·d·T``, the
    ``q·kᵀ`` and ``P·v`` products (``2·T·d`` FLOPs each per token and layer forward), the causally
    skipped half counted in full (the usual MFU convention: the same count for every attention kernel).
    """
    n = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or p.dim() < 2 or "pe." in name or name.startswith("pe") or "pos_emb" in name:
            continue
        seen.add(id(p))
        n += p.numel()
    matmul, attention = 6.0 * n, 12.0 * n_layers * d_model * seq_len
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}
