"""What a model costs before it is built: its parameters by part, the host memory that holds them, and the
memory of one training step split into the model's state and the batch's activations.

- :func:`parameter_parts`: ``{part: parameters}`` from a :class:`~posformer.model.config.ModelConfig`
  alone (token embeddings and output projection, the layers, position tables sized by a
  ``pe_options.max_len``), to within a few percent (norms and biases left out).
- :func:`check_model_fits`: refuse, before a single tensor is allocated, a model whose float32
  weights alone exceed the host memory available (a checkpoint or config declaring a million layers
  or a width of 10^9: the build would allocate until the kernel kills the process).
- :func:`step_memory`: the bytes of one training step's model state (weights, gradients, Adam's two
  moments) and of its batch's activations, and :func:`oom_cause`: which of them an out-of-memory
  error is about, in words, with the options that shrink it.
"""

from __future__ import annotations

import os
from pathlib import Path

from posformer.errors import ResourceError
from posformer.model.config import ModelConfig

#: bytes per parameter in training with AdamW: float32 weights, gradients and two moments
STATE_BYTES_PER_PARAM = 16
#: bytes per parameter to build a model (float32 weights)
BUILD_BYTES_PER_PARAM = 4


def parameter_parts(cfg: ModelConfig) -> dict[str, int]:
    """``{"embeddings": …, "layers": …, "positions": …}``: the parameters of each part of ``cfg``'s model.

    A layer: attention ``4 d²`` (q, k, v, out), MLP ``2 d d_ff``; an encoder-decoder's decoder layers add
    cross-attention (``4 d²``). Embeddings: the target vocabulary, the source's (unless shared) and an
    output projection (unless tied). Positions: ``max_len x d_model`` when the PE's options name a table
    length (a learned table; an upper bound for others)."""
    d, ff = int(cfg.d_model), int(cfg.ffn_dim)
    layer = 4 * d * d + 2 * d * ff
    if cfg.kind == "decoder":
        layers = int(cfg.n_layers) * layer
        vocab = int(cfg.vocab_size) * d
    else:
        layers = int(cfg.n_encoder_layers) * layer + int(cfg.n_decoder_layers) * (layer + 4 * d * d)
        src = int(cfg.src_vocab_size or cfg.vocab_size)
        vocab = int(cfg.vocab_size) * d + (0 if cfg.share_src_tgt_embedding else src * d)
    embeddings = vocab + (0 if cfg.tie_embeddings else int(cfg.vocab_size) * d)
    max_len = (cfg.pe_options or {}).get("max_len")
    positions = int(max_len) * d if isinstance(max_len, int) and not isinstance(max_len, bool) else 0
    return {"embeddings": embeddings, "layers": layers, "positions": max(positions, 0)}


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup (v2 ``memory.max - memory.current``), or None."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()), 0)
    except (OSError, ValueError):
        return None


def available_memory() -> int | None:
    """Bytes of host memory a new allocation may use: ``MemAvailable`` (Linux), capped by the cgroup's
    limit; ``None`` where neither is known."""
    free: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            free = None
    group = _cgroup_free()
    return min(x for x in (free, group) if x is not None) if free is not None or group is not None else None


def _largest(cfg: ModelConfig, parts: dict[str, int]) -> str:
    """The options that set the largest part, as ``key=value`` words."""
    part = max(parts, key=lambda k: parts[k])
    if part == "layers":
        depth = (
            f"model.n_layers={cfg.n_layers}"
            if cfg.kind == "decoder"
            else f"model.n_encoder_layers={cfg.n_encoder_layers}/n_decoder_layers={cfg.n_decoder_layers}"
        )
        return f"{depth}, model.d_model={cfg.d_model} or model.d_ff={cfg.ffn_dim}"
    if part == "embeddings":
        return f"model.vocab_size={cfg.vocab_size} or model.d_model={cfg.d_model}"
    return f"model.pe_options.max_len={cfg.pe_options.get('max_len')} or model.d_model={cfg.d_model}"


def describe_parts(parts: dict[str, int]) -> str:
    """``"embeddings 8.2e+06, layers 7.9e+11, positions 0"``."""
    return ", ".join(f"{k} {v:.2g}" for k, v in parts.items())


def check_model_fits(cfg: ModelConfig, source: str = "the model config") -> None:
    """Refuse (:class:`ResourceError`, one line) a model whose float32 weights exceed the host memory
    available, before anything is allocated; ``source`` names where the sizes come from (a checkpoint)."""
    parts = parameter_parts(cfg)
    total = sum(parts.values())
    need = BUILD_BYTES_PER_PARAM * total
    free = available_memory()
    if free is None or need <= free:
        return
    crafted = (
        " (a checkpoint you did not train with those sizes is damaged or crafted)"
        if "checkpoint" in source
        else ""
    )
    raise ResourceError(
        f"{source} declares a model of ~{total:.2g} parameters ({describe_parts(parts)}): ~{_size(need)} of "
        f"float32 weights just to build it, more than the {_size(free)} of memory available here; the "
        f"largest part is set by {_largest(cfg, parts)}: lower it{crafted}."
    )


def step_memory(cfg: ModelConfig, batch: int, length: int) -> dict[str, float]:
    """Bytes of one training step: ``state`` (weights, gradients, Adam's moments: 16 B per parameter) and
    ``activations`` (per layer ~``(10 d + 2 d_ff)`` float32 values per token kept for the backward, plus
    one ``T x T`` score matrix per head, and float32 logits with their gradient)."""
    params = sum(parameter_parts(cfg).values())
    d, ff = int(cfg.d_model), int(cfg.ffn_dim)
    depth = sum(cfg.depth(p) for p in cfg.places if p != "cross")
    tokens = float(batch) * float(length)
    per_layer = tokens * (10 * d + 2 * ff) * 4 + float(batch) * int(cfg.n_heads) * float(length) ** 2 * 4
    logits = tokens * int(cfg.vocab_size) * 8
    return {"state": float(STATE_BYTES_PER_PARAM * params), "activations": depth * per_layer + logits}


def oom_cause(cfg: ModelConfig, batch: int, length: int) -> tuple[bool, str]:
    """``(model_is_the_cause, words)`` for an out-of-memory error in training: the estimate of each part
    and, when the model's state outweighs the batch's activations, the options that make the model."""
    parts = parameter_parts(cfg)
    mem = step_memory(cfg, batch, length)
    words = (
        f"estimated: model state ~{_size(mem['state'])} ({sum(parts.values()):.2g} parameters: "
        f"{describe_parts(parts)}; weights, gradients and Adam's moments), activations of a batch of "
        f"{batch}x{length} ~{_size(mem['activations'])}"
    )
    if mem["state"] >= mem["activations"]:
        return True, (
            f"{words}: the model's size is the cause, and a smaller batch will not help: lower "
            f"{_largest(cfg, parts)}, or use a device with more memory"
        )
    return False, words
