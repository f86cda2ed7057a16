"""NoPE: no positional information (Kazemnejad et al. 2023, "The Impact of Positional Encoding on
Length Generalization in Transformers").

A causal decoder can still infer positions from the causal mask; a bidirectional encoder without
a PE is permutation-equivariant.
"""

from __future__ import annotations

from posformer.pe import register
from posformer.pe.base import PositionalEncoding


@register("nope")
class NoPositionalEncoding(PositionalEncoding):
    paper = "Kazemnejad et al. 2023"
    extrapolates = "yes (decoder-only)"
