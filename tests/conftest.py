"""Shared test helpers: tiny model configurations for every positional encoding."""

from __future__ import annotations

from typing import Any

import torch

from posformer.model import ModelConfig, build_model
from posformer.pe import ENCODINGS, list_encodings

ALL_PES = list_encodings()
#: PEs that may run in a bidirectional encoder (xPos is causal-only)
ENCODER_PES = [name for name in ALL_PES if not ENCODINGS[name].capabilities.causal_only]


def tiny_config(pe: str, kind: str = "decoder", **overrides: Any) -> ModelConfig:
    """A 1-layer, d_model=16, 2-head config, dropout off; causal-only PEs stay out of the encoder."""
    pe_apply = {"encoder": pe in ENCODER_PES, "decoder": True, "cross": False}
    values: dict[str, Any] = dict(
        kind=kind,
        vocab_size=13,
        d_model=16,
        n_heads=2,
        n_layers=1,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=32,
        dropout=0.0,
        pe=pe,
        pe_apply=pe_apply,
    )
    values.update(overrides)
    return ModelConfig(**values)


def tiny_model(pe: str, kind: str = "decoder", seed: int = 0, **overrides: Any):
    """:func:`tiny_config` built into a model in eval mode, with a fixed seed."""
    torch.manual_seed(seed)
    return build_model(tiny_config(pe, kind, **overrides)).eval()
